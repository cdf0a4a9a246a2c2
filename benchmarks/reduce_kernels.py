"""Why gpt_local's gradient checks and GeLU are written the way they are on CPU: MindSpore kernel
timings against the composed forms used instead (graph mode, best of 5).

    python benchmarks/reduce_kernels.py
"""
import math
import os
import sys
import time

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mindformers_gptlocal.training.grad_checks import sum_all  # noqa: E402


class Fn(nn.Cell):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def construct(self, x):
        return self.fn(x)


def best_ms(fn, x):
    cell = Fn(fn)
    cell(x)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        cell(x).asnumpy()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


GELU_SCALE = 2.0 * math.sqrt(2.0 / math.pi)


def square_sum_kernel(x):
    return ops.ReduceSum()(x * x)


def square_sum_two_stage(x):
    return sum_all(x * x)


def finite_kernel(x):
    return ops.ReduceAll()(ops.IsFinite()(x))


def finite_two_stage(x):
    return ops.IsFinite()(sum_all(x * x))


def gelu_kernel(x):
    return ops.GeLU()(x)


def gelu_composed(x):
    return x * ops.sigmoid(GELU_SCALE * (x + 0.044715 * x * x * x))


def main():
    ms.set_context(mode=0, device_target="CPU")
    grad = Tensor(np.random.default_rng(0).standard_normal((50257, 768)).astype(np.float32))
    act = Tensor(np.random.default_rng(1).standard_normal((512, 3072)).astype(np.float32))
    rows = [
        ("sum of squares, [50257, 768]", "ReduceSum(x*x, all axes)", square_sum_kernel,
         "last axis, then the rest", square_sum_two_stage, grad),
        ("finite check, [50257, 768]", "ReduceAll(IsFinite(x))", finite_kernel,
         "IsFinite(two-stage sum of x*x)", finite_two_stage, grad),
        ("tanh GeLU, [512, 3072]", "GeLU kernel", gelu_kernel,
         "x*sigmoid(2c(x+0.044715x^3))", gelu_composed, act),
    ]
    print(f"{'work':30} {'MindSpore kernel':26} {'ms':>6}   {'used instead':30} {'ms':>6} {'speed-up':>8}")
    for work, name_a, fn_a, name_b, fn_b, x in rows:
        a, b = best_ms(fn_a, x), best_ms(fn_b, x)
        print(f"{work:30} {name_a:26} {a:6.1f}   {name_b:30} {b:6.1f} {a / b:7.1f}x")


if __name__ == "__main__":
    main()
