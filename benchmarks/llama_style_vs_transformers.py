"""A Llama-style gpt_local model (~125M: rope, GQA, SwiGLU, RMSNorm, no biases, untied head) against
transformers' LlamaForCausalLM with the same weights: forward tokens/s over [batch, 256], greedy generation
tokens/s (32-token prompts + 64 new tokens) and each side's peak RSS, plus the decode KV-cache memory that
grouped-query attention saves (arithmetic).

    python benchmarks/llama_style_vs_transformers.py --rounds 3 --threads 2            # ~125M, batch 1 and 4
    python benchmarks/llama_style_vs_transformers.py --rounds 3 --plain                # + ours without the kernels
    python benchmarks/llama_style_vs_transformers.py --shape tiny --batches 1 --rounds 2
    python benchmarks/llama_style_vs_transformers.py --rounds 2 --compile-cache        # round 1 cold, 2 warm

The parent builds a random LlamaForCausalLM, saves it and converts it with `gptlocal convert hf2ms`
(``checkpoint/hf_models.py``); it imports neither MindSpore nor PyTorch itself. Every round starts one worker
per side (``_common.run_worker``: OMP/MKL/OpenBLAS threads set explicitly and checked inside the worker, MindSpore's
``runtime_num_threads`` and torch's threads set and checked), the sides alternating (ours, HF, HF, ours, ...;
``_common.alternate``). A worker runs ONE job (the forward or generation) at ONE batch: one warm-up (our graphs
compile there) then ``--repeats`` timed calls, and reports their median and the job's peak RSS (each phase's own
VmHWM: import, load, first call, timed calls); one job per process, so the forward's graphs and [4, 256]
activations never count in generation's peak (before, one worker ran both jobs at both batches and reported one
peak for all four). The table gives the median over rounds with [min-max], and ours/HF as the median of the
per-round ratios. ``--plain`` adds ours with
model_config.cpu_kernels {rms_norm: plain, swiglu: plain} (MindSpore's RMSNorm and SiLU * up ops: the state before
the kernels).
fp32, CPU, graph mode for gpt_local (the lean process: MindFormers not loaded).
"""
import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)

SHAPES = {  # ~125M: GPT-2 small's width and depth with Llama's layers, 12 heads over 4 key/value groups
    "120m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                 intermediate_size=2048, vocab_size=32000),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=688, vocab_size=8192),
}
PROMPT, NEW, FORWARD_SEQ = 32, 64, 256
JOBS = ("forward", "generate")
SIDES = {"ours": {}, "ours_plain": {}, "hf": {}}  # each worker's extra environment
# model_config.cpu_kernels given to from_pretrained (ours keeps the converted folder's: auto)
SIDE_KERNELS = {"ours_plain": {"rms_norm": "plain", "swiglu": "plain"}}
LABELS = {"ours": "gpt_local", "ours_plain": "gpt_local, RMSNorm/SwiGLU plain", "hf": "HF LlamaForCausalLM"}


def kv_cache_bytes(shape, batch, length, groups, dtype_bytes=4):
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_hidden_layers"] * batch * groups * length * head_dim * dtype_bytes


def worker(side, directory, job, batch, threads, repeats, cache=None):
    """One side's one job at one batch, as a WORKER line: ``forward`` tokens/s at [batch, FORWARD_SEQ] or greedy
    ``generate`` tokens/s (batch * NEW / wall time of the whole call), the first (compiling) call's seconds, and
    the job's peak RSS per phase (import, load, first call, timed calls; VmHWM reset at each phase's start,
    ``_common.Phases``): one process per job, so neither job's graphs or activations count in the other's peak.
    ``directory`` "-": no model, only the thread checks (tests/tools/test_benchmarks.py). ``cache``: our side with
    MindSpore's compile cache in that folder (one per side, job and batch, so one compile order writes and reads it):
    "cold" when the folder holds no graph yet (the compiles write it), else "warm" (they load it)."""
    report = {"env": C.check_threads(threads, f"{side} llama worker")}
    hf = side == "hf"
    if hf:
        report["runtime_threads"] = C.torch_threads(threads, "hf llama worker")
    else:
        import mindspore as ms
        report["runtime_threads"] = C.mindspore_threads(threads, f"{side} llama worker")
        ms.set_context(mode=ms.GRAPH_MODE)
        if cache:
            report["compile_cache"] = "warm" if any(files for _, _, files in os.walk(cache)) else "cold"
            ms.set_context(enable_compile_cache=True, compile_cache_path=cache)
    if directory == "-":
        return C.emit(report)
    phases = C.Phases()
    if hf:
        import torch
        with phases("import"):
            from transformers import LlamaForCausalLM
        with phases("load"):
            model = LlamaForCausalLM.from_pretrained(os.path.join(directory, "hf")).eval()

        def forward(ids):
            with torch.no_grad():
                model(torch.from_numpy(ids))

        def generate(prompts):
            ids = torch.tensor(prompts)
            with torch.no_grad():
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            assert out.shape[1] == PROMPT + NEW
    else:
        from mindspore import Tensor
        with phases("import"):
            from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM  # the lean process, as gptlocal generate
        with phases("load"):
            kernels = {"cpu_kernels": SIDE_KERNELS[side]} if side in SIDE_KERNELS else {}
            model = GPTLocalForCausalLM.from_pretrained(os.path.join(directory, "ms"), max_batch_size=8,
                                                        seq_length=FORWARD_SEQ, **kernels)
            model.set_train(False)
        layer = model.model.layers[0]
        report["kernels"] = dict(rmsnorm=layer.input_layernorm.kernel is not None,
                                 swiglu=getattr(layer.mlp, "swiglu", None) is not None)

        def forward(ids):
            model(Tensor(ids.astype(np.int32))).asnumpy()

        def generate(prompts):
            out = model.generate(prompts, max_new_tokens=NEW, do_sample=False, eos_token_id=-1)
            assert all(len(row) == PROMPT + NEW for row in out)
    rng = np.random.default_rng(batch)
    vocab = model.config.vocab_size
    if job == "forward":
        fn, arg, tokens = forward, rng.integers(0, vocab, (batch, FORWARD_SEQ)).astype(np.int64), batch * FORWARD_SEQ
    else:
        fn, arg, tokens = generate, rng.integers(0, vocab, (batch, PROMPT)).tolist(), batch * NEW

    def timed():
        start = time.perf_counter()
        fn(arg)
        return time.perf_counter() - start

    with phases("first_call"):
        first = timed()  # the warm-up: our graphs compile here
    with phases("timed"):
        times = [timed() for _ in range(repeats)]
    report.update(job=job, batch=batch, rate=tokens / statistics.median(times), first_call_s=first,
                  phases=phases.peaks, peak_rss_mb=phases.peak(), peak_resets=phases.resets)
    return C.emit(report)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="120m", choices=list(SHAPES))
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="workers per side, the sides alternating")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per batch inside a worker")
    parser.add_argument("--plain", action="store_true",
                        help="also ours with model_config.cpu_kernels {rms_norm: plain, swiglu: plain}")
    parser.add_argument("--compile-cache", action="store_true",
                        help="our side through MindSpore's compile cache (a folder per side, job and batch): round 1 "
                             "compiles and writes it (cold), later rounds load it (warm); the round lines say which")
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=tuple(SIDES))
    parser.add_argument("--job", choices=JOBS, default="forward", help=argparse.SUPPRESS)
    parser.add_argument("--dir")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.worker:
        return worker(args.worker, args.dir, args.job, batches[0], args.threads, args.repeats, args.cache_dir)
    print(C.machine_line(args.threads), flush=True)
    shape = SHAPES[args.shape]
    work = C.scratch_dir("gptlocal-llama-")
    params = prepare(shape, work)
    sides = ("ours", "ours_plain", "hf") if args.plain else ("ours", "hf")
    runs = {}  # (batch, job) -> {side: [reports]}
    for batch in batches:
        for job in JOBS:
            def one(side, index, batch=batch, job=job):
                cache = (["--cache-dir", os.path.join(work, f"compile_cache_{side}_{job}_{batch}")]
                         if args.compile_cache and side != "hf" else [])
                report, _ = C.run_worker(__file__, ["--worker", side, "--dir", work, "--job", job, "--batches",
                                                    str(batch), "--threads", str(args.threads), "--repeats",
                                                    str(args.repeats), *cache], args.threads, **SIDES[side])
                phases = ", ".join(f"{k} {v:.0f}" for k, v in report["phases"].items())
                print(f"b{batch} {job} round {index + 1} {side}: {report['rate']:.1f} tok/s, first call "
                      f"{report['first_call_s']:.1f} s, peak RSS {report['peak_rss_mb']:.0f} MB (each phase's own "
                      f"peak: {phases}), threads {report['runtime_threads']}"
                      + (f", kernels {report['kernels']}" if "kernels" in report else "")
                      + (f", compile cache {report['compile_cache']}" if "compile_cache" in report else ""),
                      flush=True)
                return report
            runs[batch, job] = C.alternate(sides, args.rounds, one)
    print(f"\n{C.machine_line(args.threads)}")
    print(f"{args.shape}: {params / 1e6:.1f}M parameters, {shape['num_attention_heads']} heads over "
          f"{shape['num_key_value_heads']} key/value groups; fp32 CPU, {args.threads} threads; forward "
          f"[batch, {FORWARD_SEQ}], generate {PROMPT}-token prompts + {NEW} greedy tokens; one worker per side, job "
          f"and batch (its peak RSS is that job's alone), {args.rounds} rounds alternating, {args.repeats} timed calls "
          f"each; median [min-max] over rounds, ours/HF the median of the per-round ratios")
    print("| batch | side | forward tok/s | vs HF | forward peak RSS MB | generate tok/s | vs HF "
          "| generate peak RSS MB |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for batch in batches:
        for side in sides:
            cells = []
            for job in JOBS:
                mine, theirs = runs[batch, job][side], runs[batch, job]["hf"]
                ratio = "1.00x" if side == "hf" else C.spread(
                    [r["rate"] / t["rate"] for r, t in zip(mine, theirs)], "{:.2f}") + "x"
                rss = C.spread([r["peak_rss_mb"] for r in mine])
                mb = {who: C.median([r["peak_rss_mb"] for r in reports]) for who, reports in (("mine", mine),
                                                                                              ("hf", theirs))}
                rss_ratio = "" if side == "hf" else f" ({mb['mine'] / mb['hf']:.2f}x)"
                cells += [C.spread([r["rate"] for r in mine], "{:.0f}" if job == "forward" else "{:.1f}"), ratio,
                          rss + rss_ratio]
            print(f"| {batch} | {LABELS[side]} | " + " | ".join(cells) + " |")
    length = 1024
    gqa = kv_cache_bytes(shape, 1, length, shape["num_key_value_heads"])
    mha = kv_cache_bytes(shape, 1, length, shape["num_attention_heads"])
    print(f"decode KV cache per {length}-token sequence (fp32): {gqa / 2 ** 20:.1f} MiB with "
          f"{shape['num_key_value_heads']} key/value heads, {mha / 2 ** 20:.1f} MiB with "
          f"{shape['num_attention_heads']} ({mha / gqa:.0f}x)")
    return None


def prepare(shape, work):
    """The random LlamaForCausalLM saved to work/hf and converted to work/ms, in a worker-free child (the parent
    keeps PyTorch and MindSpore out); returns its parameter count."""
    import subprocess
    code = ("import json, os, sys, torch\n"
            "from transformers import LlamaConfig, LlamaForCausalLM\n"
            "from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms\n"
            "shape, work = json.loads(sys.argv[1]), sys.argv[2]\n"
            "torch.manual_seed(0)\n"
            "hf = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=False,\n"
            "                                  bos_token_id=0, eos_token_id=0, **shape))\n"
            "print('PARAMS', sum(p.numel() for p in hf.parameters()))\n"
            "hf.save_pretrained(os.path.join(work, 'hf'))\n"
            "del hf\n"
            "hf_to_ms(os.path.join(work, 'hf'), os.path.join(work, 'ms'))\n")
    out = subprocess.run([sys.executable, "-c", code, json.dumps(shape), work], capture_output=True, text=True,
                         env=C.worker_env(os.cpu_count()), check=False)
    if out.returncode:
        raise SystemExit(f"preparing the models failed:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return int(next(line.split()[1] for line in out.stdout.splitlines() if line.startswith("PARAMS")))


if __name__ == "__main__":
    main()
