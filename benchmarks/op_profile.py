"""Where the time goes, per op, with MindSpore's profiler: a whole training step (``train``) and the Llama-style
model's inference (``llama``); and, in one process with the two alternating, the CPU kernels against the plain ops.

    python benchmarks/op_profile.py train --shape tiny --batch 4 --seq 256             # per-op table of a step
    python benchmarks/op_profile.py train --shape small --batch 2 --seq 256 --steps 2 --compute-dtype bfloat16
    python benchmarks/op_profile.py train --shape tiny --compare --rounds 8            # kernels vs plain, in-process
    python benchmarks/op_profile.py train --shape small --batch 2 --seq 256 --lora     # a LoRA step, per op
    python benchmarks/op_profile.py train --shape tiny --compare --variants full,lora  # LoRA vs full, in-process
    python benchmarks/op_profile.py train --shape small --batch 2 --dropout-ops --rounds 20  # LoRA dropout ops
    python benchmarks/op_profile.py llama --batch 1 --seq 256 --new 32                 # kernels (the CPU default)
    python benchmarks/op_profile.py llama --batch 1 --seq 256 --new 32 --variant plain # RMSNorm/SwiGLU kernels off
    python benchmarks/op_profile.py llama --compare --rounds 3 --new 16                # kernels vs plain, in-process

``train``: the step is ``GPTLocalTrainOneStepCell`` + ``GPTLocalAdamW`` (clip 1.0) on ``GPTLocalForCausalLM``, dropout
0, random tokens. The profile (``mindspore.Profiler``, CPU op statistics ``cpu_op_detail_info_0.csv``; the AOT Custom
ops named by their Cell) covers ``--steps`` steps after 2 warm-up steps: ms a step per op type and its share of the op
time; ``--groups`` folds them into docs/performance.md's groups. ``--variant plain``: model_config.cpu_kernels
{layer_norm: plain, bias_gelu: plain}; ``--plain-op`` names other cpu_kernels ops for it (e.g. ``linear``; the kernels
variant sets them to ``kernel``). ``--compare`` builds the variants (``--variants``, of ``VARIANTS``; ratios against
the last) in the worker, compiles each, steps them alternating for ``--rounds`` rounds: median step, ratios, and the
largest loss difference between variants that train the same parameters with the same masks. ``--lora``: a LoRA step
(``finetune_throughput.PET_CONFIG``: r 8, alpha 16, lora_dropout 0.05 unless ``--lora-dropout``, base frozen); ops
inside a ``lora_*`` Cell are listed as ``lora:<type>``. ``--dropout-ops``: MindSpore's Dropout, the plain counter
dropout and the LoRA dropout kernel alone (forward + backward) on the adapted Linears' input shapes.

``llama``: the Llama-style ~124M (12 x 768, 12 heads over 4 key/value groups, SwiGLU 2048, RMSNorm, rope, untied
32,000 head; random weights; the model's own classes, as ``gptlocal generate``): one forward over [batch, seq] and a
greedy generation (ms per new token: its op time / ``--new``, the 32-token prefill included), each run twice
unprofiled (compiles) then ``--steps`` times profiled. ``--variant``: cpu_kernels {rms_norm, swiglu} kernel or plain.
``--compare``: the model twice, {rms_norm, swiglu, linear} kernel and plain, the same weights: the largest logits
difference, whether greedy tokens agree, then forward and generation at batch 1 and 4 alternating.

Each part runs in ONE worker (``_common.worker_env``; it calls ``_common.check_threads`` first, then sets MindSpore's
``runtime_num_threads`` to ``--threads``), GRAPH mode, CPU; the parent prints the machine line and the worker's tables.
"""
import argparse
import csv
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # this tree
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)
from finetune_throughput import PET_CONFIG  # noqa: E402  (one pet_config for both)

TRAIN_SHAPES = {"tiny": (4, 256, 4, 8192), "small": (12, 768, 12, 50257)}  # layers, hidden, heads, vocab
GROUPS = (  # (group, op types), in the order of the table
    ("MatMul + BatchMatMul (layers and output head)", ("MatMul", "BatchMatMul")),
    ("attention kernel (AOT, forward + backward)", ("Custom:CPUAttention",)),
    ("LayerNorm + LayerNormGrad (MindSpore)", ("LayerNorm", "LayerNormGrad")),
    ("LayerNorm kernel (AOT, forward + backward)", ("Custom:CPULayerNorm",)),
    ("bias + GeLU kernel (AOT, forward + backward)", ("Custom:CPUBiasGeLU",)),
    ("log-softmax + grad, Gather/GatherD (loss)", ("LogSoftmax", "LogSoftmaxGrad", "GatherD", "GatherDGradV2")),
    ("AdamW (AdamWeightDecay or the kernel)", ("AdamWeightDecay", "FusedCastAdamWeightDecay", "Custom:CPUAdamW")),
    ("GeLU parts: Sigmoid, Mul", ("Sigmoid", "Mul", "FastGeLU", "FastGeLUGrad", "GeLU", "GeLUGrad")),
    ("Add, AddN, BroadcastTo, Sub, Square, ReduceSum (bias, residual, clip)",
     ("Add", "AddN", "BroadcastTo", "Sub", "Square", "ReduceSum", "Custom:CPUSquareSum")),
    ("Transpose, Reshape, Unstack, Stack, Cast (data movement)",
     ("Transpose", "Reshape", "Unstack", "Stack", "Cast", "StridedSlice", "Tile", "Concat")),
    ("embedding gradient (UnsortedSegmentSum), Gather", ("UnsortedSegmentSum", "Gather")),
    ("LoRA branch: dropout (MindSpore Dropout + DropoutGrad, or the kernel)",
     ("lora:Dropout", "lora:DropoutGrad", "Dropout", "DropoutGrad", "lora:Custom:CPULoRADropout")),
    ("LoRA branch: other ops inside lora_* Cells", ("lora:*",)),
)
VARIANTS = {  # name -> (the --plain-op kernels on, a LoRA model, its lora_dropout: None = PET_CONFIG's)
    "plain": (False, False, None),
    "kernels": (True, False, None),
    "full": (True, False, None),
    "lora": (True, True, None),
    "lora-plaindrop": (True, True, None),  # cpu_kernels {lora_dropout: plain}: the plain counter dropout
    "lora-nodrop": (True, True, 0.0),
}
LLAMA = dict(vocab_size=32000, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_query_groups=4,
             ffn_hidden_size=2048, position_embedding_type="rope", hidden_act="swiglu", normalization="RMSNorm",
             add_bias_linear=False, add_qkv_bias=False, untie_embeddings_and_output_weights=True,
             max_position_embeddings=1024, hidden_dropout=0.0, attention_dropout=0.0, layernorm_epsilon=1e-6,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
PROMPT = 32


# ---------------------------------------------------------------------------------------------- the profiler
def op_table(run, steps, divide=1, lora=False, keep_csv=None):
    """({op type: (ms, calls) per ``divide`` units}, wall seconds a unit) of ``run()`` called ``steps`` times under
    ``mindspore.Profiler``. AOT Custom ops are named by their Cell (``Custom:CPUAttention``); ``lora``: ops inside a
    ``lora_*`` Cell as ``lora:<type>``; ``keep_csv``: copy the profiler's CSV there."""
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
            if lora and "lora" in row["full_op_name"]:
                name = f"lora:{name}"
            value, count = totals.get(name, (0.0, 0))
            totals[name] = (value + float(row["op_total_time(ms)"]), count + int(row["op_occurrences"]))
    if keep_csv:
        shutil.copy(path, keep_csv)
    shutil.rmtree(out, ignore_errors=True)
    return {name: (value / steps / divide, count / steps / divide) for name, (value, count) in totals.items()}, wall


def show(title, table, wall, min_ms, groups=False):
    total = sum(value for value, _ in table.values())
    print(f"\n{title}: wall {wall * 1000:.1f} ms, op time {total:.1f} ms")
    if groups:
        print("| ops | ms | share |\n| --- | ---: | ---: |")
        seen = set()
        for group, names in GROUPS:
            if names == ("lora:*",):
                names = tuple(name for name in table if name.startswith("lora:") and name not in seen)
            value = sum(table.get(name, (0, 0))[0] for name in names)
            seen.update(names)
            print(f"| {group} | {value:.1f} | {value / total:.1%} |")
        rest = sum(value for name, (value, _) in table.items() if name not in seen)
        print(f"| everything else | {rest:.1f} | {rest / total:.1%} |\n| total op time | {total:.1f} | 100% |")
        return
    print("| op type | calls | ms | share |\n| --- | ---: | ---: | ---: |")
    rest = 0.0
    for name, (value, count) in sorted(table.items(), key=lambda item: -item[1][0]):
        if value >= min_ms:
            print(f"| {name} | {count:.0f} | {value:.2f} | {value / total:.1%} |")
        else:
            rest += value
    print(f"| everything else | | {rest:.2f} | {rest / total:.1%} |")


# ---------------------------------------------------------------------------------------------- train
def pet_config(args):
    """``PET_CONFIG`` with ``--lora-dropout`` (None: without ``--lora``)."""
    if not args.lora:
        return None
    config = dict(PET_CONFIG)
    if args.lora_dropout is not None:
        config["lora_dropout"] = args.lora_dropout
    return config


def cpu_kernels(plain_ops, kernels, plain_dropout=False):
    """model_config.cpu_kernels of a variant: the ``--plain-op`` ops ``kernel`` (``kernels``) or ``plain``;
    ``plain_dropout``: lora_dropout ``plain`` too (lora-plaindrop)."""
    modes = dict.fromkeys(plain_ops, "kernel" if kernels else "plain")
    if plain_dropout:
        modes["lora_dropout"] = "plain"
    return modes


def build_step(args, kernels, lora=None, plain_dropout=False):
    """One train step: (cell, inputs); ``lora``: a pet_config or None; ``kernels``, ``plain_dropout``: the
    ``cpu_kernels`` (``cpu_kernels``)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, GPTLocalTrainOneStepCell
    from mindformers_gptlocal.training.optim import GPTLocalAdamW
    layers, hidden, heads, vocab = TRAIN_SHAPES[args.shape]
    config = GPTLocalConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            max_position_embeddings=max(1024, args.seq), seq_length=args.seq, hidden_dropout=0.0,
                            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                            hidden_act=args.hidden_act, pet_config=lora, compute_dtype=args.compute_dtype,
                            cpu_kernels=cpu_kernels(args.plain_op, kernels, plain_dropout))
    ms.set_seed(0)
    model = GPTLocalForCausalLM(config)
    optimizer = GPTLocalAdamW(model.trainable_params(), learning_rate=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
    cell = GPTLocalTrainOneStepCell(model, optimizer, use_clip_grad=True, max_grad_norm=1.0, scale_sense=1.0)
    cell.set_train(True)
    tokens = np.random.default_rng(0).integers(0, vocab, (args.batch, args.seq + 1)).astype(np.int32)
    inputs = (Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((args.batch, args.seq), np.int32)),
              Tensor(np.tile(np.arange(args.seq, dtype=np.int32), (args.batch, 1))))
    return cell, inputs


def train_profile(args):
    cell, inputs = build_step(args, args.variant == "kernels", pet_config(args))
    for _ in range(2):
        cell(*inputs)
    table, wall = op_table(lambda: cell(*inputs)[0].asnumpy(), args.steps, lora=args.lora,
                           keep_csv=args.keep_csv and os.path.abspath(args.keep_csv))
    show(f"shape {args.shape} {args.batch} x {args.seq}, variant {args.variant}"
         f"{', LoRA ' + str(pet_config(args)) if args.lora else ''}, compute_dtype {args.compute_dtype}, {args.steps} "
         f"profiled steps, threads {args.threads}, load {os.getloadavg()[0]:.1f}; ms a step", table, wall,
         args.min_ms, args.groups)


def train_compare(args):
    cells, inputs = {}, None
    names = args.variants.split(",")
    for name in names:
        kernels, lora, dropout = VARIANTS[name]
        overrides = {"lora": lora} if dropout is None else {"lora": lora, "lora_dropout": dropout}
        cell, inputs = build_step(args, kernels, pet_config(argparse.Namespace(**{**vars(args), **overrides})),
                                  plain_dropout=name == "lora-plaindrop")
        started = time.perf_counter()
        loss = float(cell(*inputs)[0])
        print(f"{name}: first step (compile) {time.perf_counter() - started:.1f} s, loss {loss:.6f}", flush=True)
        cells[name] = cell
    losses = {name: [] for name in cells}

    def step(name, _index):
        started = time.perf_counter()
        losses[name].append(float(cells[name](*inputs)[0]))
        return time.perf_counter() - started
    times = C.alternate(tuple(names), args.rounds, step)
    medians = {name: statistics.median(values) for name, values in times.items()}
    parts = [f"{name} {medians[name] * 1000:.0f} ms [{min(times[name]) * 1000:.0f}-{max(times[name]) * 1000:.0f}]"
             for name in names]
    ratios = [f"{name} / {names[-1]} {medians[name] / medians[names[-1]]:.2f}x" for name in names[:-1]]

    def masks(name):  # the LoRA dropout rate of a variant (0: none); equal rates draw equal counter masks
        _, lora, dropout = VARIANTS[name]
        rate = dropout if dropout is not None else (
            args.lora_dropout if args.lora_dropout is not None else PET_CONFIG["lora_dropout"])
        return rate if lora else 0.0
    same = [name for name in names[:-1] if VARIANTS[name][1] == VARIANTS[names[-1]][1]
            and masks(name) == masks(names[-1])]
    diffs = [f"max loss diff {name} vs {names[-1]} "
             f"{max(abs(a - b) for a, b in zip(losses[name], losses[names[-1]])):.2e}" for name in same]
    print(f"shape {args.shape} {args.batch} x {args.seq}, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}: "
          + ", ".join(parts + ratios + diffs))


def dropout_ops(args):
    """MindSpore's Dropout, the plain counter dropout and the LoRA dropout kernel, forward + backward
    (``value_and_grad`` of sum(dropout(x) @ w), w [in, 8]: the LoRA A product), alternating."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.dropout import CounterDropout, KernelDropout, lora_dropout_site

    class Branch(nn.Cell):
        def __init__(self, dropout):
            super().__init__()
            self.dropout = dropout

        def construct(self, x, w, step):
            return ops.matmul(self.dropout(x, step), w).sum()

    _, hidden, _, _ = TRAIN_SHAPES[args.shape]
    rate = args.lora_dropout if args.lora_dropout is not None else PET_CONFIG["lora_dropout"]
    tokens = args.batch * args.seq
    for width in (hidden, 4 * hidden):  # qkv / proj / fc1 inputs, fc2's input
        x = Tensor(np.random.default_rng(0).standard_normal((tokens, width)).astype(np.float32))
        w = Tensor(np.ones((width, 8), np.float32))
        step = Tensor(3, ms.int32)
        plain = CounterDropout(rate, lora_dropout_site(1, "attention.linear_qkv"))
        kernel = KernelProvider({"lora_dropout": "kernel"}, device_target="CPU").lora_dropout(plain, ms.float32)
        fns = {}
        for name, cell in (("mindspore", KernelDropout(p=rate)), ("plain", plain), ("kernel", kernel)):
            net = Branch(cell)
            net.set_train(True)
            fns[name] = ms.value_and_grad(net, grad_position=0)
            fns[name](x, w, step)
        times = C.alternate(tuple(fns), args.rounds,
                            lambda name, _i, x=x, w=w, step=step: C.timed(lambda: fns[name](x, w, step)[1].asnumpy()))
        medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
        print(f"dropout p={rate} on [{tokens}, {width}], {args.rounds} rounds, load {os.getloadavg()[0]:.1f}: "
              f"MindSpore Dropout {medians['mindspore']:.2f} ms, plain counter dropout {medians['plain']:.2f} ms, "
              f"kernel {medians['kernel']:.2f} ms, MindSpore / kernel {medians['mindspore'] / medians['kernel']:.2f}x, "
              f"plain / kernel {medians['plain'] / medians['kernel']:.2f}x")


def train_worker(args):
    from mindformers_gptlocal.kernels.provider import OPS
    args.plain_op = [op for op in args.plain_op.split(",") if op]
    unknown = [op for op in args.plain_op if op not in OPS]
    bad = [name for name in args.variants.split(",") if name not in VARIANTS]
    if unknown or bad:
        print(f"--plain-op: {', '.join(unknown)} not an op of model_config.cpu_kernels; the ops: {', '.join(OPS)}"
              if unknown else f"--variants: {bad[0]!r} is not one of {', '.join(VARIANTS)}", file=sys.stderr)
        raise SystemExit(2)
    from mindformers.tools.register import MindFormerConfig
    from mindformers.core.context.build_context import MFContextOperator
    MFContextOperator(MindFormerConfig(use_legacy=False))
    if args.dropout_ops:
        dropout_ops(args)
    elif args.compare:
        train_compare(args)
    else:
        train_profile(args)


# ---------------------------------------------------------------------------------------------- llama
def llama_build(args, modes=None):
    """The Llama-style model with model_config.cpu_kernels ``modes`` (None: ``--variant``'s), for inference."""
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    if modes is None:
        modes = dict.fromkeys(("rms_norm", "swiglu"), "kernel" if args.variant == "kernels" else "plain")
    model = GPTLocalForCausalLM(GPTLocalConfig(seq_length=args.seq, cpu_kernels=modes, **LLAMA))
    model.set_train(False)
    return model


def llama_compare(args):
    """Kernels vs plain in this process, alternating (module docstring)."""
    import numpy as np
    from mindspore import Tensor
    models = {name: llama_build(args, dict.fromkeys(("rms_norm", "swiglu", "linear"), mode))
              for name, mode in (("kernels", "kernel"), ("plain", "plain"))}
    plain = dict(models["plain"].parameters_and_names())
    for name, param in models["kernels"].parameters_and_names():
        plain[name].set_data(param.data.copy())
    rng = np.random.default_rng(0)
    for batch in (1, 4):
        ids = Tensor(rng.integers(0, LLAMA["vocab_size"], (batch, args.seq)).astype(np.int32))
        prompts = rng.integers(0, LLAMA["vocab_size"], (batch, PROMPT)).tolist()
        logits = {name: model(ids).asnumpy() for name, model in models.items()}
        tokens = {name: model.generate(prompts, max_new_tokens=args.new, do_sample=False, eos_token_id=-1)
                  for name, model in models.items()}
        print(f"batch {batch}: largest logits difference {np.abs(logits['kernels'] - logits['plain']).max():.2e}, "
              f"greedy tokens equal: {tokens['kernels'] == tokens['plain']}", flush=True)

        def both(name, _index, ids=ids, prompts=prompts):
            forward = C.timed(lambda: models[name](ids).asnumpy())
            return forward, C.timed(lambda: models[name].generate(prompts, max_new_tokens=args.new, do_sample=False,
                                                                  eos_token_id=-1))
        times = C.alternate(("kernels", "plain"), args.rounds, both)
        for name, runs in times.items():
            forward, generation = [r[0] for r in runs], [r[1] for r in runs]
            print(f"batch {batch} {name}: forward {batch * args.seq / statistics.median(forward):.0f} tok/s "
                  f"[{batch * args.seq / max(forward):.0f}-{batch * args.seq / min(forward):.0f}], generation "
                  f"{batch * args.new / statistics.median(generation):.1f} tok/s "
                  f"[{batch * args.new / max(generation):.1f}-{batch * args.new / min(generation):.1f}]")
        ratio = [statistics.median(r[k] for r in times["plain"]) / statistics.median(r[k] for r in times["kernels"])
                 for k in (0, 1)]
        print(f"batch {batch} kernels/plain speed: forward {ratio[0]:.2f}x, generation {ratio[1]:.2f}x; "
              f"load {os.getloadavg()[0]:.1f}", flush=True)


def llama_worker(args):
    import numpy as np
    from mindspore import Tensor
    if args.compare:
        return llama_compare(args)
    model = llama_build(args)
    rng = np.random.default_rng(0)
    ids = Tensor(rng.integers(0, LLAMA["vocab_size"], (args.batch, args.seq)).astype(np.int32))
    prompts = rng.integers(0, LLAMA["vocab_size"], (args.batch, PROMPT)).tolist()

    def forward():
        model(ids).asnumpy()

    def generate():
        model.generate(prompts, max_new_tokens=args.new, do_sample=False, eos_token_id=-1)

    for _ in range(2):
        forward()
        generate()
    head = f"variant {args.variant}, batch {args.batch}, threads {args.threads}, load {os.getloadavg()[0]:.1f}"
    table, wall = op_table(forward, args.steps)
    show(f"forward [{args.batch}, {args.seq}], {head}", table, wall, args.min_ms)
    table, wall = op_table(generate, args.steps, args.new)
    show(f"generation ({PROMPT}-token prompt + {args.new} greedy tokens) per new token, {head}", table, wall,
         args.min_ms)
    return None


# ---------------------------------------------------------------------------------------------- main
def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    train, llama = parts.add_parser("train"), parts.add_parser("llama")
    for part in (train, llama):
        part.add_argument("--batch", type=int, default=4 if part is train else 1)
        part.add_argument("--seq", type=int, default=256)
        part.add_argument("--threads", type=int, default=2)
        part.add_argument("--variant", choices=("kernels", "plain"), default="kernels")
        part.add_argument("--compare", action="store_true", help="kernels vs plain in one process, alternating")
        part.add_argument("--rounds", type=int, default=6 if part is train else 3)
        part.add_argument("--steps", type=int, default=3 if part is train else 2, help="profiled steps")
        part.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
        part.add_argument("--noop", action="store_true", help=argparse.SUPPRESS)  # threads checked, nothing measured
    train.add_argument("--shape", choices=sorted(TRAIN_SHAPES), default="tiny")
    train.add_argument("--hidden-act", default="gelu_new")
    train.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                       help="model_config.compute_dtype (bfloat16 on CPU: float32 between ops, bf16 GEMMs)")
    train.add_argument("--groups", action="store_true", help="fold op types into the docs' groups")
    train.add_argument("--min-ms", type=float, default=0.5, help="op types below this many ms a step are not listed")
    train.add_argument("--dropout-ops", action="store_true",
                       help="MindSpore's Dropout, the plain counter dropout and the LoRA dropout kernel, alternating")
    train.add_argument("--plain-op", default="layer_norm,bias_gelu",
                       help="comma list of model_config.cpu_kernels ops the plain variant sets to plain (the kernels "
                            "variant: kernel), e.g. linear (Linear's GEMM kernel)")
    train.add_argument("--variants", default="plain,kernels",
                       help="--compare: comma-separated, of " + ", ".join(VARIANTS) + "; ratios against the last")
    train.add_argument("--keep-csv", help="copy the profiler's cpu_op_detail_info_0.csv here")
    train.add_argument("--lora", action="store_true", help="profile a LoRA step (finetune_throughput's PET_CONFIG)")
    train.add_argument("--lora-dropout", type=float, help="--lora: this lora_dropout instead of PET_CONFIG's")
    llama.add_argument("--new", type=int, default=32)
    llama.add_argument("--min-ms", type=float, default=0.05)
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if not args.worker:
        print(C.machine_line(args.threads), flush=True)
        return subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--worker"],
                              env=C.worker_env(args.threads), cwd=tempfile.gettempdir(), check=False).returncode
    report = {"env": C.check_threads(args.threads, f"op_profile {args.part} worker")}
    import mindspore as ms
    report["runtime_threads"] = C.mindspore_threads(args.threads, f"op_profile {args.part} worker")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    if args.noop:
        return C.emit(report)
    return train_worker(args) if args.part == "train" else llama_worker(args)


if __name__ == "__main__":
    sys.exit(main())
