"""Linear's x W^T (+ b) through MindSpore's MatMul (+ BroadcastTo + Add) against gpt_local's CPU GEMM kernel (bias
inside), by row count: where ``kernels.provider.LINEAR_GEMM_ROWS`` / ``HEAD_GEMM_ROWS`` come from.

    python benchmarks/linear_rows.py                         # GPT-2 small's four Linears and the head
    python benchmarks/linear_rows.py --rows 1,8,32 --rounds 20

In ONE worker process (--threads threads, checked), GRAPH mode, inference (``set_train(False)``): for each shape a
Cell of --layers distinct ``model/layers.py`` Linears of it (the head: one, no bias), applied to the same [M, in]
input (12 distinct weights, as in a GPT-2 small prefill graph), built twice with the same weights: cpu_kernels
{linear: plain} (MatMul, the reference) and {linear: kernel} (the kernel in every graph); each Linear gets the
``KernelProvider`` a model with that ``model_config.cpu_kernels`` hands its layers. The two compiled graphs are
called alternately, --reps calls per measurement, --rounds rounds; the table gives per call: wall median [min] and
the process's CPU time median, both sides, matmul / kernel (wall min, CPU median) and the largest output difference.
fc1 has no bias here (on CPU its bias goes to the bias + GeLU kernel: ``skip_bias_add``).
"""
import argparse
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)

# name: (in, out, bias, Linears in the Cell)
SHAPES = {"qkv": (768, 2304, True, 12), "proj": (768, 768, True, 12), "fc1": (768, 3072, False, 12),
          "fc2": (3072, 768, True, 12), "head": (768, 50257, False, 1)}


def worker(names, rows, rounds, reps, threads, layers):
    """Prints one table row per (shape, rows)."""
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.layers import Linear
    C.mindspore_threads(threads, "linear rows worker")
    ms.set_context(mode=ms.GRAPH_MODE)

    class Stack(nn.Cell):
        def __init__(self, count, inp, out, bias, mode):
            super().__init__()
            kernels = KernelProvider({"linear": mode})  # as a model with cpu_kernels {linear: mode} hands its layers
            self.linears = nn.CellList([Linear(inp, out, 0.02, ms.float32, ms.float32, has_bias=bias, kernels=kernels)
                                        for _ in range(count)])

        def construct(self, x):
            return tuple(linear(x) for linear in self.linears)

    rng = np.random.default_rng(0)
    for name in names:
        inp, out, bias, count = SHAPES[name]
        count = count if layers is None or name == "head" else layers
        stacks = {}
        for side, mode in (("matmul", "plain"), ("kernel", "kernel")):
            stacks[side] = Stack(count, inp, out, bias, mode)
            stacks[side].set_train(False)
        assert stacks["kernel"].linears[0].gemm is not None and stacks["matmul"].linears[0].gemm is None
        for (_, p), (_, q) in zip(stacks["matmul"].parameters_and_names(), stacks["kernel"].parameters_and_names()):
            value = Tensor((0.02 * rng.standard_normal(p.shape)).astype(np.float32))
            p.set_data(value)
            q.set_data(value)
        for m in rows:
            x = Tensor(rng.standard_normal((m, inp)).astype(np.float32))
            outputs = {side: stack(x) for side, stack in stacks.items()}  # compiles
            diff = max(float(np.abs(a.asnumpy() - b.asnumpy()).max())
                       for a, b in zip(outputs["matmul"], outputs["kernel"]))

            def measure(side, _):
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(reps):
                    result = stacks[side](x)
                result[-1].asnumpy()
                return (time.perf_counter() - wall) / reps * 1e3, (time.process_time() - cpu) / reps * 1e3

            times = C.alternate(("matmul", "kernel"), rounds, measure)
            mm, kk = np.array(times["matmul"]), np.array(times["kernel"])
            print(f"| {name} {inp}->{out}{' +b' if bias else ''} x{count} | {m} | {np.median(mm[:, 0]):.3f} "
                  f"[{mm[:, 0].min():.3f}] | {np.median(kk[:, 0]):.3f} [{kk[:, 0].min():.3f}] | "
                  f"{np.median(mm[:, 1]):.3f} | {np.median(kk[:, 1]):.3f} | "
                  f"{mm[:, 0].min() / kk[:, 0].min():.2f}x, {np.median(mm[:, 1]) / np.median(kk[:, 1]):.2f}x | "
                  f"{diff:.1e} | {os.getloadavg()[0]:.1f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--layers", type=int, help="Linears per Cell for the four layer shapes (default 12)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names, rows = args.shapes.split(","), [int(r) for r in args.rows.split(",")]
    if args.worker:
        C.check_threads(args.threads, "linear rows worker")
        return worker(names, rows, args.rounds, args.reps, args.threads, args.layers)
    print(C.machine_line(args.threads), flush=True)
    print("| shape | rows M | matmul wall ms | kernel wall ms | matmul CPU ms | kernel CPU ms | "
          "matmul / kernel (wall min, CPU) | max abs diff | 1-min load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
    subprocess.run([sys.executable, __file__, "--worker", "--shapes", args.shapes, "--rows", args.rows,
                    "--rounds", str(args.rounds), "--reps", str(args.reps), "--threads", str(args.threads),
                    *(["--layers", str(args.layers)] if args.layers else [])],
                   env=C.worker_env(args.threads), check=True)
    return None


if __name__ == "__main__":
    main()
