"""One causal attention's forward + backward on CPU, fp32: gpt_local's plain path (matmul + softmax, the
[B, N, S, S] scores kept), BlockwiseAttention (``attention_block_size: 256``), the fused kernel
(``kernels/cpu_attention.cc``, its GEMMs through oneDNN's sgemm) and PyTorch's
``scaled_dot_product_attention`` (its CPU flash kernel). Every side in its own worker (threads pinned and
checked), sides alternating; ms per forward + backward after a warm-up call (the compile), and the peak RSS from
the first call on above the RSS before it (VmHWM reset through /proc/self/clear_refs): the working memory.
Also the plain path's forward split into its ops (where its time goes).

    python benchmarks/attention_kernel.py [--shapes small256,small1024,tiny2048] [--rounds 3] [--threads 2]
    python benchmarks/attention_kernel.py --shapes "" --models tiny:4:256,tiny:1:2048,small:2:256
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# (batch, heads, seq, head_dim): GPT-2 small's attention at the train benchmark's shapes, the tiny model long
SHAPES = {"small256": (2, 12, 256, 64), "small1024": (1, 12, 1024, 64), "tiny2048": (1, 4, 2048, 64),
          "noop": (1, 2, 8, 8)}
SIDES = ("plain", "blockwise", "kernel", "torch_sdpa")
BLOCK = 256


def _timings(step, steps, memory):
    """Step seconds after one warm-up call (the compile); ``memory['step_peak_mb']``: the peak RSS from the
    warm-up on, above the RSS before it (MindSpore's memory pool keeps what the first call took, so the
    peak is reached there: the working memory of one forward + backward, with the small compile)."""
    C.reset_peak()  # the peak that follows is the step's own
    base = C.rss_mb()
    step()  # compile / warm up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    memory["step_peak_mb"] = C.vm_hwm_mb() - base
    return times


def _ms_worker(side, shape, steps, threads):
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    runtime = C.mindspore_threads(threads, f"{side} worker")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    from mindformers_gptlocal import GPTLocalConfig
    from mindformers_gptlocal.kernels.attention import attention_kernel
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.attention import ParallelAttention
    from mindformers_gptlocal.model.blockwise_attention import BlockwiseAttention
    batch, heads, seq, dim = shape
    rng = np.random.default_rng(0)
    q, k, v, w = (Tensor(rng.standard_normal(shape).astype(np.float32)) for _ in range(4))
    scale = 1.0 / dim ** 0.5
    config = GPTLocalConfig(vocab_size=64, hidden_size=heads * dim, num_attention_heads=heads, num_hidden_layers=1,
                            max_position_embeddings=seq, seq_length=seq)
    plain = ParallelAttention(config, 1, kernels=KernelProvider.from_config(config)).plain  # the matmul + softmax
    # core: context [B, S, N * D]
    if side == "plain":  # the weights in the plain core's output layout: the same loss
        w = Tensor(w.asnumpy().transpose(0, 2, 1, 3).reshape(batch, seq, heads * dim))
    bias = Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1)[None, None])
    no_keep = Tensor(np.ones((1,), np.bool_))
    cell = None
    if side == "blockwise":
        cell = BlockwiseAttention(BLOCK, scale, ms.float32, ms.float32)
    elif side != "plain":
        cell = attention_kernel(scale, ms.float32)
        if cell is None:
            raise SystemExit("the kernel did not build")

    def attend(q, k, v):
        if side == "plain":
            return plain(q, k, v, bias)
        if side == "blockwise":
            return cell(q, k, v, bias, no_keep)
        return cell(q, k, v, bias)

    class Loss(nn.Cell):
        def __init__(self):
            super().__init__()
            self.plain, self.cell = plain, cell

        def construct(self, q, k, v):
            return (attend(q, k, v) * w).sum()

    grad = ms.jit(ms.value_and_grad(Loss(), (0, 1, 2)))
    memory = {"step_peak_mb": None}
    times = _timings(lambda: [g.asnumpy() for g in grad(q, k, v)[1]], steps, memory) if steps else []
    if not steps:
        grad(q, k, v)[0].asnumpy()
    report = dict(times=times, runtime_threads=runtime, **memory)
    if side == "plain" and steps:
        report["ops_ms"] = _plain_ops(plain, q, k, bias, steps)
    return report


def _plain_ops(plain, q, k, bias, steps):
    """The plain forward's ops, each compiled alone: median ms of QK^T, scale + mask, softmax, PV."""
    from mindspore import nn, ops

    class Op(nn.Cell):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def construct(self, *xs):
            return self.fn(*xs)

    def scale_mask(s, b):
        return s * plain.scale + ops.broadcast_to(b, s.shape)

    scores = plain.qk_matmul(q, k)
    probs = plain.softmax(scores)
    parts = {
        "qk_matmul": (Op(plain.qk_matmul), (q, k)),
        "scale_mask": (Op(scale_mask), (scores, bias)),
        "softmax": (Op(plain.softmax), (scores,)),
        "pv_matmul": (Op(plain.pv_matmul), (probs, q)),
    }
    out = {}
    for name, (cell, args) in parts.items():
        out[name] = 1000 * C.median(_timings(lambda: cell(*args).asnumpy(), steps, {}))
    return out


def _torch_worker(shape, steps, threads):
    import torch
    import torch.nn.functional as F
    runtime = C.torch_threads(threads, "torch sdpa worker")
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(shape, generator=gen).requires_grad_(True) for _ in range(3))
    w = torch.randn(shape, generator=gen)

    def step():
        for x in (q, k, v):
            x.grad = None
        (F.scaled_dot_product_attention(q, k, v, is_causal=True) * w).sum().backward()

    memory = {"step_peak_mb": None}
    times = _timings(step, steps, memory) if steps else []
    if not steps:
        step()
    return dict(times=times, runtime_threads=runtime, **memory)


def worker(side, shape_name, steps, threads):
    env = C.check_threads(threads, f"{side} worker")
    shape = SHAPES[shape_name]
    report = _torch_worker(shape, steps, threads) if side == "torch_sdpa" else _ms_worker(side, shape, steps, threads)
    report.update(env=env, side=side, shape=shape_name, peak_rss_mb=C.vm_hwm_mb())
    C.emit(report)


def model_worker(spec, rounds, threads):
    """Whole-model training steps (forward + backward + AdamWeightDecay, graph mode) of one shape with the
    kernel and with the plain path (the same model class, each layer's ``attention.core`` set to its plain core), both in this process,
    steps alternating: the kernel's share of a training step."""
    env = C.check_threads(threads, "model worker")
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    runtime = C.mindspore_threads(threads, "model worker")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    name, batch, seq = spec.split(":")
    s = C.shape_with(name, int(batch), int(seq))
    config = GPTLocalConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                            num_attention_heads=s["heads"], seq_length=s["seq"],
                            max_position_embeddings=max(1024, s["seq"]), hidden_dropout=0.0, attention_dropout=0.0)
    ids = Tensor(np.random.default_rng(0).integers(1, s["vocab"], (s["batch"], s["seq"] + 1)).astype(np.int32))

    class Loss(nn.Cell):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def construct(self, x):
            return self.model(x)[0]

    steps, compile_s = {}, {}
    for side in ("kernel", "plain"):
        model = GPTLocalForCausalLM(config)
        model.set_train(True)
        if side == "plain":
            for layer in model.model.layers:
                layer.attention.core = layer.attention.plain
        elif model.model.layers[0].attention.core is model.model.layers[0].attention.plain:
            raise SystemExit("the kernel did not build")
        weights = model.trainable_params()
        optimizer = nn.AdamWeightDecay(weights, 1e-4)
        grad = ms.jit(ms.value_and_grad(Loss(model), None, weights=weights))

        def step(grad=grad, optimizer=optimizer):
            loss, grads = grad(ids)
            optimizer(grads)
            return float(loss.asnumpy())
        steps[side] = step
        start = time.perf_counter()
        step()
        compile_s[side] = time.perf_counter() - start
    times = C.alternate(("kernel", "plain"), rounds, lambda side, _index: C.timed(steps[side]))
    tokens = s["batch"] * s["seq"]
    C.emit(dict(env=env, runtime_threads=runtime, spec=spec, first_step_s=compile_s,
                tokens_per_s={side: tokens / C.median(t) for side, t in times.items()},
                step_ms={side: [1000 * x for x in t] for side, t in times.items()}))



def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="small256,small1024,tiny2048")
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5, help="timed forward + backward calls per worker")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--models", default="", help="also whole-model training steps, kernel vs plain path in one "
                        "process, e.g. tiny:4:256,tiny:1:2048,small:2:256 (shape:batch:seq)")
    parser.add_argument("--model-rounds", type=int, default=6)
    parser.add_argument("--model-worker", help=argparse.SUPPRESS)
    parser.add_argument("--worker", nargs=2, metavar=("SIDE", "SHAPE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.steps, args.threads)
    if args.model_worker:
        return model_worker(args.model_worker, args.model_rounds, args.threads)
    print(C.machine_line(args.threads))
    if args.models:
        print("| model batch x seq | tokens/s kernel | tokens/s plain | kernel / plain | first step s kernel / plain |\n"
              "| --- | ---: | ---: | ---: | ---: |")
    for spec in filter(None, args.models.split(",")):
        report, _ = C.run_worker(__file__, ["--model-worker", spec, "--model-rounds", str(args.model_rounds),
                                            "--threads", str(args.threads)], args.threads)
        tps, first = report["tokens_per_s"], report["first_step_s"]
        print(f"| {spec} | {tps['kernel']:.0f} | {tps['plain']:.0f} | {tps['kernel'] / tps['plain']:.2f}x | "
              f"{first['kernel']:.1f} / {first['plain']:.1f} |", flush=True)
    sides = tuple(filter(None, args.sides.split(",")))
    if not sides or not args.shapes:
        return None
    rows, splits = [], {}
    for shape in args.shapes.split(","):
        def measure(side, _index, shape=shape):
            report, _ = C.run_worker(__file__, ["--worker", side, shape, "--steps", str(args.steps),
                                                "--threads", str(args.threads)], args.threads)
            return report
        results = C.alternate(sides, args.rounds, measure)
        plain = C.median([C.median(r["times"]) for r in results.get("plain", [])])
        for side in sides:
            ms_per = [1000 * C.median(r["times"]) for r in results[side]]
            ratio = f"{plain * 1000 / C.median(ms_per):.2f}x" if plain else "-"
            rows.append(f"| {shape} {SHAPES[shape]} | {side} | {C.spread(ms_per, '{:.1f}')} | {ratio} | "
                        f"{C.spread([r['step_peak_mb'] for r in results[side]])} |")
        ops_ms = [r["ops_ms"] for r in results.get("plain", []) if "ops_ms" in r]
        if ops_ms:
            split = {name: C.median([o[name] for o in ops_ms]) for name in ops_ms[0]}
            splits[shape] = {k: round(v, 1) for k, v in split.items()}
            print(f"{shape}: plain forward by op (ms, median): {json.dumps(splits[shape])}", flush=True)
        print("\n".join(rows[-len(sides):]), flush=True)
    print("\n| shape (B, N, S, D) | side | fwd+bwd ms, median [min-max] | speed-up vs plain | "
          "fwd+bwd peak RSS above its start, MB |\n| --- | --- | ---: | ---: | ---: |")
    print("\n".join(rows))
    print(f"\nthe plain path's forward by op (ms, medians): {json.dumps(splits)}")


if __name__ == "__main__":
    main()
