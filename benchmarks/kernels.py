"""gpt_local's CPU kernels against the plain MindSpore ops they replace, one part at a time:

    python benchmarks/kernels.py attention [--shapes small256,small1024,tiny2048] [--rounds 3]
    python benchmarks/kernels.py attention --shapes "" --models tiny:4:256,small:2:256   # whole training steps
    python benchmarks/kernels.py norm-gelu [--rounds 20]
    python benchmarks/kernels.py linear [--shapes qkv,proj,fc1,fc2,head] [--rows 1,2,4,8,16,32,64,256]
    python benchmarks/kernels.py decode-layer [--shapes tiny,small] [--copies 1,12]
    python benchmarks/kernels.py kv-write [--shapes tiny small] [--batches 1 8] [--cache-lengths 64 512 2048]
    python benchmarks/kernels.py reduce

Parts:
  attention     one causal attention's forward + backward, fp32: the plain path (matmul + softmax, the [B, N, S, S]
                scores kept), BlockwiseAttention (``attention_block_size: 256``), the fused kernel
                (``cpu_attention.cc``) and PyTorch's ``scaled_dot_product_attention`` (its CPU flash kernel); each side
                its own worker, sides alternating; ms a call after a warm-up (the compile) and the working memory (the
                peak RSS from the first call on above the RSS before it); also the plain forward split into its ops.
                ``--models shape:batch:seq,...``: whole training steps with the kernel and with the plain core.
  norm-gelu     LayerNorm and bias + GeLU (tanh, quick), forward + backward (``value_and_grad``), kernel against
                ``ops.LayerNorm`` / bias Add + TanhGeLU or FastGeLU, on the tiny (4 x 256) and GPT-2 small (2 x 256)
                training shapes.
  linear        Linear's x W^T (+ b) by row count: MatMul (+ BroadcastTo + Add; ``cpu_kernels {linear: plain}``)
                against the GEMM kernel (``{linear: kernel}``), GPT-2 small's Linears (12 distinct weights a Cell, as a
                prefill graph) and its head; where ``kernels.provider.LINEAR_GEMM_ROWS`` / ``HEAD_GEMM_ROWS`` come from.
                Wall median [min] and the process's CPU time; fc1 without bias (its bias goes to bias + GeLU).
  decode-layer  the decode-layer kernel per call, in a compiled graph (``--reps`` calls unrolled in one Cell, as the
                decode step calls it once a layer) and directly (its C entry point on the same arrays, no MindSpore
                around it): what running inside MindSpore's graph costs a call. ``--copies``: distinct weight sets
                taken in turn (1: cached; 12: read from memory, as a decode step reads them). Batch 1, a cache of
                ``--length`` rows, the token at its middle.
  kv-write      decode step time against the KV cache's length: the in-place write (``kv_write.cc``) against
                MindSpore's ScatterNdUpdate (``cpu_kernels {kv_write: plain}``), both on the plain decode graph
                (``decode_layer: plain``: the decode-layer kernel writes the cache itself); ``--serve-slots 16``: the
                serve engine's step (b rows of a 16-slot cache). Wall and CPU ms a step, the logits compared.
  reduce        why the gradient checks and GeLU are written as they are: MindSpore's ReduceSum / ReduceAll(IsFinite)
                / GeLU against the composed forms used instead (``training/grad_checks.py``), best of 5.

Every measured side runs in a worker process started with ``_common.worker_env`` (OMP/MKL/OpenBLAS threads =
``--threads``) that calls ``_common.check_threads`` first and sets MindSpore's ``runtime_num_threads`` (and torch's) to
the same; sides alternate (``_common.alternate``); the machine line comes first. GRAPH mode, CPU, random weights.

The kernels are reached in ONE place, the "kernel adapter" section below (``kernel_cell``, ``linear_cell``,
``direct_call``): the kernel Cells as ``KernelProvider`` hands them to a model, and the decode layer's C entry point.
When the kernels' Cells, arguments or entry points change, follow them there.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package; it imports the standard library only)


# ---------------------------------------------------------------------------------------------- kernel adapter
def provider(modes):
    """The ``KernelProvider`` a model with ``model_config.cpu_kernels`` ``modes`` builds on CPU."""
    from mindformers_gptlocal.kernels.provider import KernelProvider
    return KernelProvider(modes, device_target="CPU")


def kernel_cell(op, *args):
    """``op``'s kernel Cell as the provider hands it to a model under ``cpu_kernels {op: kernel}`` (the provider
    method of that name, with ``args``: e.g. ``kernel_cell("layer_norm", 1e-5, ms.float32)``); stops where it does
    not build here."""
    cell = getattr(provider({op: "kernel"}), op)(*args)
    if cell is None:
        raise SystemExit(f"the {op} kernel did not build here (no kernel library?)")
    return cell


def linear_cell(inp, out, bias, mode):
    """One ``model/layers.py`` Linear [out, in] (+ bias) with the provider of ``cpu_kernels {linear: mode}``."""
    import mindspore as ms
    from mindformers_gptlocal.model.layers import Linear
    return Linear(inp, out, 0.02, ms.float32, ms.float32, has_bias=bias, kernels=provider({"linear": mode}))


def direct_call(cell, inputs, output):
    """The kernel Cell's C entry point bound to numpy ``inputs`` (its construct's, in order), its config and
    ``output``: ``.call()`` runs it outside MindSpore (``kernels/abi/aot.py`` ``DirectCall``) and returns its status."""
    import ctypes
    from mindformers_gptlocal.kernels.abi import build
    from mindformers_gptlocal.kernels.abi.aot import DirectCall
    function = getattr(ctypes.CDLL(build.library()[0]), cell.symbol)
    return DirectCall(function, [*inputs, cell.config.asnumpy(), output])


# ---------------------------------------------------------------------------------------------- attention
ATTENTION_SHAPES = {"small256": (2, 12, 256, 64), "small1024": (1, 12, 1024, 64), "tiny2048": (1, 4, 2048, 64),
                    "noop": (1, 2, 8, 8)}  # (batch, heads, seq, head_dim)
ATTENTION_SIDES = ("plain", "blockwise", "kernel", "torch_sdpa")
BLOCK = 256


def _timings(step, steps, memory):
    """Step seconds after one warm-up call (the compile); ``memory['step_peak_mb']``: the peak RSS from the warm-up on
    above the RSS before it (MindSpore's pool keeps what the first call took: the working memory of one call)."""
    C.reset_peak()
    base = C.rss_mb()
    step()
    times = [C.timed(step) for _ in range(steps)]
    memory["step_peak_mb"] = C.vm_hwm_mb() - base
    return times


def _attention_ms(side, shape, steps):
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.attention import ParallelAttention
    from mindformers_gptlocal.model.blockwise_attention import BlockwiseAttention
    batch, heads, seq, dim = shape
    rng = np.random.default_rng(0)
    q, k, v, w = (Tensor(rng.standard_normal(shape).astype(np.float32)) for _ in range(4))
    scale = 1.0 / dim ** 0.5
    config = GPTLocalConfig(vocab_size=64, hidden_size=heads * dim, num_attention_heads=heads, num_hidden_layers=1,
                            max_position_embeddings=seq, seq_length=seq)
    from mindformers_gptlocal.kernels.provider import KernelProvider
    # the matmul + softmax core: context [B, S, N * D]
    plain = ParallelAttention(config, 1, kernels=KernelProvider.from_config(config)).plain
    if side == "plain":  # the weights in the plain core's output layout: the same loss
        w = Tensor(w.asnumpy().transpose(0, 2, 1, 3).reshape(batch, seq, heads * dim))
    bias = Tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1)[None, None])
    no_keep = Tensor(np.ones((1,), np.bool_))
    cell = None
    if side == "blockwise":
        cell = BlockwiseAttention(BLOCK, scale, ms.float32, ms.float32)
    elif side == "kernel":
        cell = kernel_cell("attention", scale, ms.float32)

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
    report = dict(times=times, **memory)
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
    parts = {"qk_matmul": (Op(plain.qk_matmul), (q, k)), "scale_mask": (Op(scale_mask), (scores, bias)),
             "softmax": (Op(plain.softmax), (scores,)), "pv_matmul": (Op(plain.pv_matmul), (probs, q))}
    return {name: 1000 * C.median(_timings(lambda c=cell, a=args: c(*a).asnumpy(), steps, {}))
            for name, (cell, args) in parts.items()}


def _attention_torch(shape, steps):
    import torch
    import torch.nn.functional as F
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
    return dict(times=times, **memory)


def attention_worker(args, report):
    """One side's forward + backward at one shape (``--side``, ``--shape``), or ``--models``' whole-model steps."""
    if args.model_worker:
        return report.update(model_steps(args.model_worker, args.model_rounds))
    shape = ATTENTION_SHAPES[args.shape]
    report.update(_attention_torch(shape, args.steps) if args.side == "torch_sdpa" else
                  _attention_ms(args.side, shape, args.steps), side=args.side, shape=args.shape,
                  peak_rss_mb=C.vm_hwm_mb())
    return None


def model_steps(spec, rounds):
    """Whole-model training steps (forward + backward + AdamWeightDecay, graph mode) of ``shape:batch:seq`` with the
    kernel and with the plain core (each layer's ``attention.core`` set to its plain one), both in this process,
    steps alternating: the kernel's share of a training step."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
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
            raise SystemExit("the attention kernel did not build")
        weights = model.trainable_params()
        optimizer = nn.AdamWeightDecay(weights, 1e-4)
        grad = ms.jit(ms.value_and_grad(Loss(model), None, weights=weights))

        def step(grad=grad, optimizer=optimizer):
            loss, grads = grad(ids)
            optimizer(grads)
            return float(loss.asnumpy())
        steps[side] = step
        compile_s[side] = C.timed(step)
    times = C.alternate(("kernel", "plain"), rounds, lambda side, _index: C.timed(steps[side]))
    tokens = s["batch"] * s["seq"]
    return dict(spec=spec, first_step_s=compile_s, tokens_per_s={side: tokens / C.median(t) for side, t in
                                                                 times.items()})


def attention_main(args):
    common = ["--threads", str(args.threads), "--worker"]
    if args.models:
        print("| model batch x seq | tokens/s kernel | tokens/s plain | kernel / plain | first step s kernel / plain "
              "|\n| --- | ---: | ---: | ---: | ---: |")
    for spec in filter(None, args.models.split(",")):
        report, _ = C.run_worker(__file__, ["attention", "--model-worker", spec, "--model-rounds",
                                            str(args.model_rounds), *common], args.threads)
        tps, first = report["tokens_per_s"], report["first_step_s"]
        print(f"| {spec} | {tps['kernel']:.0f} | {tps['plain']:.0f} | {tps['kernel'] / tps['plain']:.2f}x | "
              f"{first['kernel']:.1f} / {first['plain']:.1f} |", flush=True)
    sides = tuple(filter(None, args.sides.split(",")))
    if not sides or not args.shapes:
        return
    rows, splits = [], {}
    for shape in args.shapes.split(","):
        def measure(side, _index, shape=shape):
            return C.run_worker(__file__, ["attention", "--side", side, "--shape", shape, "--steps", str(args.steps),
                                           *common], args.threads)[0]
        results = C.alternate(sides, args.rounds, measure)
        plain = C.median([C.median(r["times"]) for r in results.get("plain", [])])
        for side in sides:
            ms_per = [1000 * C.median(r["times"]) for r in results[side]]
            ratio = f"{plain * 1000 / C.median(ms_per):.2f}x" if plain else "-"
            rows.append(f"| {shape} {ATTENTION_SHAPES[shape]} | {side} | {C.spread(ms_per, '{:.1f}')} | {ratio} | "
                        f"{C.spread([r['step_peak_mb'] for r in results[side]])} |")
        ops_ms = [r["ops_ms"] for r in results.get("plain", []) if "ops_ms" in r]
        if ops_ms:
            splits[shape] = {name: round(C.median([o[name] for o in ops_ms]), 1) for name in ops_ms[0]}
        print("\n".join(rows[-len(sides):]), flush=True)
    print("\n| shape (B, N, S, D) | side | fwd+bwd ms, median [min-max] | speed-up vs plain | "
          "fwd+bwd peak RSS above its start, MB |\n| --- | --- | ---: | ---: | ---: |")
    print("\n".join(rows))
    print(f"\nthe plain path's forward by op (ms, medians): {json.dumps(splits)}")


# ---------------------------------------------------------------------------------------------- norm-gelu
def norm_gelu_worker(args, _report):
    """Prints one row per case: LayerNorm, bias + tanh GeLU, bias + quick GeLU at two shapes."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindformers_gptlocal.model.layers import TanhGeLU

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

    def normal(*shape):
        return Tensor(rng.standard_normal(shape).astype(np.float32))
    cases = []
    for tokens, hidden in ((1024, 256), (512, 768)):  # the tiny 4 x 256 and GPT-2 small 2 x 256 steps
        x = normal(tokens, hidden)
        cases.append((f"LayerNorm [{tokens}, {hidden}]", (x, normal(hidden), normal(hidden), normal(tokens, hidden)),
                      kernel_cell("layer_norm", 1e-5, ms.float32), PlainLayerNorm()))
        wide = 4 * hidden
        inputs = (normal(tokens, wide), normal(wide), normal(tokens, wide))
        for form in ("tanh", "quick"):
            cases.append((f"bias + {form} GeLU [{tokens}, {wide}]", inputs, kernel_cell("bias_gelu", form, ms.float32),
                          PlainBiasGeLU(form)))
    for label, inputs, kernel, plain in cases:
        fns = {name: ms.jit(ms.value_and_grad(Weighted(cell), tuple(range(len(inputs) - 1))))
               for name, cell in (("kernel", kernel), ("plain", plain))}
        results = {name: fn(*inputs) for name, fn in fns.items()}  # compiles
        diff = max(float(np.abs(a.asnumpy() - c.asnumpy()).max() / max(1.0, np.abs(c.asnumpy()).max()))
                   for a, c in zip(results["kernel"][1], results["plain"][1]))
        times = C.alternate(("kernel", "plain"), args.rounds,
                            lambda name, _i: C.timed(lambda: fns[name](*inputs)[0].asnumpy()))
        plain_ms, kernel_ms = (1000 * C.median(times[name]) for name in ("plain", "kernel"))
        print(f"| {label} | {plain_ms:.2f} | {kernel_ms:.2f} | {plain_ms / kernel_ms:.2f}x | {diff:.1e} |", flush=True)


# ---------------------------------------------------------------------------------------------- linear
LINEAR_SHAPES = {"qkv": (768, 2304, True, 12), "proj": (768, 768, True, 12), "fc1": (768, 3072, False, 12),
                 "fc2": (3072, 768, True, 12), "head": (768, 50257, False, 1)}  # (in, out, bias, Linears a Cell)


def linear_worker(args, _report):
    """Prints one row per (shape, rows)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn

    class Stack(nn.Cell):
        def __init__(self, count, inp, out, bias, mode):
            super().__init__()
            self.linears = nn.CellList([linear_cell(inp, out, bias, mode) for _ in range(count)])

        def construct(self, x):
            return tuple(linear(x) for linear in self.linears)

    rng = np.random.default_rng(0)
    for name in args.shapes.split(","):
        inp, out, bias, count = LINEAR_SHAPES[name]
        count = count if args.layers is None or name == "head" else args.layers
        stacks = {side: Stack(count, inp, out, bias, mode)
                  for side, mode in (("matmul", "plain"), ("kernel", "kernel"))}
        for stack in stacks.values():
            stack.set_train(False)
        for (_, p), (_, q) in zip(stacks["matmul"].parameters_and_names(), stacks["kernel"].parameters_and_names()):
            value = Tensor((0.02 * rng.standard_normal(p.shape)).astype(np.float32))
            p.set_data(value)
            q.set_data(value)
        for m in (int(r) for r in args.rows.split(",")):
            x = Tensor(rng.standard_normal((m, inp)).astype(np.float32))
            outputs = {side: stack(x) for side, stack in stacks.items()}  # compiles
            diff = max(float(np.abs(a.asnumpy() - b.asnumpy()).max())
                       for a, b in zip(outputs["matmul"], outputs["kernel"]))

            def measure(side, _index, x=x):
                wall, cpu = time.perf_counter(), time.process_time()
                for _ in range(args.reps):
                    result = stacks[side](x)
                result[-1].asnumpy()
                return (time.perf_counter() - wall) / args.reps * 1e3, (time.process_time() - cpu) / args.reps * 1e3

            times = C.alternate(("matmul", "kernel"), args.rounds, measure)
            mm, kk = np.array(times["matmul"]), np.array(times["kernel"])
            print(f"| {name} {inp}->{out}{' +b' if bias else ''} x{count} | {m} | {np.median(mm[:, 0]):.3f} "
                  f"[{mm[:, 0].min():.3f}] | {np.median(kk[:, 0]):.3f} [{kk[:, 0].min():.3f}] | "
                  f"{np.median(mm[:, 1]):.3f} | {np.median(kk[:, 1]):.3f} | "
                  f"{mm[:, 0].min() / kk[:, 0].min():.2f}x, {np.median(mm[:, 1]) / np.median(kk[:, 1]):.2f}x | "
                  f"{diff:.1e} | {os.getloadavg()[0]:.1f} |", flush=True)


# ---------------------------------------------------------------------------------------------- decode-layer
DECODE_SHAPES = {"tiny": (256, 4, 1024), "small": (768, 12, 3072)}  # (hidden, heads, intermediate)


def layer_arrays(rng, hidden, inter):
    """One GPT-2 layer's twelve float32 weights in the kernel's order (ln1, qkv, proj, ln2, fc1, fc2; weight, bias)."""
    shapes = [(hidden,), (hidden,), (3 * hidden, hidden), (3 * hidden,), (hidden, hidden), (hidden,), (hidden,),
              (hidden,), (inter, hidden), (inter,), (hidden, inter), (hidden,)]
    arrays = [(0.02 * rng.standard_normal(s)).astype("float32") for s in shapes]
    arrays[0] += 1.0
    arrays[6] += 1.0
    return arrays


def decode_layer_worker(args, _report):
    """Prints one row per (shape, copies)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Parameter, Tensor, nn
    rng = np.random.default_rng(0)
    reps, length = args.reps, args.length
    for name in args.shapes.split(","):
        hidden, heads, inter = DECODE_SHAPES[name]
        dim = hidden // heads
        for copies in (int(c) for c in args.copies.split(",")):
            sets = [layer_arrays(rng, hidden, inter) for _ in range(copies)]
            caches = [np.zeros((1, heads, length, dim), np.float32) for _ in range(2)]
            index = np.zeros((1, heads, 1, 3), np.int32)
            index[..., 1] = np.arange(heads)[None, :, None]
            index[..., 2] = length // 2
            bias = np.zeros((1, 1, 1, length), np.float32)
            bias[..., length // 2 + 1:] = -1e4
            hidden_in = rng.standard_normal((1, 1, hidden)).astype(np.float32)
            kernel = kernel_cell("decode_layer", 1e-5, dim ** -0.5, "tanh", ms.float32)

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
            direct = [direct_call(kernel, [hidden_in, *arrays, *caches, index, bias], np.zeros_like(hidden_in))
                      for arrays in sets]
            for call in direct:
                if call.call() != 0:
                    raise RuntimeError(f"{kernel.symbol} returned a non-zero status")

            def measure(side, _index, graph=graph, inputs=inputs, direct=direct, copies=copies):
                start = time.perf_counter()
                if side == "graph":
                    graph(*inputs).asnumpy()
                else:
                    for call in range(reps):
                        direct[call % copies].call()
                return (time.perf_counter() - start) / reps * 1e6

            times = C.alternate(("graph", "direct"), args.rounds, measure)
            g, d = np.array(times["graph"]), np.array(times["direct"])
            megabytes = sum(a.nbytes for a in sets[0]) / 2 ** 20
            print(f"| {name} (hidden {hidden}, {megabytes:.1f} MB a layer) | {copies} | {np.median(g):.1f} "
                  f"[{g.min():.1f}] | {np.median(d):.1f} [{d.min():.1f}] | {np.median(g) / np.median(d):.2f}x | "
                  f"{os.getloadavg()[0]:.1f} |", flush=True)


# ---------------------------------------------------------------------------------------------- kv-write
KV_SHAPES = {"tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=8192),
             "small": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257)}


def kv_model(shape, write):
    """The random model on the plain decode graph (``decode_layer: plain``) with its KV write ``write``: kernel (the
    in-place write) or plain (ScatterNdUpdate); the same seed, so the same weights."""
    import mindspore as ms
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    ms.set_seed(0)
    model = GPTLocalForCausalLM(GPTLocalConfig(max_position_embeddings=2048, seq_length=2048, hidden_dropout=0.0,
                                               attention_dropout=0.0, **KV_SHAPES[shape],
                                               cpu_kernels={"decode_layer": "plain", "kv_write": write}))
    model.set_train(False)
    return model


def kv_step_times(model, batch, length, steps, vocab, slots=0):
    import numpy as np
    model.__dict__.pop("_kv_caches", None)  # one cache at a time: GPT-2 small's at batch 8 x 2,048 is 1.2 GB
    cache = model.kv_cache(max(batch, slots), length)
    rng = np.random.default_rng(0)
    cache.prefill([rng.integers(0, vocab, 16).tolist() for _ in range(max(batch, slots))])
    rows = list(range(batch)) if slots > batch else None  # the serve engine's step: b rows of a slots-row cache
    times, logits = [], None
    for position in range(length - steps - 2, length):  # two warm-up steps, then the timed ones
        start, cpu = time.perf_counter(), time.process_time()
        logits = cache.step(rng.integers(0, vocab, (batch, 1)), np.full((batch, 1), position), np.zeros(batch), rows)
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    model.__dict__.pop("_kv_caches", None)
    return times[2:], logits


def kv_write_worker(args, _report):
    import numpy as np
    for shape in args.shapes:
        models = {"in-place": kv_model(shape, "kernel"), "plain": kv_model(shape, "plain")}
        for batch in args.batches:
            for length in args.cache_lengths:
                last = {}

                def measure(side, _round, batch=batch, length=length, last=last, models=models, shape=shape):
                    times, last[side] = kv_step_times(models[side], batch, length, args.steps,
                                                      KV_SHAPES[shape]["vocab_size"], args.serve_slots)
                    return times

                runs = C.alternate(("in-place", "plain"), args.rounds, measure)
                wall = {side: [1e3 * t[0] for r in runs[side] for t in r] for side in runs}
                cpu = {side: [1e3 * t[1] for r in runs[side] for t in r] for side in runs}
                diff = float(np.abs(last["in-place"] - last["plain"]).max())
                print(f"| {shape} | {batch} | {length} | {C.spread(wall['in-place'], '{:.2f}')} | "
                      f"{C.spread(wall['plain'], '{:.2f}')} | {C.median(cpu['in-place']):.2f} | "
                      f"{C.median(cpu['plain']):.2f} | {min(wall['plain']) / min(wall['in-place']):.2f}x, "
                      f"{C.median(cpu['plain']) / C.median(cpu['in-place']):.2f}x | {diff:.1e} |", flush=True)


# ---------------------------------------------------------------------------------------------- reduce
def reduce_worker(_args, _report):
    import numpy as np
    from mindspore import Tensor, nn, ops
    from mindformers_gptlocal.training.grad_checks import sum_all
    gelu_scale = 2.0 * 0.7978845608028654  # 2 * sqrt(2 / pi)

    def square_sum_reduce(x):
        return ops.ReduceSum()(x * x)

    def square_sum_two_stage(x):
        return sum_all(x * x)

    def finite_reduce(x):
        return ops.ReduceAll()(ops.IsFinite()(x))

    def finite_two_stage(x):
        return ops.IsFinite()(sum_all(x * x))

    def gelu_op(x):
        return ops.GeLU()(x)

    def gelu_composed(x):
        return x * ops.sigmoid(gelu_scale * (x + 0.044715 * x * x * x))

    class Fn(nn.Cell):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def construct(self, x):
            return self.fn(x)

    def best_ms(fn, x):
        cell = Fn(fn)
        cell(x)
        return 1000 * min(C.timed(lambda: cell(x).asnumpy()) for _ in range(5))

    grad = Tensor(np.random.default_rng(0).standard_normal((50257, 768)).astype(np.float32))
    act = Tensor(np.random.default_rng(1).standard_normal((512, 3072)).astype(np.float32))
    rows = [("sum of squares, [50257, 768]", "ReduceSum(x*x, all axes)", square_sum_reduce,
             "last axis, then the rest", square_sum_two_stage, grad),
            ("finite check, [50257, 768]", "ReduceAll(IsFinite(x))", finite_reduce,
             "IsFinite(two-stage sum of x*x)", finite_two_stage, grad),
            ("tanh GeLU, [512, 3072]", "GeLU kernel", gelu_op, "x*sigmoid(2c(x+0.044715x^3))", gelu_composed, act)]
    for work, name_a, fn_a, name_b, fn_b, x in rows:
        a, b = best_ms(fn_a, x), best_ms(fn_b, x)
        print(f"| {work} | {name_a} | {a:.1f} | {name_b} | {b:.1f} | {a / b:.1f}x |", flush=True)


# ---------------------------------------------------------------------------------------------- parts
HEADERS = {
    "norm-gelu": "| op (forward + backward) | plain ms | kernel ms | plain / kernel | max diff |\n"
                 "| --- | ---: | ---: | ---: | ---: |",
    "linear": "| shape | rows M | matmul wall ms | kernel wall ms | matmul CPU ms | kernel CPU ms | "
              "matmul / kernel (wall min, CPU) | max abs diff | 1-min load |\n"
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    "decode-layer": "| shape | weight sets | in a graph, us a call | direct, us a call | graph / direct | 1-min load "
                    "|\n| --- | ---: | ---: | ---: | ---: | ---: |",
    "kv-write": "ms per decode step: wall median [min-max], and the process's CPU time (all threads) median\n"
                "| shape | batch | cache rows | in-place wall | plain wall | in-place CPU | plain CPU | plain / "
                "in-place (wall min, CPU) | max abs logit diff |\n"
                "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    "reduce": "graph mode, best of 5\n| work | MindSpore kernel | ms | used instead | ms | speed-up |\n"
              "| --- | --- | ---: | --- | ---: | ---: |",
}
WORKERS = {"attention": attention_worker, "norm-gelu": norm_gelu_worker, "linear": linear_worker,
           "decode-layer": decode_layer_worker, "kv-write": kv_write_worker, "reduce": reduce_worker}


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    sub = {name: parts.add_parser(name) for name in WORKERS}
    for name, part in sub.items():
        part.add_argument("--threads", type=int, default=2)
        part.add_argument("--rounds", type=int, default={"attention": 3, "kv-write": 2}.get(name, 10))
        part.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
        part.add_argument("--noop", action="store_true", help=argparse.SUPPRESS)  # threads checked, nothing measured
    part = sub["attention"]
    part.add_argument("--shapes", default="small256,small1024,tiny2048")
    part.add_argument("--sides", default=",".join(ATTENTION_SIDES))
    part.add_argument("--steps", type=int, default=5, help="timed forward + backward calls per worker")
    part.add_argument("--models", default="", help="also whole-model training steps, kernel vs plain core in one "
                      "process, e.g. tiny:4:256,tiny:1:2048,small:2:256 (shape:batch:seq)")
    part.add_argument("--model-rounds", type=int, default=6)
    part.add_argument("--model-worker", help=argparse.SUPPRESS)
    part.add_argument("--side", choices=ATTENTION_SIDES, help=argparse.SUPPRESS)
    part.add_argument("--shape", choices=list(ATTENTION_SHAPES), help=argparse.SUPPRESS)
    part = sub["linear"]
    part.add_argument("--shapes", default=",".join(LINEAR_SHAPES))
    part.add_argument("--rows", default="1,2,4,8,16,32,64,256")
    part.add_argument("--reps", type=int, default=5)
    part.add_argument("--layers", type=int, help="Linears a Cell for the four layer shapes (default 12)")
    part = sub["decode-layer"]
    part.add_argument("--shapes", default=",".join(DECODE_SHAPES))
    part.add_argument("--copies", default="1,12", help="distinct weight sets, in turn (comma-separated)")
    part.add_argument("--length", type=int, default=192, help="cache rows")
    part.add_argument("--reps", type=int, default=24, help="calls per measurement (and per graph)")
    part = sub["kv-write"]
    part.add_argument("--shapes", nargs="+", default=["tiny", "small"], choices=sorted(KV_SHAPES))
    part.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    part.add_argument("--cache-lengths", nargs="+", type=int, default=[64, 256, 512, 1024, 2048])
    part.add_argument("--steps", type=int, default=8)
    part.add_argument("--serve-slots", type=int, default=0,
                      help="time the serve engine's step instead: --batches rows of a cache of this many slots")
    args = parser.parse_args(argv)
    known = {"linear": LINEAR_SHAPES, "decode-layer": DECODE_SHAPES, "attention": ATTENTION_SHAPES}.get(args.part)
    if known and isinstance(args.shapes, str):
        unknown = [s for s in args.shapes.split(",") if s and s not in known]
        if unknown:
            parser.error(f"--shapes: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return args


def worker(args):
    """A worker: the threads checked first (C environment, then MindSpore's / torch's pool), then the part's body."""
    report = {"env": C.check_threads(args.threads, f"kernels {args.part} worker")}
    if args.part == "attention" and args.side == "torch_sdpa":
        report["runtime_threads"] = C.torch_threads(args.threads, "kernels attention worker")
    else:
        import mindspore as ms
        report["runtime_threads"] = C.mindspore_threads(args.threads, f"kernels {args.part} worker")
        ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    if not args.noop:
        WORKERS[args.part](args, report)
    if args.noop or args.part == "attention":
        C.emit(report)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        return worker(args)
    print(C.machine_line(args.threads), flush=True)
    print(f"kernels {args.part}: {args.rounds} rounds, sides alternating", flush=True)
    if args.part == "attention":
        return attention_main(args)
    print(HEADERS[args.part], flush=True)
    # the part's rows come from one worker (both sides in it, alternating), printed as they are measured
    subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--worker"], env=C.worker_env(args.threads),
                   cwd=tempfile.gettempdir(), check=True)
    return None


if __name__ == "__main__":
    main()
