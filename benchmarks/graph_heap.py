"""What a compiled MindSpore graph costs in host memory, on toy graphs (issue 25 item 4).

    python benchmarks/graph_heap.py                          # every kind at 64 and 256 cells, cold and warm
    python benchmarks/graph_heap.py --kinds bare,dense --cells 128 --threads 2

Each case runs in its own worker: build ``cells`` small Cells, run one tiny graph first (MindSpore's runtime
itself), then read RSS and glibc's ``mallinfo2`` before and after the first call of the toy net (its compile).
``arena`` is the main heap's size (brk), ``live`` the bytes malloc has handed out and not had back, ``free`` the
bytes it holds free inside the arena; ``trim``: RSS after ``malloc_trim(0)``. A case runs twice with MindSpore's
compile cache (``enable_compile_cache``, a fresh folder per case): "cold" writes the cache, "warm" loads the
graph from it, which skips the frontend's parse, specialization and optimizer passes.

Kinds (each cell's ``construct``; every kind computes [32, 256] -> [32, 256]):
  bare:  MatMul + BiasAdd, nothing else (2 kernel nodes a cell)
  dense: ``nn.Dense`` (the same 2 kernel nodes, plus its Python shape checks and branches)
  dead:  bare's 2 nodes, plus a branch on a False attribute holding ~20 ops (parsed, never compiled)
  mul:   ``x * a + b`` (2 element-wise nodes a cell)
"""
import argparse
import ctypes
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)

KINDS = ("bare", "dense", "dead", "mul")


class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def heap_mb():
    """(arena, live, free) MB of glibc's main heap (``mallinfo2``, glibc >= 2.33)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.arena / 2**20, info.uordblks / 2**20, info.fordblks / 2**20


def build(kind, cells):
    import numpy as np
    from mindspore import nn, ops, Parameter, Tensor

    class Bare(nn.Cell):
        def __init__(self):
            super().__init__()
            self.weight = Parameter(Tensor(np.random.rand(256, 256).astype(np.float32) * 0.01))
            self.bias = Parameter(Tensor(np.zeros(256, np.float32)))
            self.matmul = ops.MatMul(transpose_b=True)
            self.bias_add = ops.BiasAdd()
            self.flag = False

        def construct(self, x):
            return self.bias_add(self.matmul(x, self.weight), self.bias)

    class Dead(Bare):
        def construct(self, x):
            if self.flag:
                y = ops.transpose(ops.reshape(x, (-1, 8, 32)), (1, 0, 2)) * 2.0 + 1.0
                y = ops.reshape(ops.transpose(ops.softmax(y, -1), (1, 0, 2)), (-1, 256))
                y = ops.cos(y) + ops.sin(y) * y
                y = ops.tanh(ops.exp(y) - y) * 0.5
                return ops.sqrt(y * y + 1.0) * 3.0 - y
            return self.bias_add(self.matmul(x, self.weight), self.bias)

    class Mul(nn.Cell):
        def construct(self, x):
            return x * 1.0001 + 0.5

    make = {"bare": Bare, "dense": lambda: nn.Dense(256, 256), "dead": Dead, "mul": Mul}[kind]

    class Net(nn.Cell):
        def __init__(self):
            super().__init__()
            self.layers = nn.CellList([make() for _ in range(cells)])

        def construct(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    return Net()


def worker(kind, cells, threads, cache):
    env = C.check_threads(threads, "graph_heap worker")
    import numpy as np
    import mindspore as ms
    from mindspore import nn, Tensor
    runtime_threads = C.mindspore_threads(threads, "graph_heap worker")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    if cache:
        ms.set_context(enable_compile_cache=True, compile_cache_path=cache)

    class Warm(nn.Cell):
        def construct(self, x):
            return x * 2.0

    x = Tensor(np.random.rand(32, 256).astype(np.float32))
    Warm()(x).asnumpy()  # the runtime's own first-call cost, outside the measurement
    net = build(kind, cells)
    rss0, heap0 = C.rss_mb(), heap_mb()
    net(x).asnumpy()
    rss1, heap1 = C.rss_mb(), heap_mb()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    C.emit(dict(env=env, runtime_threads=runtime_threads, rss=rss1 - rss0, arena=heap1[0] - heap0[0], live=heap1[1] - heap0[1],
                free=heap1[2] - heap0[2], trimmed=C.rss_mb() - rss0))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument("--cells", default="64,256")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--worker", nargs=3, metavar=("KIND", "CELLS", "CACHE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        kind, cells, cache = args.worker
        return worker(kind, int(cells), args.threads, None if cache == "-" else cache)
    print(C.machine_line(args.threads))
    print("MB over the first call (the compile); per cell: the rss column over the cells")
    print(f"{'kind':6} {'cells':>5} {'cache':5} {'rss':>7} {'arena':>7} {'live':>7} {'free':>7} {'trim':>7} "
          f"{'rss/cell':>8}")
    work = C.scratch_dir("graph_heap_")
    for kind in args.kinds.split(","):
        for cells in (int(c) for c in args.cells.split(",")):
            folder = tempfile.mkdtemp(prefix=f"{kind}_{cells}_", dir=work)
            for label in ("cold", "warm"):
                out, _ = C.run_worker(__file__, ["--threads", str(args.threads), "--worker", kind, str(cells),
                                                 folder], args.threads)
                print(f"{kind:6} {cells:5d} {label:5} {out['rss']:7.1f} {out['arena']:7.1f} {out['live']:7.1f} "
                      f"{out['free']:7.1f} {out['trimmed']:7.1f} {out['rss'] / cells:8.3f}", flush=True)


if __name__ == "__main__":
    main()
