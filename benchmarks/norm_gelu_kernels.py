"""The CPU LayerNorm and bias + GeLU kernels against MindSpore's ops, forward + backward, in ONE process.

    python benchmarks/norm_gelu_kernels.py --rounds 20 --threads 2

Each case is a GRAPH-mode ``value_and_grad`` of sum(op(...) * w) over every input (what a training step runs),
compiled once, then kernel and plain called alternately for ``--rounds`` rounds; prints the median ms and
plain / kernel. Shapes: the tiny model's 4 x 256 tokens (hidden 256, MLP 1024) and GPT-2 small's 2 x 256
(768, 3072). The plain side is what the model runs without the kernels: ``ops.LayerNorm``; fc1's bias Add
(bias broadcast first, as ``Linear`` does on CPU) + ``TanhGeLU`` (x * sigmoid(...), its own backward), or
``ops.FastGeLU`` for quick_gelu.
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindformers_gptlocal.kernels import build, norm_gelu
    from mindformers_gptlocal.model.layers import TanhGeLU
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    path, reason = build.library()
    if path is None:
        raise SystemExit(f"no kernel library: {reason}")

    class Weighted(nn.Cell):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def construct(self, *inputs):
            return (self.fn(*inputs[:-1]) * inputs[-1]).sum()

    class PlainLayerNorm(nn.Cell):
        def __init__(self):
            super().__init__()
            self.op = ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon=1e-5)

        def construct(self, x, g, b):
            return self.op(x, g, b)[0]

    class PlainBiasGeLU(nn.Cell):
        def __init__(self, form):
            super().__init__()
            self.act = TanhGeLU() if form == "tanh" else ops.FastGeLU()

        def construct(self, x, b):
            return self.act(x + ops.broadcast_to(b, x.shape))

    rng = np.random.default_rng(0)
    cases = []
    for label, tokens, hidden in (("tiny 4x256", 1024, 256), ("small 2x256", 512, 768)):
        x = Tensor(rng.standard_normal((tokens, hidden)).astype(np.float32))
        g, b = (Tensor(rng.standard_normal(hidden).astype(np.float32)) for _ in range(2))
        cases.append((f"LayerNorm [{tokens}, {hidden}]", (x, g, b, Tensor(rng.standard_normal(x.shape).astype(np.float32))),
                      norm_gelu.CPULayerNorm(path, 1e-5, threads=args.threads), PlainLayerNorm()))
        wide = 4 * hidden
        x = Tensor(rng.standard_normal((tokens, wide)).astype(np.float32))
        b = Tensor(rng.standard_normal(wide).astype(np.float32))
        w = Tensor(rng.standard_normal(x.shape).astype(np.float32))
        for form in ("tanh", "quick"):
            cases.append((f"bias + {form} GeLU [{tokens}, {wide}]", (x, b, w),
                          norm_gelu.CPUBiasGeLU(path, form, threads=args.threads), PlainBiasGeLU(form)))
    print(f"threads {args.threads}, {args.rounds} rounds, load {os.getloadavg()[0]:.1f} at start")
    print("| op (forward + backward) | plain ms | kernel ms | plain / kernel | max diff |\n| --- | ---: | ---: | ---: | ---: |")
    for label, inputs, kernel, plain in cases:
        count = len(inputs) - 1
        fns = {name: ms.jit(ms.value_and_grad(Weighted(cell), tuple(range(count))))
               for name, cell in (("kernel", kernel), ("plain", plain))}
        results = {name: fn(*inputs) for name, fn in fns.items()}  # compile
        diff = max(float(np.abs(a.asnumpy() - c.asnumpy()).max() / max(1.0, np.abs(c.asnumpy()).max()))
                   for a, c in zip(results["kernel"][1], results["plain"][1]))
        times = {name: [] for name in fns}
        for index in range(args.rounds):
            for name in (("kernel", "plain") if index % 2 == 0 else ("plain", "kernel")):
                started = time.perf_counter()
                value, grads = fns[name](*inputs)
                value.asnumpy()
                times[name].append(time.perf_counter() - started)
        plain_ms, kernel_ms = (statistics.median(times[name]) * 1000 for name in ("plain", "kernel"))
        print(f"| {label} | {plain_ms:.2f} | {kernel_ms:.2f} | {plain_ms / kernel_ms:.2f}x | {diff:.1e} |", flush=True)
    print(f"load {os.getloadavg()[0]:.1f} at end")


if __name__ == "__main__":
    main()
