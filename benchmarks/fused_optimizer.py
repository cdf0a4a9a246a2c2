"""One GPTLocalAdamW step over GPT-2 small's parameter list: clip factor folded into the kernel
(``fused_clip: True``, MindSpore's FusedCastAdamWeightDecay) against the two-pass reference
(``fused_clip: False``: grad x clip factor, then AdamWeightDecay), in one process, calls alternating.

    python benchmarks/fused_optimizer.py                    # GPT-2 small (124M), 10 rounds
    python benchmarks/fused_optimizer.py --shape tiny --rounds 20

Both optimizers are built over their own copies of the same parameters (decay on matrices, none on
biases and LayerNorm, as MindFormers' grouping does) and called in GRAPH mode as the training step calls
them, ``optimizer(grads, coefficient)``; each round times one step of each, the order alternating. Prints
the median ms per step of each and the ratio, and the largest parameter difference after all steps.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)

sys.path.insert(0, C.REPO)  # this tree, not an installed copy


def gpt2_shapes(s, positions=1024):
    """(name, shape, decayed) of GPT-2's parameters at shape ``s`` (tied head)."""
    h, f = s["hidden"], 4 * s["hidden"]
    shapes = [("wte", (s["vocab"], h), True), ("wpe", (positions, h), True)]
    for i in range(s["layers"]):
        for name, shape in (("ln1.g", (h,)), ("ln1.b", (h,)), ("qkv.w", (h, 3 * h)), ("qkv.b", (3 * h,)),
                            ("proj.w", (h, h)), ("proj.b", (h,)), ("ln2.g", (h,)), ("ln2.b", (h,)),
                            ("fc.w", (h, f)), ("fc.b", (f,)), ("out.w", (f, h)), ("out.b", (h,))):
            shapes.append((f"h{i}.{name}", shape, len(shape) == 2))
    return shapes + [("lnf.g", (h,), False), ("lnf.b", (h,), False)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(C.SHAPES))
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = parser.parse_args()
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, Parameter
    from mindformers_gptlocal.training.optim import GPTLocalAdamW
    ms.set_context(mode=0, device_target="CPU", runtime_num_threads=args.threads)
    rng = np.random.default_rng(0)
    # decayed first: the optimizer orders its parameters group by group, and gradients follow that order
    shapes = sorted(gpt2_shapes(C.SHAPES[args.shape]), key=lambda item: not item[2])
    values = [rng.standard_normal(shape).astype(np.float32) * 0.02 for _, shape, _ in shapes]
    grads = tuple(Tensor(rng.standard_normal(shape).astype(np.float32) * 1e-3) for _, shape, _ in shapes)
    coefficient = Tensor(np.array([0.37], np.float32))

    def build(fused):
        params = [Parameter(Tensor(v.copy()), name=name) for (name, _, _), v in zip(shapes, values)]
        groups = [{"params": [p for p, (_, _, d) in zip(params, shapes) if d], "weight_decay": 0.01},
                  {"params": [p for p, (_, _, d) in zip(params, shapes) if not d], "weight_decay": 0.0}]
        optimizer = GPTLocalAdamW(groups, learning_rate=1e-3, betas=(0.9, 0.95), eps=1e-8, fused_clip=fused)
        assert optimizer.fused_clip == fused
        optimizer(grads, coefficient)  # compile
        return params, optimizer

    sides = {"two-pass (reference)": build(False), "clip in kernel": build(True)}
    times = {name: [] for name in sides}
    order = list(sides)
    for index in range(args.rounds):
        for name in (order if index % 2 == 0 else order[::-1]):
            _, optimizer = sides[name]
            started = time.perf_counter()
            optimizer(grads, coefficient)
            times[name].append(time.perf_counter() - started)
    (_, ref), (_, new) = sides.values()
    diff = max(float(np.abs(a.asnumpy() - b.asnumpy()).max()) for a, b in zip(sides[order[0]][0], sides[order[1]][0]))
    count = sum(int(np.prod(shape)) for _, shape, _ in shapes)
    print(C.machine_line(args.threads))
    print(f"{args.shape}: {len(shapes)} parameters, {count / 1e6:.1f}M values, {args.rounds} rounds alternating")
    medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
    for name, t in times.items():
        print(f"  {name:22} {medians[name]:8.1f} ms/step  [{min(t) * 1000:.1f}-{max(t) * 1000:.1f}]")
    print(f"  ratio two-pass / clip-in-kernel: {medians[order[0]] / medians[order[1]]:.2f}x; "
          f"max |param difference| after {args.rounds + 1} steps each: {diff:.2e}")


if __name__ == "__main__":
    main()
