"""Where the Llama-style model's inference goes, per op, with MindSpore's profiler: one forward over [batch, seq] and
a greedy generation (its time a new token), the RMSNorm/SwiGLU kernels on or off.

    python benchmarks/llama_style_profile.py --batch 1 --seq 256 --new 32                 # kernels (CPU default)
    python benchmarks/llama_style_profile.py --batch 1 --seq 256 --new 32 --variant plain # kernels off
    python benchmarks/llama_style_profile.py --compare --rounds 3 --new 16                # kernels vs plain, in-process

The model is benchmarks/llama_style_vs_transformers.py's 120m shape (12 layers, 768 wide, 12 heads over 4
key/value groups, SwiGLU 2048, RMSNorm, rope, untied 32000 head) with random weights, built from the model's own
classes (no MindFormers, as ``gptlocal generate``), GRAPH mode, CPU, ``runtime_num_threads`` = ``--threads``. Each part
runs twice unprofiled (compiles), then ``--steps`` times under ``mindspore.Profiler`` (CPU op statistics,
``cpu_op_detail_info_0.csv``; AOT Custom ops named by their Cell); the tables give ms per forward and ms per
generated token (the generation's op time / ``--new``: it includes the one 32-token prefill) by op type.
``--variant``: model_config.cpu_kernels {rms_norm: kernel, swiglu: kernel} (kernels) or {rms_norm: plain,
swiglu: plain} (plain); the Linears as the default (auto). ``--compare`` builds the model twice in this process,
with cpu_kernels {rms_norm, swiglu, linear: kernel} and {rms_norm, swiglu, linear: plain}, the same weights;
prints the largest logits difference and whether greedy generation agrees, then times forward and generation at
batch 1 and 4 with the two alternating for ``--rounds`` rounds: medians [min-max] and kernels/plain.
"""
import argparse
import csv
import glob
import os
import re
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree

SHAPE = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_query_groups=4,
             ffn_hidden_size=2048, position_embedding_type="rope", hidden_act="swiglu", normalization="RMSNorm",
             add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
             max_position_embeddings=1024, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-6,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
PROMPT = 32


def op_table(run, steps, divide):
    """{op type: (ms per unit, calls per unit)} of ``run()`` called ``steps`` times under the profiler."""
    from mindspore import Profiler
    out = tempfile.mkdtemp(prefix="gptlocal-profile-")
    profiler = Profiler(output_path=out)
    started = time.perf_counter()
    for _ in range(steps):
        run()
    wall = (time.perf_counter() - started) / steps / divide
    profiler.analyse()
    path = glob.glob(os.path.join(out, "**", "cpu_op_detail_info_0.csv"), recursive=True)[0]
    totals = {}
    with open(path, encoding="utf-8") as handle:
        for row in csv.DictReader(handle):
            name = row["op_type"]
            if name == "Custom":
                cell = re.search(r"-(CPU\w+)/", row["full_op_name"])
                name = f"Custom:{cell.group(1) if cell else 'other'}"
            value, count = totals.get(name, (0.0, 0))
            totals[name] = (value + float(row["op_total_time(ms)"]), count + int(row["op_occurrences"]))
    shutil.rmtree(out, ignore_errors=True)
    return {name: (value / steps / divide, count / steps / divide) for name, (value, count) in totals.items()}, wall


def show(title, table, wall, min_ms):
    total = sum(value for value, _ in table.values())
    print(f"\n{title}: wall {wall * 1000:.1f} ms, op time {total:.1f} ms")
    print("| op type | calls | ms | share |\n| --- | ---: | ---: | ---: |")
    rest = 0.0
    for name, (value, count) in sorted(table.items(), key=lambda item: -item[1][0]):
        if value >= min_ms:
            print(f"| {name} | {count:.0f} | {value:.2f} | {value / total:.1%} |")
        else:
            rest += value
    print(f"| everything else | | {rest:.2f} | {rest / total:.1%} |")


def compare(args, build):
    """Kernels vs plain in this process, alternating (module docstring)."""
    import statistics
    import numpy as np
    from mindspore import Tensor
    models = {}
    for name, mode in (("kernels", "kernel"), ("plain", "plain")):
        models[name] = build(dict.fromkeys(("rms_norm", "swiglu", "linear"), mode))
    plain = dict(models["plain"].parameters_and_names())
    for name, param in models["kernels"].parameters_and_names():
        plain[name].set_data(param.data.copy())
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        ids = Tensor(rng.integers(0, SHAPE["vocab_size"], (batch, args.seq)).astype(np.int32))
        prompts = rng.integers(0, SHAPE["vocab_size"], (batch, PROMPT)).tolist()
        logits = {name: model(ids).asnumpy() for name, model in models.items()}
        tokens = {name: model.generate(prompts, max_new_tokens=args.new, do_sample=False, eos_token_id=-1)
                  for name, model in models.items()}
        print(f"batch {batch}: largest logits difference {np.abs(logits['kernels'] - logits['plain']).max():.2e}, "
              f"greedy tokens equal: {tokens['kernels'] == tokens['plain']}", flush=True)
        times = {name: ([], []) for name in models}
        for index in range(args.rounds):
            for name in (("kernels", "plain") if index % 2 == 0 else ("plain", "kernels")):
                started = time.perf_counter()
                models[name](ids).asnumpy()
                middle = time.perf_counter()
                models[name].generate(prompts, max_new_tokens=args.new, do_sample=False, eos_token_id=-1)
                times[name][0].append(middle - started)
                times[name][1].append(time.perf_counter() - middle)
        for name, (forward, generation) in times.items():
            print(f"batch {batch} {name}: forward {batch * args.seq / statistics.median(forward):.0f} tok/s "
                  f"[{batch * args.seq / max(forward):.0f}-{batch * args.seq / min(forward):.0f}], generation "
                  f"{batch * args.new / statistics.median(generation):.1f} tok/s "
                  f"[{batch * args.new / max(generation):.1f}-{batch * args.new / min(generation):.1f}]")
        ratio = [statistics.median(times["plain"][k]) / statistics.median(times["kernels"][k]) for k in (0, 1)]
        print(f"batch {batch} kernels/plain speed: forward {ratio[0]:.2f}x, generation {ratio[1]:.2f}x; "
              f"load {os.getloadavg()[0]:.1f} (busy machine: indicative)", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variant", choices=("kernels", "plain"), default="kernels")
    parser.add_argument("--min-ms", type=float, default=0.05)
    parser.add_argument("--compare", action="store_true", help="kernels vs plain in this process, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM

    def build(cpu_kernels=None):  # model_config.cpu_kernels; None: --variant's
        if cpu_kernels is None:
            cpu_kernels = dict.fromkeys(("rms_norm", "swiglu"), "kernel" if args.variant == "kernels" else "plain")
        built = GPTLocalForCausalLM(GPTLocalConfig(seq_length=args.seq, cpu_kernels=cpu_kernels, **SHAPE))
        built.set_train(False)
        return built

    if args.compare:
        return compare(args, build)
    model = build()
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, SHAPE["vocab_size"], (args.batch, args.seq)).astype(np.int32))
    prompts = rng.integers(0, SHAPE["vocab_size"], (args.batch, PROMPT)).tolist()

    def forward():
        model(ids).asnumpy()

    def generate():
        model.generate(prompts, max_new_tokens=args.new, do_sample=False, eos_token_id=-1)

    for _ in range(2):
        forward()
        generate()
    head = (f"variant {args.variant}, batch {args.batch}, threads {args.threads}, load {os.getloadavg()[0]:.1f} "
            "(busy machine: indicative)")
    table, wall = op_table(forward, args.steps, 1)
    show(f"forward [{args.batch}, {args.seq}], {head}", table, wall, args.min_ms)
    table, wall = op_table(generate, args.steps, args.new)
    show(f"generation ({PROMPT}-token prompt + {args.new} greedy tokens) per new token, {head}", table, wall,
         args.min_ms)


if __name__ == "__main__":
    main()
