"""Graph-kernel fusion on and off in ONE process: the gpt_local train step compiled once per variant, then
stepped alternately, so machine load hits every variant alike (the per-process benchmark is
graph_kernel_fusion.py).

    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE python benchmarks/graph_kernel_inprocess.py on=
    OMP_NUM_THREADS=2 python benchmarks/graph_kernel_inprocess.py on= on_ln=--enable_expand_ops=LayerNorm,LayerNormGrad

Each argument NAME=FLAGS is a variant with ``enable_graph_kernel=True`` and ``graph_kernel_flags=FLAGS``;
``off`` (no fusion) is always first. Each variant builds the model (``SHAPE`` = layers,hidden,heads,vocab,
batch,seq; default the tiny 4,256,4,8192,4,256), ``GPTLocalAdamW`` and ``GPTLocalTrainOneStepCell`` after
``ms.set_context(enable_graph_kernel=...)``, and compiles in its first call (its time printed); then
``ROUNDS`` (default 6) rounds step every variant once, order alternating, on the same batch. Prints the
median ms a step, off / variant, the largest loss difference against off, and VmHWM of the process.
OMP_WAIT_POLICY must be set in the environment before the start (libgomp reads it when MindSpore loads it).
AKG writes akg_kernel_meta/ into the working directory.
"""
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this tree


def main():
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    from mindformers.tools.register import MindFormerConfig
    from mindformers.core.context.build_context import MFContextOperator
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, GPTLocalTrainOneStepCell
    from mindformers_gptlocal.training.optim import GPTLocalAdamW
    MFContextOperator(MindFormerConfig(use_legacy=False))
    threads = int(os.environ.get("OMP_NUM_THREADS", "2"))
    ms.set_context(mode=0, device_target="CPU", runtime_num_threads=threads)
    shape = os.environ.get("SHAPE", "4,256,4,8192,4,256")
    layers, hidden, heads, vocab, batch, seq = (int(x) for x in shape.split(","))
    config = GPTLocalConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                            max_position_embeddings=max(1024, seq), seq_length=seq, hidden_dropout=0.0,
                            attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    variants = {"off": None}
    for item in sys.argv[1:]:
        name, _, flags = item.partition("=")
        variants[name] = flags
    tokens = np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)).astype(np.int32)
    inputs = (Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((batch, seq), np.int32)),
              Tensor(np.tile(np.arange(seq, dtype=np.int32), (batch, 1))))
    cells = {}
    for name, flags in variants.items():
        if flags is None:
            ms.set_context(enable_graph_kernel=False)
        else:
            ms.set_context(enable_graph_kernel=True, graph_kernel_flags=flags)
        ms.set_seed(0)
        model = GPTLocalForCausalLM(config)
        optimizer = GPTLocalAdamW(model.trainable_params(), learning_rate=1e-3, betas=(0.9, 0.95), weight_decay=0.01)
        cell = GPTLocalTrainOneStepCell(model, optimizer, use_clip_grad=True, max_grad_norm=1.0, scale_sense=1.0)
        cell.set_train(True)
        started = time.perf_counter()
        loss = float(cell(*inputs)[0])
        print(f"{name}: first step (compile) {time.perf_counter() - started:.1f} s, loss {loss:.6f}", flush=True)
        cells[name] = cell
    ms.set_context(enable_graph_kernel=False)
    times = {name: [] for name in cells}
    losses = {name: [] for name in cells}
    order = list(cells)
    for index in range(int(os.environ.get("ROUNDS", "6"))):
        for name in (order if index % 2 == 0 else order[::-1]):
            started = time.perf_counter()
            losses[name].append(float(cells[name](*inputs)[0]))
            times[name].append(time.perf_counter() - started)
    print(f"load average {os.getloadavg()[0]:.1f}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    base = statistics.median(times["off"])
    for name in order:
        step = statistics.median(times[name])
        diff = max(abs(a - b) for a, b in zip(losses[name], losses["off"]))
        print(f"{name:10} {step * 1000:8.1f} ms/step [{min(times[name]) * 1000:.0f}-{max(times[name]) * 1000:.0f}]  "
              f"off/this {base / step:.2f}x  max loss diff vs off {diff:.2e}  flags {variants[name]!r}")
    with open("/proc/self/status", encoding="utf-8") as status:
        print(next(line.strip() for line in status if line.startswith("VmHWM")))


if __name__ == "__main__":
    main()
