"""Where the bytes go, one part at a time:

    python benchmarks/memory.py convert [--size medium|small|large]
    python benchmarks/memory.py serve --shape small --threads 2
    python benchmarks/memory.py serve --shape small --compare "--max-prefill-tokens=0;MALLOC_ARENA_MAX=2"
    python benchmarks/memory.py rss-fit fit benchmarks/cpu_rss_runs.jsonl --held-out small_v8192
    python benchmarks/memory.py rss-fit measure --optimizer GPTLocalAdamW --out rss.jsonl [--shapes tiny_b4 ...]
    python benchmarks/memory.py soak [--steps 3000 --save-every 200 --keep-checkpoints 3]

Parts:
  convert  peak RSS of ``gptlocal convert hf2ms`` and ``ms2hf`` on a GPT-2-shaped checkpoint (random weights; medium by
           default): conversion streams tensor by tensor, so its peak should stay near the imports' own plus the
           largest tensor, far below the checkpoint. Each conversion (and the imports alone) in its own worker.
  serve    a ``gptlocal serve`` engine's memory phase by phase in one worker (driven from its thread, no HTTP):
           VmRSS / VmHWM, anonymous and file-backed RSS, glibc's heap and MindSpore's pool where it reports one, after
           import, load, the KV cache, each warm-up shape and each burst of ``--clients`` requests. The shapes of
           ``serve_throughput.py`` (--max-batch-size 16, --max-model-len 256, prompt bucket 32, a random GPT-2 through
           hf2ms; 32-token prompts, ``--new`` greedy tokens). ``--compare "A;B"``: one worker per setting, each a list
           of VAR=VALUE (its environment) or --max-prefill-tokens=N / --batch-buckets=1,16 items, one table.
  rss-fit  the CPU terms of the training planner (``plan/memory.py``): ``measure`` runs short ``gptlocal run``
           trainings of the tiny YAML resized to each shape (``--steps`` steps, each in its own worker; peak RSS =
           its VmHWM) and appends rows to ``--out``; ``fit`` solves peak = runtime + state_factor[optimizer] *
           (weights + grads + moments) + activation_factor * (activations - head) + head_factor * head activations by
           least squares and reports every row (``--held-out`` rows left out of the fit).
           ``benchmarks/cpu_rss_runs.jsonl`` holds the runs behind plan/memory.py's constants.
  soak     a long training run (the tiny YAML, ``--steps`` steps, a checkpoint every ``--save-every`` kept
           ``--keep-checkpoints``) in one worker: its VmRSS and the checkpoint folder sampled at each save; RSS after
           the last step within 5% of RSS after step 500 (or 1/6 of the run) means no growth; the folder bounded by
           keep + 1 checkpoints; and SHA-256's cost per GB on this CPU (the manifest's checksum).

Every worker is started with ``_common.worker_env`` (OMP/MKL/OpenBLAS threads = ``--threads``) and calls
``_common.check_threads`` first; memory figures do not depend on the machine's load. This process imports neither
MindSpore nor PyTorch.
"""
import argparse
import ctypes
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package; it imports neither MindSpore nor PyTorch)

GPT2 = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),
        "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257),
        "medium": dict(n_layer=24, n_embd=1024, n_head=16, vocab_size=50257),
        "large": dict(n_layer=36, n_embd=1280, n_head=20, vocab_size=50257)}
PROMPT = 32


def child(code, threads, *argv):
    """Run ``python -c code argv`` with the workers' environment (so this process imports neither framework); its
    last ``RESULT`` line's JSON."""
    out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, check=False,
                         env=C.worker_env(threads), cwd=tempfile.gettempdir())
    lines = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"a setup step failed (exit {out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def make_gpt2(shape, out, threads, ms_dir=None):
    """A random HF GPT-2 of ``shape`` saved in ``out`` (and converted with hf2ms into ``ms_dir``), in a child."""
    code = ("import json, sys, torch; from transformers import GPT2Config, GPT2LMHeadModel; torch.manual_seed(0); "
            "shape, out, ms_dir = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]; "
            "GPT2LMHeadModel(GPT2Config(n_positions=1024, **shape)).save_pretrained(out); "
            "from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms; ms_dir and hf_to_ms(out, ms_dir); "
            "print('RESULT {}')")
    child(code, threads, json.dumps(GPT2[shape]), out, ms_dir or "")


def prepare_data(out, seq, vocab, max_bytes, eval_fraction, threads):
    """``gptlocal prepare-data``'s corpus in ``out`` (``data.prepare.prepare``), in a child; its result dict."""
    code = ("import json, sys; from mindformers_gptlocal.data.prepare import prepare; "
            "a = json.loads(sys.argv[1]); print('RESULT ' + json.dumps(prepare(**a), default=str))")
    return child(code, threads, json.dumps(dict(out=out, seq_length=seq, vocab_size=vocab, max_bytes=max_bytes,
                                                eval_fraction=eval_fraction)))


# ---------------------------------------------------------------------------------------------- convert
def convert_worker(args):
    """Worker: ``gptlocal convert`` (``--what`` hf2ms / ms2hf: SRC OUT) in this process, or the imports alone
    (``imports``); emits its VmHWM."""
    env = C.check_threads(args.threads, "convert worker")
    what, paths = args.what[0], args.what[1:]
    started = time.perf_counter()
    if what == "imports":
        import numpy  # noqa: F401  pylint: disable=unused-import
        import safetensors  # noqa: F401  pylint: disable=unused-import
        import mindformers_gptlocal.checkpoint.hf_gpt2  # noqa: F401  pylint: disable=unused-import
    elif what != "noop":
        from mindformers_gptlocal.cli.main import main as cli
        flag = "--hf-dir" if what == "hf2ms" else "--ms-dir"
        code = cli(["convert", what, flag, paths[0], "--out", paths[1]])
        if code:
            raise SystemExit(f"gptlocal convert {what} exited {code}")
    C.emit({"env": env, "seconds": time.perf_counter() - started,
            "peak_rss_mb": C.vm_hwm_mb()})


def convert_main(args):
    work = C.scratch_dir("gptlocal-convert-")
    hf_dir, ms_dir, back = (os.path.join(work, name) for name in ("hf", "ms", "back"))
    make_gpt2(args.size, hf_dir, args.threads)
    size_mb = os.path.getsize(os.path.join(hf_dir, "model.safetensors")) / 2 ** 20

    def run(*what):
        return C.run_worker(__file__, ["convert", "--what", *what, "--threads", str(args.threads)], args.threads)[0]
    baseline, to_ms = run("imports"), run("hf2ms", hf_dir, ms_dir)
    to_hf = run("ms2hf", ms_dir, back)
    print(f"GPT-2 {args.size} checkpoint: {size_mb:,.0f} MB safetensors")
    print(f"interpreter + imports alone: peak RSS {baseline['peak_rss_mb']:,.0f} MB")
    for name, r in (("hf2ms", to_ms), ("ms2hf", to_hf)):
        peak = r["peak_rss_mb"]
        print(f"{name}: {r['seconds']:.1f} s, peak RSS {peak:,.0f} MB ({peak / size_mb:.2f}x checkpoint, "
              f"{peak - baseline['peak_rss_mb']:,.0f} MB above imports)")


# ---------------------------------------------------------------------------------------------- serve
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


def serve_worker(args):
    """Worker: the engine's memory phase by phase (module docstring); ``--noop``: the threads checked only."""
    seen = C.check_threads(args.threads, "serve memory worker")
    if args.noop:
        return C.emit({"env": seen, "runtime_threads": C.mindspore_threads(args.threads, "serve memory worker")})
    rows = []
    snapshot("start", rows)
    import numpy as np
    import mindspore as ms
    C.mindspore_threads(args.threads, "serve memory worker")
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    from mindformers_gptlocal.serve.engine import Engine
    from mindformers_gptlocal.serve.scheduler import Request
    snapshot("import", rows)
    batches = [int(b) for b in args.batch_buckets.split(",")] if args.batch_buckets else None
    engine = Engine(args.model, max_batch_size=16, max_model_len=256, prompt_buckets=[PROMPT],
                    prefill_tokens=args.max_prefill_tokens, batch_buckets=batches)
    engine._load()  # noqa: SLF001  pylint: disable=protected-access  (the load alone, before the warm-up)
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
            prompt = rng.integers(0, GPT2[args.shape]["vocab_size"], PROMPT).tolist()
            engine.submit(Request(prompt, args.new, lambda e, d=done: d.append(e) if e[0] == "done" else None,
                                  temperature=0))
        while len(done) < args.clients:
            engine.step()
        snapshot(f"after burst {burst + 1} ({args.clients} requests)", rows)
    return C.emit({"env": seen, "rows": rows, "lazy": sorted(engine.lazy)})


def serve_main(args):
    work = C.scratch_dir("gptlocal-serve-memory-")
    model = os.path.join(work, "ms")
    make_gpt2(args.shape, os.path.join(work, "hf"), args.threads, model)
    found = {}
    settings = (args.compare.split(";" if ";" in args.compare else ",") if args.compare else ["defaults"])
    for setting in settings:
        flags, env = [], {}
        for item in setting.split() if setting != "defaults" else ():
            key, _, value = item.partition("=")
            if key.startswith("--"):
                flags += [key, value]
            else:
                env[key] = value
        report, _ = C.run_worker(__file__, ["serve", "--worker", "--model", model, "--shape", args.shape, "--new",
                                            str(args.new), "--clients", str(args.clients), "--bursts",
                                            str(args.bursts), "--threads", str(args.threads), *flags],
                                 args.threads, **env)
        found[setting] = report["rows"]
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


# ---------------------------------------------------------------------------------------------- rss-fit
SMALL = dict(vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             max_position_embeddings=1024)
FIT_SHAPES = {  # name: (model_config changes, batch); seq 256 everywhere
    "l2h64_v512_b4": (dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4), 4),
    "tiny_b4": ({}, 4),
    "tiny_b8": ({}, 8),
    "small_b2": (SMALL, 2),
    "small_b1": (SMALL, 1),
    "small_v8192": (dict(SMALL, vocab_size=8192), 2),
    # extra shapes that move the [tokens, vocab] head buffers apart from the layers' activations
    "tiny_v50257_b4": (dict(vocab_size=50257), 4),
    "small_v8192_b4": (dict(SMALL, vocab_size=8192), 4),
}


def base_config(name):
    from mindformers_gptlocal import yaml_io
    config = yaml_io.load_yaml(os.path.join(REPO, "model_configs", "pretrain_gpt_local_tiny_cpu.yaml"))
    config["model"]["model_config"].update(FIT_SHAPES[name][0])
    return config


def head_bytes(name):
    from mindformers_gptlocal.plan import memory as mem
    s = mem.shape_of(dict(base_config(name)["model"]["model_config"]))
    return mem.head_activation_bytes(s, FIT_SHAPES[name][1])


def fit_yaml(name, optimizer, steps, corpus, workdir):
    from mindformers_gptlocal import yaml_io
    batch = FIT_SHAPES[name][1]
    config = base_config(name)
    config["optimizer"]["type"] = optimizer
    config["runner_config"]["batch_size"] = config["train_dataset"]["batch_size"] = batch
    config["train_dataset"]["data_loader"].update(dataset_dir=corpus["train_mindrecord"], shuffle=False,
                                                  num_samples=steps * batch)
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    config["callbacks"] = [{"type": "GPTLocalThroughputMonitor", "per_print_times": 1}]
    config["output_dir"] = os.path.join(workdir, "output")
    return yaml_io.dump_yaml(config, os.path.join(workdir, "run.yaml"))


def terms(path):
    """(state bytes, activation bytes, planner estimate) of a run YAML."""
    from mindformers_gptlocal import yaml_io
    from mindformers_gptlocal.plan.report import plan
    result = plan(yaml_io.load_yaml(path))
    st = result["stages"][0]
    return (st["weights_bytes"] + st["grads_bytes"] + st["optimizer_bytes"], st["activation_bytes"],
            result["cpu_peak_rss_bytes"])


def rss_measure(args):
    root = C.scratch_dir("gptlocal-rssfit-")
    corpus = prepare_data(os.path.join(root, "data"), 256, 512, 150_000, 0.05, args.threads)
    for name in args.shapes:
        workdir = tempfile.mkdtemp(prefix=name + "_", dir=root)
        path = fit_yaml(name, args.optimizer, args.steps, corpus, workdir)
        state, act, estimate = terms(path)
        report, text = C.run_worker(__file__, ["train-worker", path, "--threads", str(args.threads)], args.threads,
                                    timeout=1800, one_line=True)
        found = re.search(r"\[gptlocal\] training done: .* peak RSS ([0-9,]+) MB", text)  # its VmHWM at the end
        if "failed" in report or report["code"] or not found:
            print(f"{name}: run failed: {report.get('failed') or report.get('code') or text[-2000:]}", file=sys.stderr)
            continue
        row = dict(shape=name, optimizer=args.optimizer, steps=args.steps,
                   peak_mb=float(found.group(1).replace(",", "")),
                   state_bytes=state, activation_bytes=act, estimate_mb=estimate / 2 ** 20)
        print(json.dumps(row), flush=True)
        with open(args.out, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(row) + "\n")


def rss_fit(args):
    import numpy as np
    rows = []
    for path in args.files:
        with open(path, encoding="utf-8") as handle:
            rows += [json.loads(line) for line in handle if line.strip()]
    held = [r for r in rows if r["shape"] in args.held_out or f"{r['shape']}:{r['optimizer']}" in args.held_out]
    train = [r for r in rows if r not in held]
    opts = sorted({r["optimizer"] for r in rows})
    mb = 2 ** 20

    def design(r):
        head = head_bytes(r["shape"])
        return [1.0] + [r["state_bytes"] / mb if r["optimizer"] == o else 0.0 for o in opts] + \
            [(r["activation_bytes"] - head) / mb, head / mb]
    coef, *_ = np.linalg.lstsq(np.array([design(r) for r in train]), np.array([r["peak_mb"] for r in train]),
                               rcond=None)
    print("runtime %.0f MB, state factors %s, activation factor %.3f, head factor %.3f" %
          (coef[0], {o: round(float(c), 3) for o, c in zip(opts, coef[1:-2])}, coef[-2], coef[-1]))
    for r in rows:
        fitted = float(np.dot(design(r), coef))
        print(f"{r['shape']:14s} {r['optimizer']:14s} measured {r['peak_mb']:7,.0f} fitted {fitted:7,.0f} "
              f"ratio {fitted / r['peak_mb']:.3f}  estimate when measured {r['estimate_mb']:7,.0f}"
              f"{'  (held out)' if r in held else ''}")


# ---------------------------------------------------------------------------------------------- soak
def status_mb(pid, field):
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith(field + ":"))


def folder_mb(path):
    total = 0
    for root, _, names in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, n)) for n in names if os.path.exists(os.path.join(root, n)))
    return total / 1e6


def sha256_seconds_per_gb(megabytes=512):
    block = os.urandom(1 << 20)
    digest = hashlib.sha256()
    start = time.perf_counter()
    for _ in range(megabytes):
        digest.update(block)
    return (time.perf_counter() - start) / (megabytes / 1024)


def soak_yaml(args, work, data):
    from mindformers_gptlocal import yaml_io
    config = yaml_io.load_yaml(os.path.join(REPO, "model_configs", "pretrain_gpt_local_tiny_cpu.yaml"))
    if args.size == "test":
        config["model"]["model_config"].update(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, seq_length=64, max_position_embeddings=64)
    config["context"]["runtime_num_threads"] = args.threads
    config["output_dir"] = os.path.join(work, "output")
    config["train_dataset"]["data_loader"]["dataset_dir"] = data["train_mindrecord"]
    config["runner_config"]["epochs"] = 10_000  # stopped by stop_step
    config["runner_config"]["stop_step"] = args.steps
    for key in ("eval_dataset", "eval_dataset_task"):
        config.pop(key, None)
    config["do_eval"] = False
    if "train_dataset_task" in config:
        config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    callbacks = []
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = args.save_every
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback.update(save_checkpoint_steps=args.save_every, keep_checkpoint_max=args.keep_checkpoints)
        if callback["type"] != "GPTLocalSaveModelDir":
            callbacks.append(callback)
    config["callbacks"] = callbacks
    return yaml_io.dump_yaml(config, os.path.join(work, "soak.yaml"))


def soak_main(args):
    work = C.scratch_dir("gptlocal-soak-")
    seq, vocab = (256, 8192) if args.size == "yaml" else (64, 512)
    data = prepare_data(os.path.join(work, "data"), seq, vocab, 2_000_000, 0.02, args.threads)
    yaml_path = soak_yaml(args, work, data)
    print(f"soak: {args.steps} steps of the {args.size} tiny model, save every {args.save_every}, keep "
          f"{args.keep_checkpoints}; {work}", flush=True)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "train-worker", yaml_path, "--threads",
                             str(args.threads)], cwd=work, env=C.worker_env(args.threads), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    samples, tail, start = [], [], time.time()
    ckpt_dir = os.path.join(work, "output", "checkpoint")

    def read():
        for line in proc.stdout:
            tail.append(line)
            del tail[:-50]
            found = re.search(r"\[gptlocal\] step (\d+)/\d+", line)
            if found and int(found.group(1)) % args.save_every == 0:
                samples.append(dict(step=int(found.group(1)), rss_mb=status_mb(proc.pid, "VmRSS"),
                                    ckpt_mb=folder_mb(ckpt_dir), seconds=time.time() - start))
                print(f"step {samples[-1]['step']:>6}  RSS {samples[-1]['rss_mb']:8.1f} MB  checkpoint folder "
                      f"{samples[-1]['ckpt_mb']:7.1f} MB  {samples[-1]['seconds']:7.1f} s", flush=True)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join(timeout=10)
    if code != 0 or not samples:
        print("".join(tail), file=sys.stderr)
        raise SystemExit(f"soak: the run failed (exit {code})")
    early_step = 500 if args.steps >= 1000 else args.steps // 6
    early = next(s for s in samples if s["step"] >= early_step)
    last = samples[-1]
    growth = last["rss_mb"] / early["rss_mb"] - 1
    from mindformers_gptlocal.checkpoint import manifest
    entries = manifest.read_manifest(ckpt_dir)
    one = max(e["bytes"] for e in entries) / 1e6 if entries else 0.0
    bound = (args.keep_checkpoints + 1) * one + 1.0  # keep files, one more during a save, manifest/meta
    biggest = max(s["ckpt_mb"] for s in samples)
    per_gb = sha256_seconds_per_gb()
    result = dict(steps=last["step"], early_step=early["step"], rss_early_mb=round(early["rss_mb"], 1),
                  rss_last_mb=round(last["rss_mb"], 1), rss_growth_pct=round(100 * growth, 2),
                  rss_ok=abs(growth) <= 0.05, checkpoint_mb=round(one, 2), folder_max_mb=round(biggest, 2),
                  folder_bound_mb=round(bound, 2), folder_ok=biggest <= bound,
                  files_kept=len(entries), sha256_s_per_gb=round(per_gb, 2), seconds=round(last["seconds"], 1))
    print(f"RSS after step {early['step']}: {early['rss_mb']:.1f} MB; after step {last['step']}: "
          f"{last['rss_mb']:.1f} MB ({100 * growth:+.2f}%: {'no growth' if result['rss_ok'] else 'GROWS'}, "
          f"limit 5%)")
    print(f"checkpoint folder at most {biggest:.1f} MB (bound {bound:.1f} MB = {args.keep_checkpoints}+1 checkpoints "
          f"of {one:.2f} MB + 1 MB): {'bounded' if result['folder_ok'] else 'NOT BOUNDED'}; manifest lists "
          f"{len(entries)} files")
    print(f"SHA-256 on this CPU: {per_gb:.2f} s per GB of checkpoint (GPTLocalCheckpointMonitor checksum: "
          f"sha256, the default; checksum: size skips it)")
    print(json.dumps(result))


# ---------------------------------------------------------------------------------------------- main
def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parts = parser.add_subparsers(dest="part", required=True)
    sub = {name: parts.add_parser(name) for name in ("convert", "serve", "rss-fit", "soak", "train-worker")}
    for part in sub.values():
        part.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    part = sub["convert"]
    part.add_argument("--size", default="medium", choices=("small", "medium", "large"))
    part.add_argument("--what", nargs="+", help=argparse.SUPPRESS)  # a worker: hf2ms|ms2hf SRC OUT, imports, noop
    part = sub["serve"]
    part.add_argument("--shape", default="small", choices=("tiny", "small"))
    part.add_argument("--new", type=int, default=16)
    part.add_argument("--clients", type=int, default=16)
    part.add_argument("--bursts", type=int, default=2)
    part.add_argument("--max-prefill-tokens", type=int, default=None, help="as gptlocal serve's (default its own)")
    part.add_argument("--batch-buckets", default=None, help="as gptlocal serve's (comma-separated; default its own)")
    part.add_argument("--compare", help="settings, one worker each, separated by ';' (or ',' where no setting holds "
                      "one); a setting is space-separated VAR=VALUE (an environment variable) or "
                      "--max-prefill-tokens=N / --batch-buckets=1,16 items")
    part.add_argument("--model", help=argparse.SUPPRESS)  # a worker's model directory
    part.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    part.add_argument("--noop", action="store_true", help=argparse.SUPPRESS)  # the worker checks its threads, stops
    part = sub["rss-fit"]
    part.add_argument("action", choices=("measure", "fit"))
    part.add_argument("files", nargs="*", help="fit: JSONL files of measured runs")
    part.add_argument("--held-out", nargs="*", default=[], help="fit: shapes (or shape:optimizer rows) left out")
    part.add_argument("--optimizer", default="GPTLocalAdamW", help="measure: the YAML's optimizer type")
    part.add_argument("--shapes", nargs="+", default=list(FIT_SHAPES), choices=list(FIT_SHAPES))
    part.add_argument("--steps", type=int, default=3)
    part.add_argument("--out", help="measure: append the rows here")
    part = sub["soak"]
    part.add_argument("--steps", type=int, default=3000)
    part.add_argument("--save-every", type=int, default=200)
    part.add_argument("--keep-checkpoints", type=int, default=3, help="keep_checkpoint_max")
    part.add_argument("--size", choices=("yaml", "test"), default="yaml",
                      help="yaml: the tiny YAML's model (4 x 256, seq 256, batch 4); test: the test suite's "
                           "(2 x 64, seq 64, batch 4), ~10x faster per step")
    sub["train-worker"].add_argument("yaml", help="a worker: gptlocal run on this YAML (rss-fit measure, soak)")
    args = parser.parse_args(argv)
    if args.part == "rss-fit" and (args.action == "fit") != bool(args.files) or \
            args.part == "rss-fit" and args.action == "measure" and not args.out:
        parser.error("rss-fit fit takes the JSONL files of measured runs; rss-fit measure takes --out FILE")
    return args


def main(argv=None):
    args = parse(sys.argv[1:] if argv is None else argv)
    if args.part == "train-worker":
        return C.ms_train_worker(args.yaml, args.threads)
    if args.part == "convert" and args.what:
        return convert_worker(args)
    if args.part == "serve" and (args.worker or args.noop):
        return serve_worker(args)
    if args.part == "rss-fit" and args.action == "fit":
        return rss_fit(args)
    print(C.machine_line(args.threads), flush=True)
    return {"convert": convert_main, "serve": serve_main, "rss-fit": rss_measure, "soak": soak_main}[args.part](args)


if __name__ == "__main__":
    sys.exit(main())
