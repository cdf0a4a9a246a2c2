"""Decode step time against the KV cache's length: the in-place write (model/kv_write.py) against
MindSpore's ScatterNdUpdate (the plain path), same weights, one process, sides alternating.

    python benchmarks/kv_cache_lengths.py                                  # tiny and small, batch 1 and 8
    python benchmarks/kv_cache_lengths.py --shapes tiny --batches 1 --cache-lengths 64 2048

For each shape, batch and cache length L, each side builds its cache (``model.kv_cache(batch, L)``),
prefills 16 tokens and times one-token ``decode`` calls written at the cache's last rows (L-steps..L-1;
attention reads all L rows either way). ``--serve-slots 16`` times the serve engine's step instead:
b rows of a 16-slot cache (``KVCache.step(..., slots=)``). The plain side is the same model with every attention's write
swapped back to ``ops.ScatterNdUpdate`` before its first cache graph compiles. Also printed: the logits of
both sides' last step agree (max abs difference). Figures are milliseconds per step over --rounds x
--steps: wall time and the process's CPU time (less disturbed by other processes on a busy machine). Random weights (no download), fp32, graph mode, --threads threads.
"""
import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)

SHAPES = {"tiny": dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4, vocab_size=8192),
          "small": dict(num_hidden_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=50257)}


def build(shape, plain):
    import mindspore as ms
    from mindspore import ops
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    ms.set_seed(0)
    model = GPTLocalForCausalLM(GPTLocalConfig(max_position_embeddings=2048, seq_length=2048, hidden_dropout=0.0,
                                               attention_dropout=0.0, **SHAPES[shape]))
    model.set_train(False)
    if plain:
        for _, cell in model.cells_and_names():
            if hasattr(cell, "scatter_update") and hasattr(cell, "read_cached"):
                cell.scatter_update = ops.ScatterNdUpdate()
    return model


def step_times(model, batch, length, steps, vocab, slots=0):
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["tiny", "small"], choices=sorted(SHAPES))
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    parser.add_argument("--cache-lengths", nargs="+", type=int, default=[64, 256, 512, 1024, 2048])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--serve-slots", type=int, default=0,
                        help="time the serve engine's step instead: --batches rows of a cache of this many slots")
    args = parser.parse_args()
    os.environ.update({k: str(args.threads) for k in C.THREAD_VARS})  # before MindSpore loads its pools
    import numpy as np
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    C.mindspore_threads(args.threads, "kv_cache_lengths")
    print(C.machine_line(args.threads))
    if args.serve_slots:
        print(f"serve engine's step: each batch's rows read and write their slots of a {args.serve_slots}-slot cache")
    print(f"date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ms per decode step: wall median [min-max], "
          "and the process's CPU time (all threads) median, which a busy machine disturbs less")
    print("| shape | batch | cache rows | in-place wall | plain wall | in-place CPU | plain CPU | plain / in-place "
          "(wall min, CPU) | max abs logit diff |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for shape in args.shapes:
        models = {"in-place": build(shape, False), "plain": build(shape, True)}
        for batch in args.batches:
            for length in args.cache_lengths:
                last = {}

                def measure(side, _round):
                    times, last[side] = step_times(models[side], batch, length, args.steps,
                                                   SHAPES[shape]["vocab_size"], args.serve_slots)
                    return times

                runs = C.alternate(("in-place", "plain"), args.rounds, measure)
                wall = {side: [1e3 * t[0] for r in runs[side] for t in r] for side in runs}
                cpu = {side: [1e3 * t[1] for r in runs[side] for t in r] for side in runs}
                diff = float(np.abs(last["in-place"] - last["plain"]).max())
                print(f"| {shape} | {batch} | {length} | {C.spread(wall['in-place'], '{:.2f}')} | "
                      f"{C.spread(wall['plain'], '{:.2f}')} | {C.median(cpu['in-place']):.2f} | "
                      f"{C.median(cpu['plain']):.2f} | {min(wall['plain']) / min(wall['in-place']):.2f}x, "
                      f"{C.median(cpu['plain']) / C.median(cpu['in-place']):.2f}x | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
