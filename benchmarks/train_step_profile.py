"""Where one whole training step goes, per op, with MindSpore's profiler; and the CPU kernels against the plain ops
in ONE process (steps alternating).

    python benchmarks/train_step_profile.py --shape tiny --batch 4 --seq 256            # per-op profile table
    python benchmarks/train_step_profile.py --shape small --batch 2 --seq 256 --steps 2
    python benchmarks/train_step_profile.py --shape tiny --compare --rounds 8            # kernels vs plain, in-process
    python benchmarks/train_step_profile.py --shape small --batch 2 --seq 256 --lora     # a LoRA step, per op
    python benchmarks/train_step_profile.py --shape tiny --compare --variants full,lora  # LoRA vs full, in-process
    python benchmarks/train_step_profile.py --shape small --batch 2 --dropout-ops --rounds 20  # LoRA dropout ops

The step is ``GPTLocalTrainOneStepCell`` + ``GPTLocalAdamW`` (clip 1.0) on ``GPTLocalForCausalLM``, GRAPH mode, CPU,
dropout 0, random tokens; ``runtime_num_threads`` = ``--threads``. The profile (``mindspore.Profiler``, CPU op
statistics, ``cpu_op_detail_info_0.csv``; the AOT Custom ops split by their Cell) covers ``--steps`` steps after 2
warm-up steps and is printed as ms a step per op type, with each type's share of the op time; ``--groups`` folds them
into the groups of docs/performance.md. ``--variant plain`` profiles with model_config.cpu_kernels
{layer_norm: plain, bias_gelu: plain} (MindSpore's LayerNorm and the Add + composed GeLU); ``--plain-op`` names other
ops of cpu_kernels for it (e.g. ``linear``: MatMul instead of Linear's GEMM kernel; the kernels variant sets them to
``kernel``). ``--compare`` builds both variants in this process, compiles each, then steps them in alternating order
for ``--rounds`` rounds and prints the median step time, kernels / plain, and the largest loss difference (the same
batch every step, so the losses must agree step for step).

``--lora`` profiles a LoRA step instead: the model built with ``benchmarks/finetune_throughput.py``'s ``PET_CONFIG``
(r=8, alpha 16, lora_dropout 0.05 unless ``--lora-dropout``, on linear_qkv/proj/fc1/fc2, base frozen; the optimizer
and the clip over the trainable parameters only, as ``gptlocal run`` builds them); ops inside a ``lora_*`` Cell (the
dropout) are listed as ``lora:<type>``; the adapters' MatMuls, Mul and Add are primitives of the LoRALinear itself,
so the profiler's names do not tell them from the base Linear's (they are in the MatMul / Add / Mul rows).
``--compare --variants A,B,...`` steps any of: ``plain``, ``kernels`` (full finetunes), ``full`` (= kernels),
``lora`` (a LoRA model), ``lora-plaindrop`` (its lora_dropout through the plain counter dropout's graph ops,
cpu_kernels {lora_dropout: plain}: the kernel's reference), ``lora-nodrop`` (lora_dropout 0); ratios are
against the last; losses are compared between variants that train the same parameters with the same masks
(lora and lora-plaindrop draw the same counter masks).
``--dropout-ops`` times MindSpore's Dropout, the plain counter dropout and the LoRA dropout kernel alone (forward +
backward).
"""
import argparse
import csv
import glob
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_throughput import PET_CONFIG  # noqa: E402  (benchmarks/ is not a package; one pet_config for both)

SHAPES = {  # layers, hidden, heads, vocab
    "tiny": (4, 256, 4, 8192),
    "small": (12, 768, 12, 50257),
}
GROUPS = (  # (group, op types), in the order of the table
    ("MatMul + BatchMatMul (layers and output head)", ("MatMul", "BatchMatMul")),
    ("attention kernel (AOT, forward + backward)", ("Custom:CPUAttention",)),
    ("LayerNorm + LayerNormGrad (MindSpore)", ("LayerNorm", "LayerNormGrad")),
    ("LayerNorm kernel (AOT, forward + backward)", ("Custom:CPULayerNorm",)),
    ("bias + GeLU kernel (AOT, forward + backward)", ("Custom:CPUBiasGeLU",)),
    ("log-softmax + grad, Gather/GatherD (loss)", ("LogSoftmax", "LogSoftmaxGrad", "GatherD", "GatherDGradV2")),
    ("AdamW (AdamWeightDecay)", ("AdamWeightDecay", "FusedCastAdamWeightDecay")),
    ("GeLU parts: Sigmoid, Mul", ("Sigmoid", "Mul", "FastGeLU", "FastGeLUGrad", "GeLU", "GeLUGrad")),
    ("Add, AddN, BroadcastTo, Sub, Square, ReduceSum (bias, residual, clip)",
     ("Add", "AddN", "BroadcastTo", "Sub", "Square", "ReduceSum")),
    ("Transpose, Reshape, Unstack, Stack, Cast (data movement)",
     ("Transpose", "Reshape", "Unstack", "Stack", "Cast", "StridedSlice", "Tile", "Concat")),
    ("embedding gradient (UnsortedSegmentSum), Gather", ("UnsortedSegmentSum", "Gather")),
    ("LoRA branch: dropout (MindSpore Dropout + DropoutGrad, or the kernel)",
     ("lora:Dropout", "lora:DropoutGrad", "Dropout", "DropoutGrad", "lora:Custom:CPULoRADropout")),
    ("LoRA branch: other ops inside lora_* Cells", ("lora:*",)),
)


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
    """One compiled train step: (cell, inputs); ``lora``: a pet_config (a LoRA model) or None; ``kernels`` and
    ``plain_dropout``: the model's cpu_kernels (``cpu_kernels``)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, GPTLocalTrainOneStepCell
    from mindformers_gptlocal.training.optim import GPTLocalAdamW
    layers, hidden, heads, vocab = SHAPES[args.shape]
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


def profile(args):
    from mindspore import Profiler
    cell, inputs = build_step(args, args.variant == "kernels", pet_config(args))
    for _ in range(2):
        cell(*inputs)
    out = tempfile.mkdtemp(prefix="gptlocal-profile-")
    profiler = Profiler(output_path=out)
    started = time.perf_counter()
    for _ in range(args.steps):
        cell(*inputs)[0].asnumpy()
    wall = (time.perf_counter() - started) / args.steps
    profiler.analyse()
    path = glob.glob(os.path.join(out, "**", "cpu_op_detail_info_0.csv"), recursive=True)[0]
    totals = {}
    with open(path, encoding="utf-8") as handle:
        for row in csv.DictReader(handle):  # AOT Custom ops named by their Cell: Custom:CPUAttention, ...
            name = row["op_type"]
            if name == "Custom":
                cell = re.search(r"-(CPU\w+)/", row["full_op_name"])
                name = f"Custom:{cell.group(1) if cell else 'other'}"
            if "lora" in row["full_op_name"]:  # the LoRA branch's ops: their Cell attributes are lora_*
                name = f"lora:{name}"
            value, count = totals.get(name, (0.0, 0))
            totals[name] = (value + float(row["op_total_time(ms)"]), count + int(row["op_occurrences"]))
    rows = [(name, value / args.steps, count) for name, (value, count) in totals.items()]
    if args.keep_csv:
        shutil.copy(path, args.keep_csv)
    shutil.rmtree(out, ignore_errors=True)
    total = sum(ms_ for _, ms_, _ in rows)
    print(f"shape {args.shape} {args.batch} x {args.seq}, variant {args.variant}"
          f"{', LoRA ' + str(pet_config(args)) if args.lora else ''}, {args.steps} profiled steps, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.1f}; wall {wall * 1000:.0f} ms a step, "
          f"op time {total:.0f} ms a step")
    if args.groups:
        by_type = {name: (ms_, count) for name, ms_, count in rows}
        print("| ops | ms a step | share |\n| --- | ---: | ---: |")
        seen = set()
        for group, names in GROUPS:
            if names == ("lora:*",):
                names = tuple(name for name in by_type if name.startswith("lora:") and name not in seen)
            value = sum(by_type.get(name, (0, 0))[0] for name in names)
            seen.update(names)
            print(f"| {group} | {value:.1f} | {value / total:.1%} |")
        rest = sum(ms_ for name, ms_, _ in rows if name not in seen)
        print(f"| everything else | {rest:.1f} | {rest / total:.1%} |")
        print(f"| total op time | {total:.1f} | 100% |")
    else:
        print("| op type | calls a step | ms a step | share |\n| --- | ---: | ---: | ---: |")
        for name, ms_, count in sorted(rows, key=lambda row: -row[1]):
            if ms_ >= args.min_ms:
                print(f"| {name} | {count // args.steps} | {ms_:.1f} | {ms_ / total:.1%} |")


VARIANTS = {  # name -> (the norm / GeLU kernels on, a LoRA model, its lora_dropout: None = PET_CONFIG's)
    "plain": (False, False, None),
    "kernels": (True, False, None),
    "full": (True, False, None),
    "lora": (True, True, None),
    "lora-plaindrop": (True, True, None),  # cpu_kernels {lora_dropout: plain}: the plain counter dropout
    "lora-nodrop": (True, True, 0.0),
}


def compare(args):
    cells = {}
    names = args.variants.split(",")
    for name in names:
        if name not in VARIANTS:
            raise SystemExit(f"--variants: {name!r} is not one of {', '.join(VARIANTS)}")
        kernels, lora, dropout = VARIANTS[name]
        overrides = {"lora": lora} if dropout is None else {"lora": lora, "lora_dropout": dropout}
        cell, inputs = build_step(args, kernels, pet_config(argparse.Namespace(**{**vars(args), **overrides})),
                                  plain_dropout=name == "lora-plaindrop")
        started = time.perf_counter()
        loss = float(cell(*inputs)[0])
        print(f"{name}: first step (compile) {time.perf_counter() - started:.1f} s, loss {loss:.6f}", flush=True)
        cells[name] = cell
    times = {name: [] for name in cells}
    losses = {name: [] for name in cells}
    for index in range(args.rounds):
        for name in (names if index % 2 == 0 else names[::-1]):
            started = time.perf_counter()
            losses[name].append(float(cells[name](*inputs)[0]))
            times[name].append(time.perf_counter() - started)
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
    (``value_and_grad`` of sum(dropout(x) @ w), w [in, 8]: the LoRA A product) on the adapted Linears' input shapes,
    alternating."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindformers_gptlocal.kernels.lora_dropout import lora_dropout_kernel
    from mindformers_gptlocal.model.dropout import CounterDropout, KernelDropout, lora_dropout_site

    class Branch(nn.Cell):
        def __init__(self, dropout):
            super().__init__()
            self.dropout = dropout

        def construct(self, x, w, step):
            return ops.matmul(self.dropout(x, step), w).sum()

    _, hidden, _, _ = SHAPES[args.shape]
    rate = args.lora_dropout if args.lora_dropout is not None else PET_CONFIG["lora_dropout"]
    tokens = args.batch * args.seq
    for width in (hidden, 4 * hidden):  # qkv / proj / fc1 inputs, fc2's input
        x = Tensor(np.random.default_rng(0).standard_normal((tokens, width)).astype(np.float32))
        w = Tensor(np.ones((width, 8), np.float32))
        fns = {}
        step = Tensor(3, ms.int32)
        plain = CounterDropout(rate, lora_dropout_site(1, "attention.linear_qkv"))
        for name, cell in (("mindspore", KernelDropout(p=rate)), ("plain", plain),
                           ("kernel", lora_dropout_kernel(plain, ms.float32))):
            net = Branch(cell)
            net.set_train(True)
            fns[name] = ms.value_and_grad(net, grad_position=0)
            fns[name](x, w, step)
        times = {name: [] for name in fns}
        for index in range(args.rounds):
            for name in (list(fns) if index % 2 == 0 else list(fns)[::-1]):
                started = time.perf_counter()
                fns[name](x, w, step)[1].asnumpy()
                times[name].append(time.perf_counter() - started)
        medians = {name: statistics.median(values) * 1000 for name, values in times.items()}
        print(f"dropout p={rate} on [{tokens}, {width}], {args.rounds} rounds, load {os.getloadavg()[0]:.1f}: "
              f"MindSpore Dropout {medians['mindspore']:.2f} ms, plain counter dropout {medians['plain']:.2f} ms, "
              f"kernel {medians['kernel']:.2f} ms, MindSpore / kernel {medians['mindspore'] / medians['kernel']:.2f}x, "
              f"plain / kernel {medians['plain'] / medians['kernel']:.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden-act", default="gelu_new")
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32",
                        help="model_config.compute_dtype (bfloat16 on CPU: float32 between ops, bf16 GEMMs)")
    parser.add_argument("--variant", choices=("kernels", "plain"), default="kernels")
    parser.add_argument("--groups", action="store_true", help="fold op types into the docs' groups")
    parser.add_argument("--min-ms", type=float, default=0.5, help="op types below this many ms a step are not listed")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--dropout-ops", action="store_true",
                        help="MindSpore's Dropout, the plain counter dropout and the LoRA dropout kernel on the LoRA "
                             "input shapes, alternating")
    parser.add_argument("--plain-op", default="layer_norm,bias_gelu",
                        help="comma list of model_config.cpu_kernels ops the plain variant sets to plain (the kernels "
                             "variant: kernel), e.g. linear (Linear's GEMM kernel)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--variants", default="plain,kernels",
                        help="--compare: comma-separated, of " + ", ".join(VARIANTS) + "; ratios against the last")
    parser.add_argument("--keep-csv", help="copy the profiler's cpu_op_detail_info_0.csv here")
    parser.add_argument("--lora", action="store_true", help="profile a LoRA step (finetune_throughput's PET_CONFIG)")
    parser.add_argument("--lora-dropout", type=float, help="--lora: this lora_dropout instead of PET_CONFIG's")
    args = parser.parse_args()
    from mindformers_gptlocal.kernels.provider import OPS
    args.plain_op = [op for op in args.plain_op.split(",") if op]
    unknown = [op for op in args.plain_op if op not in OPS]
    if unknown:
        parser.error(f"--plain-op: {', '.join(unknown)} not an op of model_config.cpu_kernels; "
                     f"the ops: {', '.join(OPS)}")
    import mindspore as ms
    from mindformers.tools.register import MindFormerConfig
    from mindformers.core.context.build_context import MFContextOperator
    MFContextOperator(MindFormerConfig(use_legacy=False))
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    if args.dropout_ops:
        dropout_ops(args)
    elif args.compare:
        compare(args)
    else:
        profile(args)


if __name__ == "__main__":
    main()
