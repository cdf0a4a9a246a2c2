"""Where one `gptlocal serve` request's time goes, in one process: the engine (no HTTP, one step per iteration)
and `model.generate` at batch 1, alternating over --rounds; per compiled call (prefill, single step) and the host
work between calls; VmRSS after load and after warm-up.

    python benchmarks/serve_profile.py --shape tiny --new 32 --rounds 6 --threads 2
    python benchmarks/serve_profile.py --shape tiny --new 32 --rounds 6 --threads 2 --refills   # + refills' engine

Same server shapes as benchmarks/serve_throughput.py (--max-batch-size 16, --max-model-len 256, prompt
bucket 32, a random GPT-2 of the shape, converted with hf2ms). The engine runs from this thread
(``Engine.step``) so nothing but the model calls and the engine's host work is timed. Run it as its own
process: it sets the thread variables and MindSpore's runtime threads to --threads before importing MindSpore.
"""
import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
SHAPES = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),
          "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)}
PROMPT = 32


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--refills", action="store_true", help="also a second engine with --max-prefill-tokens 0 "
                        "(a lone prompt's refill call instead of a prefill call), alternating with the others")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import _common as C  # noqa: E402  (imports neither MindSpore nor PyTorch)
    os.environ.update({k: str(args.threads) for k in C.THREAD_VARS})  # this process is the worker
    os.environ.setdefault("GPTLOCAL_LEAN", "1")
    C.check_threads(args.threads, "serve_profile")
    print(C.machine_line(args.threads), flush=True)
    import numpy as np
    work = C.scratch_dir("gptlocal-serve-profile-")
    hf_dir, ms_dir = os.path.join(work, "hf"), os.path.join(work, "ms")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=1024, **SHAPES[args.shape])).save_pretrained(hf_dir)
    hf_to_ms(hf_dir, ms_dir)
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    from mindformers_gptlocal.serve.engine import Engine
    from mindformers_gptlocal.serve.scheduler import Request
    calls = []

    def make_engine(**options):
        engine = Engine(ms_dir, max_batch_size=16, max_model_len=256, prompt_buckets=[PROMPT], **options)
        engine._load()
        loaded = C.rss_mb()
        engine.warm_up()
        engine.ready.set()
        print(f"{options or 'defaults'}: VmRSS after load {loaded:.0f} MB, after warm-up {C.rss_mb():.0f} MB; warm-up "
              f"{engine.warmup_seconds:.1f} s", flush=True)
        step = engine.cache.step

        def timed_step(*a, **k):
            start = time.perf_counter()
            out = step(*a, **k)
            calls.append(("prefill" if a[0].shape[1] > 1 else "step", time.perf_counter() - start))
            return out
        engine.cache.step = timed_step
        return engine
    engine = make_engine()
    refills = make_engine(prefill_tokens=0) if args.refills else None  # --max-prefill-tokens 0
    prompt = np.random.default_rng(0).integers(0, SHAPES[args.shape]["vocab_size"], PROMPT).tolist()

    def serve_one(engine=engine):
        events = []
        engine.submit(Request(prompt, args.new, events.append, temperature=0))
        calls.clear()
        start = time.perf_counter()
        while not events or events[-1][0] != "done":
            engine.step()
        return time.perf_counter() - start, list(calls), [e[2] for e in events if e[0] == "token"]

    results = {"engine, one step per call": [], "model.generate": []}
    if refills is not None:
        results["engine, refills (--max-prefill-tokens 0)"] = []
    for index in range(args.rounds):
        for side in (list(results) if index % 2 == 0 else list(reversed(results))):
            if side == "model.generate":
                start = time.perf_counter()
                out = engine.model.generate([prompt], max_new_tokens=args.new, do_sample=False)
                results[side].append((time.perf_counter() - start, [], out[0][PROMPT:]))
            elif side.startswith("engine, refills"):
                results[side].append(serve_one(refills))
            else:
                results[side].append(serve_one())
    tokens = {tuple(r[2]) for rs in results.values() for r in rs}
    assert len(tokens) == 1, "the sides generated different tokens"
    print(f"\n{args.shape}, {PROMPT}-token prompt, {args.new} new tokens, greedy; median of {args.rounds} rounds "
          f"(alternating)\n")
    print("| side | one request ms | tokens/s | in compiled calls | host ms per call | calls (median ms) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for side, runs in results.items():
        total = C.median([r[0] for r in runs])
        row = f"| {side} | {total * 1e3:.0f} | {args.new / total:.1f} |"
        if runs[0][1]:
            inside = C.median([sum(c[1] for c in r[1]) / r[0] for r in runs])
            host = C.median([(r[0] - sum(c[1] for c in r[1])) / len(r[1]) for r in runs])
            kinds = sorted({c[0] for c in runs[0][1]})
            made = ", ".join(f"{k} x{sum(c[0] == k for c in runs[0][1])} "
                             f"({C.median([c[1] for r in runs for c in r[1] if c[0] == k]) * 1e3:.1f})" for k in kinds)
            row += f" {inside * 100:.0f}% | {host * 1e3:.2f} | {made} |"
        else:
            row += " - | - | - |"
        print(row)


if __name__ == "__main__":
    sys.exit(main())
