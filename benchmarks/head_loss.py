"""The training step's output head + cross-entropy on CPU, fp32: gpt_local's plain path (MatMul -> [B*S, V] logits
-> LogSoftmax -> GatherD -> masked mean, and their backward) against the fused kernel (``kernels/head_loss.cc``).

    python benchmarks/head_loss.py [--shapes tiny,small] [--rounds 3] [--steps 4] [--threads 2] [--parts head,step,rss]
    HEAD_LOSS_BENCH_CHUNKS=64,128,512 python benchmarks/head_loss.py --parts head   # other chunk sizes too

Per shape (``_common.SHAPES``: tiny 4 x 256, vocab 8192; GPT-2 small 2 x 256, vocab 50257), each in a worker with
the thread variables pinned:
  head     one process, both sides compiled (GRAPH mode, value_and_grad of the loss over hidden and the table),
           calls alternating plain / fused; ms per forward + backward
  step     one process, the whole model twice (same weights; one with the kernel, one with ``head_loss = None``),
           a GRAPH-mode value_and_grad + AdamWeightDecay step each, alternating; ms per step, and the plain
           head's share of the plain step (head ms / step ms)
  rss      one worker per side (``GPTLOCAL_HEAD_LOSS_KERNEL=0`` plain, 1 fused), sides alternating over rounds: the
           whole training step's peak RSS (VmHWM) after --steps steps
Medians over rounds with [min-max].
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402


def _setup(threads, who):
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    C.check_threads(threads, who)
    C.mindspore_threads(threads, who)


def _head_fns(s, chunk_rows=(None,)):
    """(plain, fused, ...) jitted value_and_grad steps over (hidden, table): the fused one per ``chunk_rows``
    (None: the default, ``head_loss.chunk_rows``)."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, ops
    from mindformers_gptlocal.kernels import build, head_loss
    rows, width, vocab = s["batch"] * s["seq"], s["hidden"], s["vocab"]
    rng = np.random.default_rng(0)
    hidden = Tensor(rng.standard_normal((rows, width)).astype(np.float32))
    table = Tensor((rng.standard_normal((vocab, width)) * 0.02).astype(np.float32))
    labels = Tensor(rng.integers(0, vocab, rows).astype(np.int32))
    keep = Tensor(np.ones((rows,), np.float32))
    path, reason = build.library()
    assert path, reason
    cells = [head_loss.CPUHeadLoss(path, vocab, rows=rows) for rows in chunk_rows]
    gather = ops.GatherD()

    def plain(h, w):  # GPTLocalForCausalLM.logits + lm_loss
        log_probs = ops.LogSoftmax(-1)(ops.MatMul(transpose_b=True)(h, w))
        picked = gather(log_probs, 1, ops.reshape(labels, (-1, 1)))
        return ops.reduce_sum(-ops.reshape(picked, (-1,)) * keep) / ops.maximum(ops.reduce_sum(keep), 1.0)

    def fused_step(cell):
        def fused(h, w):
            return cell(h, w, labels, keep)
        step = ms.jit(ms.value_and_grad(fused, (0, 1)))
        return lambda: step(hidden, table)

    plain_step = ms.jit(ms.value_and_grad(plain, (0, 1)))
    return [lambda: plain_step(hidden, table)] + [fused_step(cell) for cell in cells]


def _sync(out):
    loss, grads = out
    loss.asnumpy()
    for grad in grads:
        grad.asnumpy()


def _alternate(fns, steps):
    """ms per call of each fn, calls alternating (A B, B A, ...) after one warm-up call each."""
    for fn in fns:
        _sync(fn())
    times = [[] for _ in fns]
    for step in range(steps):
        order = range(len(fns)) if step % 2 == 0 else reversed(range(len(fns)))
        for index in order:
            start = time.perf_counter()
            _sync(fns[index]())
            times[index].append((time.perf_counter() - start) * 1e3)
    return [C.median(t) for t in times]


def _model(s, untie=False):
    from mindformers_gptlocal import GPTLocalConfig
    return GPTLocalConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                          num_attention_heads=s["heads"], max_position_embeddings=s["seq"], seq_length=s["seq"],
                          hidden_dropout=0.0, attention_dropout=0.0, untie_embeddings_and_output_weights=untie)


def _train_step(model, s):
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor, nn

    class Loss(nn.Cell):
        def __init__(self, net):
            super().__init__()
            self.net = net

        def construct(self, ids):
            return self.net(ids)[0]

    model.set_train(True)
    weights = model.trainable_params()
    grad_fn = ms.jit(ms.value_and_grad(Loss(model), None, weights=weights))
    optimizer = nn.AdamWeightDecay(weights, learning_rate=1e-4)
    ids = Tensor(np.random.default_rng(1).integers(0, s["vocab"], (s["batch"], s["seq"] + 1)).astype(np.int32))

    def step():
        loss, grads = grad_fn(ids)
        optimizer(grads)
        return loss, ()
    return step


def _worker(part, shape, steps, threads):
    _setup(threads, f"head_loss {part}")
    s = C.SHAPES[shape]
    from mindspore import Tensor
    from mindformers_gptlocal import GPTLocalForCausalLM
    if part == "head":
        rows = [None] + [int(r) for r in os.environ.get("HEAD_LOSS_BENCH_CHUNKS", "").split(",") if r]
        plain_ms, *fused_ms = _alternate(_head_fns(s, rows), steps)
        C.emit(dict(plain_ms=plain_ms, fused_ms=fused_ms[0],
                    **{f"fused_rows{r}_ms": t for r, t in zip(rows[1:], fused_ms[1:])}))
    elif part == "step":
        fused_model = GPTLocalForCausalLM(_model(s))
        plain_model = GPTLocalForCausalLM(_model(s))
        assert fused_model.head_loss is not None
        plain_model.head_loss = None
        values = dict(fused_model.parameters_and_names())
        for name, param in plain_model.parameters_and_names():
            param.set_data(Tensor(values[name].asnumpy()))
        plain_ms, fused_ms = _alternate([_train_step(plain_model, s), _train_step(fused_model, s)], steps)
        head_plain = _alternate(_head_fns(s)[:1], steps)[0]
        C.emit(dict(plain_ms=plain_ms, fused_ms=fused_ms, head_plain_ms=head_plain))
    else:  # rss: one side, the whole step
        model = GPTLocalForCausalLM(_model(s))
        assert (model.head_loss is None) == (part == "rss_plain")
        step = _train_step(model, s)
        for _ in range(steps):
            _sync(step())
        C.emit(dict(peak_mb=C.vm_hwm_mb()))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="head,step,rss")
    parser.add_argument("--worker", nargs=2, metavar=("PART", "SHAPE"))
    args = parser.parse_args()
    if args.worker:
        return _worker(args.worker[0], args.worker[1], args.steps, args.threads)
    print(f"CPU: {C.cpu_model()}, threads {args.threads}; busy machine unless stated otherwise", flush=True)
    parts = args.parts.split(",")
    for shape in args.shapes.split(","):
        s = C.SHAPES[shape]
        label = f"{shape} {s['batch']} x {s['seq']} (vocab {s['vocab']})"
        results = {}
        for round_ in range(args.rounds):
            for part in parts:
                sides = ["rss_plain", "rss_fused"] if part == "rss" else [part]
                if part == "rss" and round_ % 2:
                    sides.reverse()
                for side in sides:
                    env = {"GPTLOCAL_HEAD_LOSS_KERNEL": "0" if side == "rss_plain" else "1"}
                    report, _ = C.run_worker(__file__, ["--worker", side, shape, "--steps", str(args.steps),
                                                        "--threads", str(args.threads)], args.threads, **env)
                    for key, value in report.items():
                        results.setdefault(f"{side}.{key}", []).append(value)
        print(f"\n{label}: median [min-max] over {args.rounds} rounds")
        for key, values in results.items():
            print(f"  {key:26s} {C.spread(values, '{:.1f}')}")
        for part, a, b in (("head", "head.plain_ms", "head.fused_ms"), ("step", "step.plain_ms", "step.fused_ms")):
            if a in results:
                print(f"  {part} plain / fused: {C.median(results[a]) / C.median(results[b]):.2f}x")
        if "step.head_plain_ms" in results:
            print(f"  plain head + loss share of the plain step: "
                  f"{C.median(results['step.head_plain_ms']) / C.median(results['step.plain_ms']):.0%}")
        print(json.dumps({k: C.median(v) for k, v in results.items()}))


if __name__ == "__main__":
    main()
