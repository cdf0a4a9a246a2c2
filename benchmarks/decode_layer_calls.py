"""The decode-layer kernel (``kernels/decode_layer.py``, ``cpu_decode_layer.cc``) per call, called two ways on the
same weights and inputs: inside a compiled MindSpore graph (``graph``: --reps calls of ``CPUDecodeLayer`` unrolled in
one GRAPH-mode Cell, as the decode step calls it once a layer) and directly (``direct``: the library's
``gptlocal_decode_layer_fwd`` through ctypes, the same argument vector, no MindSpore runtime around it). Their
difference is what running inside MindSpore's graph costs a kernel call; the direct call is the kernel's own time.

    python benchmarks/decode_layer_calls.py                   # tiny and GPT-2 small widths, 1 and 12 weight sets
    python benchmarks/decode_layer_calls.py --shapes tiny --copies 4 --rounds 20

In ONE worker process (--threads threads, checked): batch 1, a cache of --length rows, the token at row
--length / 2 (attention over half the cache). ``--copies`` distinct weight sets taken in turn (1: the layer's
weights stay in cache; 12: GPT-2 small's layer count, read from memory as a decode step reads them). Sides
alternate, --rounds rounds; the table gives microseconds per call, median [min], and graph / direct (medians).
"""
import argparse
import ctypes
import os
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)

# name: (hidden, heads, intermediate)
SHAPES = {"tiny": (256, 4, 1024), "small": (768, 12, 3072)}


def layer_arrays(rng, hidden, inter):
    """One layer's twelve float32 weights in the kernel's order (ln1, qkv, proj, ln2, fc1, fc2; weight, bias)."""
    shapes = [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,), (hidden,),
              (hidden,), (inter, hidden), (inter,), (hidden, inter), (hidden,)]
    arrays = [(0.02 * rng.standard_normal(s)).astype(np.float32) for s in shapes]
    arrays[0] += 1.0
    arrays[6] += 1.0
    return arrays


def worker(names, copies_list, length, rounds, reps, threads):
    """Prints one table row per (shape, copies)."""
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn
    from mindformers_gptlocal.kernels import build
    from mindformers_gptlocal.kernels.aot import DirectCall
    from mindformers_gptlocal.kernels.decode_layer import CPUDecodeLayer
    C.mindspore_threads(threads, "decode layer calls worker")
    ms.set_context(mode=ms.GRAPH_MODE)
    path = build.library()[0]
    rng = np.random.default_rng(0)
    for name in names:
        hidden, heads, inter = SHAPES[name]
        dim = hidden // heads
        for copies in copies_list:
            sets = [layer_arrays(rng, hidden, inter) for _ in range(copies)]
            caches = [np.zeros((1, heads, length, dim), np.float32) for _ in range(2)]
            index = np.zeros((1, heads, 1, 3), np.int32)
            index[..., 1] = np.arange(heads)[None, :, None]
            index[..., 2] = length // 2
            bias = np.zeros((1, 1, 1, length), np.float32)
            bias[..., length // 2 + 1:] = -1e4
            hidden_in = rng.standard_normal((1, 1, hidden)).astype(np.float32)
            kernel = CPUDecodeLayer(path, 1e-5, dim ** -0.5, threads=threads)

            class Unrolled(nn.Cell):
                """``reps`` layer calls in one graph, weight set i % copies for call i, the caches in place."""

                def __init__(self):
                    super().__init__()
                    self.kernel = kernel
                    self.weights = [[Parameter(Tensor(a), name=f"w{s}_{i}", requires_grad=False)
                                     for i, a in enumerate(arrays)] for s, arrays in enumerate(sets)]
                    for s, weights in enumerate(self.weights):  # each one an attribute: the graph's Parameters
                        for i, weight in enumerate(weights):
                            setattr(self, f"w{s}_{i}", weight)
                    self.key_cache = Parameter(Tensor(caches[0]), name="key_cache", requires_grad=False)
                    self.value_cache = Parameter(Tensor(caches[1]), name="value_cache", requires_grad=False)

                def construct(self, x, write_index, attention_bias):
                    for call in range(reps):
                        x = self.kernel(x, *self.weights[call % copies], self.key_cache, self.value_cache,
                                        write_index, attention_bias)
                    return x

            graph = Unrolled()
            inputs = (Tensor(hidden_in), Tensor(index), Tensor(bias))
            graph(*inputs).asnumpy()  # compiles
            config = kernel.config.asnumpy()
            function = getattr(ctypes.CDLL(path), kernel.symbol)
            direct = [DirectCall(function, [hidden_in, *arrays, *caches, index, bias, config, np.zeros_like(hidden_in)])
                      for arrays in sets]
            for call in direct:
                status = call.call()
                if status != 0:
                    raise RuntimeError(f"{kernel.symbol} returned {status}")

            def measure(side, _):
                start = time.perf_counter()
                if side == "graph":
                    graph(*inputs).asnumpy()
                else:
                    for call in range(reps):
                        direct[call % copies].call()
                return (time.perf_counter() - start) / reps * 1e6

            times = C.alternate(("graph", "direct"), rounds, measure)
            g, d = np.array(times["graph"]), np.array(times["direct"])
            megabytes = sum(a.nbytes for a in sets[0]) / 2 ** 20
            print(f"| {name} (hidden {hidden}, {megabytes:.1f} MB a layer) | {copies} | {np.median(g):.1f} "
                  f"[{g.min():.1f}] | {np.median(d):.1f} [{d.min():.1f}] | {np.median(g) / np.median(d):.2f}x | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--copies", default="1,12", help="distinct weight sets, in turn (comma-separated)")
    parser.add_argument("--length", type=int, default=192, help="cache rows")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--reps", type=int, default=24, help="calls per measurement (and per graph)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    names, copies = args.shapes.split(","), [int(c) for c in args.copies.split(",")]
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(SHAPES)}")
    if args.worker:
        C.check_threads(args.threads, "decode layer calls worker")
        return worker(names, copies, args.length, args.rounds, args.reps, args.threads)
    print(C.machine_line(args.threads), flush=True)
    print("| shape | weight sets | in a graph, us a call | direct (ctypes), us a call | graph / direct | 1-min load |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |", flush=True)
    subprocess.run([sys.executable, __file__, "--worker", "--shapes", args.shapes, "--copies", args.copies,
                    "--length", str(args.length), "--rounds", str(args.rounds), "--reps", str(args.reps),
                    "--threads", str(args.threads)], env=C.worker_env(args.threads), check=True)
    return None


if __name__ == "__main__":
    main()
