"""Where a `gptlocal serve` process's memory goes: VmRSS / VmHWM (and anonymous vs file-backed RSS, glibc's heap,
MindSpore's pool where it reports one) after import, load, the KV cache, each warm-up shape, and a burst of
--clients requests, in one process (the engine driven from this thread, no HTTP).

    python benchmarks/serve_memory.py --shape small --threads 2
    MALLOC_ARENA_MAX=2 python benchmarks/serve_memory.py --shape small     # an environment knob, its own run
    python benchmarks/serve_memory.py --shape small --compare --max-prefill-tokens=0,MALLOC_ARENA_MAX=2,X=0

Same server shapes as benchmarks/serve_throughput.py (--max-batch-size 16, --max-model-len 256, prompt bucket 32,
a random GPT-2 of the shape converted with hf2ms; requests: 32-token random prompts, --new greedy tokens,
``ignore_eos`` as the benchmark's). Memory figures do not depend on the machine's load. ``--compare A=1,B=2``
runs one worker per setting (each its own process, the setting in its environment) and prints one table.
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (imports neither MindSpore nor PyTorch)

SHAPES = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),
          "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)}
PROMPT = 32


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def glibc_mb():
    """glibc malloc: bytes in use, free inside its arenas, in mmap'd chunks (mallinfo2; MB)."""
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    info = libc.mallinfo2()
    return {"malloc_used": info.uordblks / 2**20, "malloc_free": info.fordblks / 2**20,
            "malloc_mmap": info.hblkhd / 2**20}


def pool_mb():
    """MindSpore's own report of its memory pool, where it gives one on this device."""
    try:
        import mindspore as ms
        stats = ms.runtime.memory_stats()
    except Exception:  # noqa: BLE001  (not supported on every device)
        return {}
    return {k: v / 2**20 for k, v in stats.items() if isinstance(v, (int, float)) and "memory" in k}


def snapshot(label, rows):
    row = {"phase": label, **C.status_mb("VmRSS", "VmHWM", "RssAnon", "RssFile"), **glibc_mb(), **pool_mb()}
    rows.append(row)
    print(json.dumps(row), flush=True)


def worker(args):
    os.environ.update({k: str(args.threads) for k in C.THREAD_VARS})
    seen = C.check_threads(args.threads, "serve_memory")
    if args.noop:  # tests/tools/test_benchmarks.py: the threads checked, nothing measured
        C.emit({"env": seen, "runtime_threads": C.mindspore_threads(args.threads, "serve_memory")})
        return
    rows = []
    work = C.scratch_dir("gptlocal-serve-memory-")
    hf_dir, ms_dir = os.path.join(work, "hf"), os.path.join(work, "ms")
    # the model is made in a child so that this process never imports PyTorch
    subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {REPO!r}); import torch; "
                    "from transformers import GPT2Config, GPT2LMHeadModel; "
                    "from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms; torch.manual_seed(0); "
                    f"GPT2LMHeadModel(GPT2Config(n_positions=1024, **{SHAPES[args.shape]!r})).save_pretrained("
                    f"{hf_dir!r}); hf_to_ms({hf_dir!r}, {ms_dir!r})"], check=True, env=C.worker_env(args.threads))
    snapshot("start", rows)
    import numpy as np
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU", runtime_num_threads=args.threads)
    from mindformers_gptlocal.serve.engine import Engine
    from mindformers_gptlocal.serve.scheduler import Request
    snapshot("import", rows)
    batches = [int(b) for b in args.batch_buckets.split(",")] if args.batch_buckets else None
    engine = Engine(ms_dir, max_batch_size=16, max_model_len=256, prompt_buckets=[PROMPT],
                    prefill_tokens=args.max_prefill_tokens, batch_buckets=batches)
    engine._load()
    snapshot("load + cache", rows)
    cache = engine.cache
    step, compile_only = cache.step, cache.compile

    def traced_step(ids, positions, last, slots=None):
        out = step(ids, positions, last, slots)
        if not engine.ready.is_set():
            snapshot(f"warm {ids.shape[0]} x {ids.shape[1]} (run)", rows)
        return out

    def traced_compile(*inputs, **kw):
        out = compile_only(*inputs, **kw)
        if not engine.ready.is_set():  # the shapes warm-up compiles without running them
            snapshot(f"warm {inputs[0].shape[0]} x {inputs[0].shape[1]} (compiled)", rows)
        return out
    cache.step, cache.compile = traced_step, traced_compile
    engine.warm_up()
    engine.ready.set()
    snapshot("ready", rows)
    rng = np.random.default_rng(0)
    for burst in range(args.bursts):
        done = []
        for _ in range(args.clients):
            prompt = rng.integers(0, SHAPES[args.shape]["vocab_size"], PROMPT).tolist()
            engine.submit(Request(prompt, args.new, lambda e, d=done: d.append(e) if e[0] == "done" else None,
                                  temperature=0))
        while len(done) < args.clients:
            engine.step()
        snapshot(f"after burst {burst + 1} ({args.clients} requests)", rows)
    print(C.WORKER_TAG + json.dumps({"rows": rows, "lazy": sorted(engine.lazy),
                                     "scheduler_env": {k: os.environ.get(k) for k in sorted(os.environ)
                                                       if k.startswith(("MALLOC", "ONEDNN", "MS_ALLOC"))}}),
          flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--max-prefill-tokens", type=int, default=None, help="as gptlocal serve's (default its own)")
    parser.add_argument("--batch-buckets", default=None, help="as gptlocal serve's (comma-separated; default its own)")
    parser.add_argument("--compare", help="settings, one worker each, separated by ';' (or ',' where no setting "
                        "holds one); a setting is space-separated VAR=VALUE (an environment variable) or "
                        "--max-prefill-tokens=N / --batch-buckets=1,16 items")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--noop", action="store_true", help="the worker checks its threads and stops (tests)")
    args = parser.parse_args()
    if args.worker or not args.compare:
        return worker(args)
    print(C.machine_line(args.threads), flush=True)
    found = {}
    for setting in args.compare.split(";" if ";" in args.compare else ","):
        flags, env = [], {}
        for item in setting.split():
            key, _, value = item.partition("=")
            if key.startswith("--"):
                flags += [key, value]
            else:
                env[key] = value
        out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "--shape", args.shape,
                              "--new", str(args.new), "--clients", str(args.clients), "--bursts", str(args.bursts),
                              "--threads", str(args.threads), *flags],
                             env=C.worker_env(args.threads, **env), capture_output=True, text=True)
        line = next((x for x in out.stdout.splitlines() if x.startswith(C.WORKER_TAG)), None)
        if line is None:
            raise SystemExit(f"{setting}: worker failed\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
        found[setting] = json.loads(line[len(C.WORKER_TAG):])["rows"]
    phases = [r["phase"] for r in max(found.values(), key=len)]  # the setting with the most compiled shapes
    for rows in found.values():
        ready = phases.index("ready")  # other settings' shapes go before "ready" and the bursts
        phases[ready:ready] = [r["phase"] for r in rows if r["phase"] not in phases]
    print(f"\n{args.shape}: VmRSS / VmHWM MB per phase (RssAnon in brackets; '-': the setting has no such phase)\n")
    print("| phase | " + " | ".join(found) + " |")
    print("| --- |" + " ---: |" * len(found))
    for phase in phases:
        cells = []
        for rows in found.values():
            row = next((r for r in rows if r["phase"] == phase), None)
            cells.append(f"{row['VmRSS']:.0f} / {row['VmHWM']:.0f} ({row['RssAnon']:.0f})" if row else "-")
        print(f"| {phase} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
