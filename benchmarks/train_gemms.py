"""Every GEMM of one training step at its exact shape and transposes, MindSpore against PyTorch and against the
square GEMM probe, in ONE process, the sides alternating (issue 24: is any GEMM of the step well below the probe?).

    python benchmarks/train_gemms.py --shape tiny --batch 4 --seq 256 --rounds 7 --threads 2
    python benchmarks/train_gemms.py --shape small --batch 2 --seq 256 --rounds 5 --threads 2

Per Linear ``y = x W^T`` (x [T, in], W [out, in], T = batch x seq) the step runs three GEMMs: the forward
``MatMul(x, W, transpose_b=True)``, the input gradient ``dX = MatMul(dY, W)`` and the weight gradient
``dW = MatMul(dY, X, transpose_a=True)`` (MindSpore's bprop of MatMul; PyTorch's autograd of ``F.linear`` does the
same three products: ``x @ W.t()``, ``dY @ W``, ``dY.t() @ X``). The Linears are qkv [3H, H], proj [H, H], fc1 [4H, H]
and fc2 [H, 4H] per layer and the tied output head [V, H] once. Each GEMM is a compiled GRAPH-mode Cell of that one
MatMul (MindSpore) and the same product on torch tensors (transposes as views, as autograd passes them); the
probe is a square n = 2048 GEMM of each framework (``--probe``), timed in the same rounds; the same-shape probe is
MindSpore's plain ``MatMul(A [M, K], B [K, N])`` (no transpose) at the GEMM's own M, N, K, so "form / plain" says
what the transposed operand costs at that shape. Reported per GEMM: the best time of ``--rounds`` (each round
calls each side ``--calls`` times back to back), GFLOP/s, its fraction of its framework's square probe, MindSpore
/ PyTorch time and MindSpore's form / plain time; then the step's GEMM time per framework, summed with the layer
count. A busy machine inflates every time: read the fractions and ratios (same process, same rounds), not
the GFLOP/s.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package; imports neither MindSpore nor PyTorch)
from _common import SHAPES  # noqa: E402


def gemms(shape, batch, seq):
    """[(name, count a step, M, N, K, form)]: form "nt" x W^T, "nn" dY W, "tn" dY^T X (MatMul's transposes)."""
    s = SHAPES[shape]
    h, t, v, layers = s["hidden"], batch * seq, s["vocab"], s["layers"]
    rows = []
    for name, out, inp in (("qkv", 3 * h, h), ("proj", h, h), ("fc1", 4 * h, h), ("fc2", h, 4 * h), ("head", v, h)):
        count = 1 if name == "head" else layers
        rows += [(f"{name} forward x W^T", count, t, out, inp, "nt"),
                 (f"{name} dX = dY W", count, t, inp, out, "nn"),
                 (f"{name} dW = dY^T X", count, out, inp, t, "tn")]
    return rows


def operands(m, n, k, form, rng):
    """float32 numpy operands of an [M, N] product with the contraction K in ``form``'s layout."""
    import numpy as np
    a_shape = (k, m) if form == "tn" else (m, k)
    b_shape = (n, k) if form == "nt" else (k, n)
    return (rng.standard_normal(a_shape).astype(np.float32), rng.standard_normal(b_shape).astype(np.float32))


def mindspore_fn(form, a, b):
    import mindspore as ms
    net, x, y = C.mindspore_matmul(transpose_a=form == "tn", transpose_b=form == "nt"), ms.Tensor(a), ms.Tensor(b)
    net(x, y).asnumpy()  # compile
    return lambda: net(x, y).asnumpy()


def torch_fn(form, a, b):
    import torch
    x, y = torch.from_numpy(a), torch.from_numpy(b)
    if form == "nt":
        return lambda: torch.matmul(x, y.t()).numpy()
    if form == "tn":
        return lambda: torch.matmul(x.t(), y).numpy()
    return lambda: torch.matmul(x, y).numpy()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=3, help="calls of each side per round (the best is kept)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--probe", type=int, default=2048, help="the square probe's n")
    args = parser.parse_args()
    os.environ.update({k: str(args.threads) for k in C.THREAD_VARS})  # this process is the worker
    seen = C.check_threads(args.threads, "train_gemms")
    print(C.machine_line(args.threads), flush=True)
    import numpy as np
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    threads = {"runtime_threads": C.mindspore_threads(args.threads, "train_gemms"),
               "torch_threads": C.torch_threads(args.threads, "train_gemms")}
    print(f"MindSpore runtime_num_threads={threads['runtime_threads']}, torch threads={threads['torch_threads']}",
          flush=True)
    if args.rounds == 0:  # tests/tools/test_benchmarks.py: the threads checked, nothing measured
        C.emit({"env": seen, **threads})
        return
    rng = np.random.default_rng(0)
    rows = gemms(args.shape, args.batch, args.seq)
    n = args.probe
    cases = [("probe n=%d" % n, 0, n, n, n, "nn")] + rows
    fns = {}
    for name, _, m, nn_, k, form in cases:
        a, b = operands(m, nn_, k, form, rng)
        fns[name] = {"mindspore": mindspore_fn(form, a, b), "torch": torch_fn(form, a, b)}
        if form != "nn":  # the same shape without a transpose: MindSpore's plain MatMul
            fns[name]["plain"] = mindspore_fn("nn", *operands(m, nn_, k, "nn", rng))
        for fn in fns[name].values():
            fn()  # warm
    times = {name: {side: [] for side in sides} for name, sides in fns.items()}
    for index in range(args.rounds):
        for name in fns:
            sides = list(fns[name]) if index % 2 == 0 else list(fns[name])[::-1]
            for side in sides:
                for _ in range(args.calls):
                    times[name][side].append(C.timed(fns[name][side]))
    best = {name: {side: min(values) for side, values in sides.items()} for name, sides in times.items()}
    probe = {side: 2 * n ** 3 / best[cases[0][0]][side] / 1e9 for side in ("mindspore", "torch")}
    print(f"shape {args.shape} {args.batch} x {args.seq}, {args.rounds} rounds x {args.calls} calls, load at the end "
          f"{os.getloadavg()[0]:.1f}; probe (square n={n}) MindSpore {probe['mindspore']:.1f}, torch "
          f"{probe['torch']:.1f} GFLOP/s\n")
    print("| GEMM | calls a step | M x N x K | MindSpore ms | GFLOP/s | of its probe | torch ms | GFLOP/s | "
          "of its probe | MindSpore / torch time | MindSpore form / plain |\n"
          "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    totals = {"mindspore": 0.0, "torch": 0.0}
    flops_total = 0.0
    for name, count, m, nn_, k, _ in rows:
        flops = 2.0 * m * nn_ * k
        flops_total += flops * count
        cells = []
        for side in ("mindspore", "torch"):
            seconds = best[name][side]
            totals[side] += seconds * count
            gflops = flops / seconds / 1e9
            cells.append(f"{seconds * 1000:.2f} | {gflops:.1f} | {gflops / probe[side]:.0%}")
        plain = best[name].get("plain", best[name]["mindspore"])
        print(f"| {name} | {count} | {m} x {nn_} x {k} | {cells[0]} | {cells[1]} | "
              f"{best[name]['mindspore'] / best[name]['torch']:.2f}x | {best[name]['mindspore'] / plain:.2f}x |")
    for side in ("mindspore", "torch"):
        gflops = flops_total / totals[side] / 1e9
        print(f"{side}: the step's GEMMs {totals[side] * 1000:.1f} ms at their best, {gflops:.1f} GFLOP/s = "
              f"{gflops / probe[side]:.0%} of its probe, {gflops / max(probe.values()):.0%} of the higher probe")


if __name__ == "__main__":
    main()
