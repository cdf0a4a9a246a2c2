"""Where one whole training step goes, per op, with MindSpore's profiler; and the CPU kernels against the plain ops
in ONE process (steps alternating).

    python benchmarks/train_step_profile.py --shape tiny --batch 4 --seq 256            # per-op profile table
    python benchmarks/train_step_profile.py --shape small --batch 2 --seq 256 --steps 2
    python benchmarks/train_step_profile.py --shape tiny --compare --rounds 8            # kernels vs plain, in-process

The step is ``GPTLocalTrainOneStepCell`` + ``GPTLocalAdamW`` (clip 1.0) on ``GPTLocalForCausalLM``, GRAPH mode, CPU,
dropout 0, random tokens; ``runtime_num_threads`` = ``--threads``. The profile (``mindspore.Profiler``, CPU op
statistics, ``cpu_op_detail_info_0.csv``; the AOT Custom ops split by
their Cell) covers ``--steps`` steps after 2 warm-up steps and is printed as ms a step
per op type, with each type's share of the op time; ``--groups`` folds them into the groups of
docs/performance.md. ``--variant plain`` profiles with ``GPTLOCAL_NORM_GELU_KERNELS=0`` (MindSpore's LayerNorm and
the Add + composed GeLU). ``--compare`` builds both variants in this process, compiles each, then steps them in
alternating order for ``--rounds`` rounds and prints the median step time, kernels / plain, and the largest loss
difference (the same batch every step, so the losses must agree step for step).
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
)


def build_step(args, kernels):
    """One compiled train step: (cell, inputs)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, GPTLocalTrainOneStepCell
    from mindformers_gptlocal.training.optim import GPTLocalAdamW
    layers, hidden, heads, vocab = SHAPES[args.shape]
    os.environ[args.switch] = "1" if kernels else "0"  # read when the Cells are built
    config = GPTLocalConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            max_position_embeddings=max(1024, args.seq), seq_length=args.seq, hidden_dropout=0.0,
                            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                            hidden_act=args.hidden_act)
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
    cell, inputs = build_step(args, args.variant == "kernels")
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
            value, count = totals.get(name, (0.0, 0))
            totals[name] = (value + float(row["op_total_time(ms)"]), count + int(row["op_occurrences"]))
    rows = [(name, value / args.steps, count) for name, (value, count) in totals.items()]
    shutil.rmtree(out, ignore_errors=True)
    total = sum(ms_ for _, ms_, _ in rows)
    print(f"shape {args.shape} {args.batch} x {args.seq}, variant {args.variant}, {args.steps} profiled steps, "
          f"threads {args.threads}, load {os.getloadavg()[0]:.1f}; wall {wall * 1000:.0f} ms a step, "
          f"op time {total:.0f} ms a step")
    if args.groups:
        by_type = {name: (ms_, count) for name, ms_, count in rows}
        print("| ops | ms a step | share |\n| --- | ---: | ---: |")
        seen = set()
        for group, names in GROUPS:
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


def compare(args):
    cells = {}
    for name in ("plain", "kernels"):
        cell, inputs = build_step(args, name == "kernels")
        started = time.perf_counter()
        loss = float(cell(*inputs)[0])
        print(f"{name}: first step (compile) {time.perf_counter() - started:.1f} s, loss {loss:.6f}", flush=True)
        cells[name] = cell
    times = {name: [] for name in cells}
    losses = {name: [] for name in cells}
    order = list(cells)
    for index in range(args.rounds):
        for name in (order if index % 2 == 0 else order[::-1]):
            started = time.perf_counter()
            losses[name].append(float(cells[name](*inputs)[0]))
            times[name].append(time.perf_counter() - started)
    plain = statistics.median(times["plain"])
    kernels = statistics.median(times["kernels"])
    diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["kernels"]))
    print(f"shape {args.shape} {args.batch} x {args.seq}, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}: "
          f"plain {plain * 1000:.0f} ms [{min(times['plain']) * 1000:.0f}-{max(times['plain']) * 1000:.0f}], "
          f"kernels {kernels * 1000:.0f} ms [{min(times['kernels']) * 1000:.0f}-{max(times['kernels']) * 1000:.0f}], "
          f"plain / kernels {plain / kernels:.2f}x, max loss diff {diff:.2e}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--hidden-act", default="gelu_new")
    parser.add_argument("--variant", choices=("kernels", "plain"), default="kernels")
    parser.add_argument("--groups", action="store_true", help="fold op types into the docs' groups")
    parser.add_argument("--min-ms", type=float, default=0.5, help="op types below this many ms a step are not listed")
    parser.add_argument("--compare", action="store_true")
    parser.add_argument("--switch", default="GPTLOCAL_NORM_GELU_KERNELS",
                        help="the variable 'plain' sets to 0, e.g. GPTLOCAL_LINEAR_KERNEL (Linear's GEMM kernel)")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    import mindspore as ms
    from mindformers.tools.register import MindFormerConfig
    from mindformers.core.context.build_context import MFContextOperator
    MFContextOperator(MindFormerConfig(use_legacy=False))
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    if args.compare:
        compare(args)
    else:
        profile(args)


if __name__ == "__main__":
    main()
