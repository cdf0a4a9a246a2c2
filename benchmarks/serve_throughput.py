"""Serving throughput and latency: `gptlocal serve` (continuous batching) against Hugging Face
`transformers` served the simplest honest way (one process, one `generate` call per request, requests
taken one at a time), same random weights (GPT-2, or a Llama-style model: ``--shapes llama``), same prompts, same
machine, same run.

    python benchmarks/serve_throughput.py                          # tiny and GPT-2 small, 1/4/16 clients
    python benchmarks/serve_throughput.py --shapes tiny --clients 1,16 --new 16 --threads 2
    python benchmarks/serve_throughput.py --multi-lora --adapters 4 --requests 2 --new 32 --rounds 5   # multi-LoRA

For each shape a random HF model is saved and converted with `gptlocal convert hf2ms`. Each server is a
subprocess started with an explicit environment (OMP_NUM_THREADS = MKL_NUM_THREADS = OPENBLAS_NUM_THREADS =
--threads; `import mindspore` sets OMP_NUM_THREADS=1 in the C environment, so nothing is inherited); it
checks them in its C environment, sets torch's / MindSpore's thread count to the same and prints them
(benchmarks/_common.py). The servers are started alternately (ours, hf, hf, ours, ...) for --rounds rounds. Clients send 32-token random prompts, greedy, `ignore_eos` (HF:
`min_new_tokens`), --new tokens each, through the OpenAI completions API (httpx). Per level: total
tokens/s = generated tokens / wall time; latency = each request's end-to-end seconds (p50, p99). Each
server gets one warm-up request per level before timing; ours compiles every shape at start-up.

``--multi-lora``: ``gptlocal serve --lora`` with one client per adapter against the same load on a single-adapter
server and on the merged model (plain server, no LoRA), same weights, same run. Sides (the three servers are up at
once and idle while another is measured; rounds alternate multi single merged, merged single multi, ...):
* multi:  --lora a1=.. --lora aK=..; client k sends to adapter ak (every decode step mixes K adapters);
* single: --lora a1=..; all K clients send to a1;
* merged: `gptlocal lora merge` of a1 served plainly; all K clients send to it (no LoRA cost at all).
Base and adapters: random tiny gpt_local (4 layers, hidden 256, vocab 8192), rank --rank on all four Linears, made in
a worker; --requests requests per client, --new tokens each; tokens/s = generated tokens / wall time of the level.
Then (or alone, ``--steps-only``) one worker times a compiled decode step of the plain model against the same model
with the --adapters MultiLoRA Linears, rows on one adapter or one adapter per row rotated every step, sides
alternating in that one process (ms per step: what the HTTP numbers are made of).
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)

SHAPES = {**C.HF_GPT2_SHAPES, **C.HF_LLAMA_SHAPES}  # "llama": GPT-2 small's width and depth, Llama-style layers
PROMPT = 32
LORA_SHAPE = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                  max_position_embeddings=256, seq_length=256, hidden_dropout=0.0, attention_dropout=0.0)
LORA_SMALL = dict(LORA_SHAPE, vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12)
LORA_TARGETS = ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2"


def report_threads(side, threads):
    """First thing in a server process: check the C environment's thread variables, set the framework's; prints
    them and returns {"env": the variables, "runtime_threads": the framework's count}."""
    env = C.check_threads(threads, f"{side} server")
    counts = dict(env)
    if side == "hf":
        counts["torch"] = C.torch_threads(threads, "hf server")
    else:
        counts["mindspore"] = C.mindspore_threads(threads, "ours server")
    print(f"[{side} server] threads: {json.dumps(counts)}", flush=True)
    return {"env": env, "runtime_threads": counts.get("torch", counts.get("mindspore"))}


def setup(work, shape, int8):
    """A child's work: a random HF model of ``shape`` (GPT-2, or a LlamaForCausalLM with an untied head) in
    work/shape, converted to work/shape_ms (hf2ms), and with ``int8`` quantized to work/shape_ms_int8 (``gptlocal
    quantize``)."""
    import torch
    from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms
    torch.manual_seed(0)
    hf_dir, ms_dir = os.path.join(work, shape), os.path.join(work, shape + "_ms")
    C.save_random_hf(shape, hf_dir)
    hf_to_ms(hf_dir, ms_dir)
    if int8:
        from mindformers_gptlocal.quantize import quantize_model
        quantize_model(ms_dir, ms_dir + "_int8", "int8", log=lambda line: None)


def ours_server(model_dir, port, batch, threads, variant=None, loras=(), name="bench"):
    """``variant`` "plain": every shape compiled at start (no --warmup-tokens threshold), as before issue 25
    item 5; "refill": prompts join the decode call
    (--max-prefill-tokens 0, before issue 25 item 4's prefill calls); "wide": the defaults before the lean ones
    (--batch-buckets 1,4,16 --max-prefill-tokens 128: 4 x 32 prefills and a 4-row decode graph); "cached": the
    defaults through a compile-cache folder beside the model (round 1 compiles and stores, later rounds load);
    every other variant runs with --compile-cache off (each start compiles, as a first-ever run). ``loras``:
    ``NAME=DIR`` adapters (``--lora``), served under ``name`` (--multi-lora). ``model_dir`` "-": the threads only."""
    plain = variant == "plain"
    refill = ["--max-prefill-tokens", "0"] if variant in ("refill", "plain") else []
    if variant == "wide":
        refill = ["--batch-buckets", "1,4,16", "--max-prefill-tokens", "128"]
    cache = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "compile-cache") if variant == "cached" else "off"
    report = report_threads("ours", threads)
    if model_dir == "-":  # no model: the threads checked only (tests/tools/test_benchmarks.py)
        return C.emit(report)
    from mindformers_gptlocal.cli.main import main
    return main(["serve", "--model", model_dir, "--port", str(port), "--max-batch-size", str(batch),
                 "--max-model-len", "256", "--prompt-buckets", str(PROMPT), "--served-model-name", name,
                 "--log-level", "warning", "--compile-cache", cache,
                 *(["--warmup-tokens", str(1 << 30)] if plain else []), *refill, *[f"--lora={spec}" for spec in loras]])


def hf_server(model_dir, port, threads):
    """One generate call per request, one request at a time (a lock), on `threads` torch threads."""
    report_threads("hf", threads)
    import asyncio
    import torch
    import uvicorn
    from fastapi import FastAPI, Request
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    app, lock = FastAPI(), asyncio.Lock()

    def generate(ids, new):
        with torch.no_grad():
            tensor = torch.tensor([ids])
            out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=0)
        return out[0, len(ids):].tolist()

    @app.get("/health")
    async def health():
        return {"status": "ready"}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        async with lock:
            tokens = await asyncio.to_thread(generate, body["prompt"], body["max_tokens"])
        return {"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(tokens),
                          "total_tokens": len(body["prompt"]) + len(tokens)}}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def peak_rss_mb(pid):
    """A server process's peak RSS so far (VmHWM from /proc; Linux)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))


def phase_seconds(base):
    """Our server's gptlocal_engine_step_seconds_total by phase (schedule, model, update) from /metrics; {} from a
    server without it (the HF side)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    resp = httpx.get(base + "/metrics", timeout=10)
    if resp.status_code != 200:
        return {}
    return {sample.labels["phase"]: sample.value for family in text_string_to_metric_families(resp.text)
            for sample in family.samples if sample.name == "gptlocal_engine_step_seconds_total"}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(args, threads):
    """This script's server (``args``: --ours-server / --hf-server ...) in a worker process on a free loopback port,
    with the workers' environment; (proc, base url)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args, "--port", str(port)],
                            env=C.worker_env(threads), cwd=tempfile.gettempdir())
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc, base, args, timeout=900):
    """Seconds until the server's ``/health`` says ready."""
    import httpx
    started = time.monotonic()
    while time.monotonic() < started + timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server {args} exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"server {args} not ready in {timeout} s")


def stop(proc):
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def start(args, threads, timeout=900):
    proc, base = launch(args, threads)
    return proc, base, wait_ready(proc, base, args, timeout)


def load(base, clients, per_client, new, vocab, seed):
    """`clients` threads, each sending `per_client` requests in turn; (tokens/s, latencies, tokens)."""
    import httpx
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, vocab, (clients, per_client, PROMPT)).tolist()
    latencies, tokens, errors = [], [0], []
    guard = threading.Lock()

    def client(c):
        with httpx.Client(timeout=600) as http:
            for r in range(per_client):
                start = time.perf_counter()
                resp = http.post(base + "/v1/completions", json={
                    "model": "bench", "prompt": prompts[c][r], "max_tokens": new, "temperature": 0,
                    "ignore_eos": True})
                elapsed = time.perf_counter() - start
                with guard:
                    if resp.status_code != 200:
                        errors.append(resp.text)
                        continue
                    latencies.append(elapsed)
                    tokens[0] += resp.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:2]}")
    assert tokens[0] == clients * per_client * new, tokens
    return tokens[0] / wall, latencies


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--multi-lora", action="store_true", help="the multi-LoRA comparison (module docstring)")
    parser.add_argument("--adapters", type=int, default=4, help="--multi-lora: adapters on the multi server = clients")
    parser.add_argument("--rank", type=int, default=8, help="--multi-lora: the adapters' rank")
    parser.add_argument("--steps-only", action="store_true", help="--multi-lora: only the in-process decode steps")
    parser.add_argument("--step-shape", default="tiny", choices=("tiny", "small"),
                        help="--multi-lora: model of the decode-step comparison (small: GPT-2 small, 12 x 768)")
    parser.add_argument("--make-dirs", nargs=3, metavar=("WORK", "ADAPTERS", "RANK"), help=argparse.SUPPRESS)
    parser.add_argument("--step-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="append", default=[], help=argparse.SUPPRESS)  # a server's NAME=DIR
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16, help="requests per level (at least one per client); "
                        "--multi-lora: per client and round")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads per server process")
    parser.add_argument("--rounds", type=int, default=3, help="server starts per side, alternating (--multi-lora: "
                        "load rounds, the servers up throughout)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--sides", default="ours,hf", help="of ours, ours-plain (every shape compiled at start: "
                        "as before issue 25 item 5), ours-refill (prompts join the "
                        "decode call: --max-prefill-tokens 0), ours-wide (the defaults before the lean ones: batch "
                        "buckets 1,4,16, --max-prefill-tokens 128), ours-cached (the defaults through a compile cache: "
                        "round 1 stores, later rounds load; the others run with --compile-cache off), ours-int8 (the "
                        "same model through `gptlocal quantize --dtype int8`, served with the defaults), hf")
    parser.add_argument("--ours-server", nargs=2, metavar=("DIR", "BATCH"))
    parser.add_argument("--variant", choices=("plain", "refill", "wide", "cached"),
                        help="(with --ours-server) ours-plain / ours-refill / ours-wide / ours-cached")
    parser.add_argument("--hf-server", metavar="DIR")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.ours_server:
        return ours_server(args.ours_server[0], args.port, int(args.ours_server[1]), args.threads, args.variant,
                           args.lora, "base" if args.multi_lora else "bench")
    if args.hf_server:
        return hf_server(args.hf_server, args.port, args.threads)
    if args.make_dirs:
        return make_lora_dirs(args.make_dirs[0], int(args.make_dirs[1]), int(args.make_dirs[2]), args.threads)
    if args.step_worker:
        return step_worker(args.adapters, args.rank, args.threads, args.rounds, args.step_shape)
    C.machine_line(args.threads)  # the load average before any worker runs
    if args.multi_lora:
        return multi_lora(args)

    work = C.scratch_dir("gptlocal-serve-")
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        hf_dir, ms_dir = os.path.join(work, shape), os.path.join(work, shape + "_ms")
        int8 = "ours-int8" in args.sides.split(",")
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); from serve_throughput "
                        f"import setup; setup({work!r}, {shape!r}, {int8!r})"], env=C.worker_env(args.threads),
                       cwd=tempfile.gettempdir(), check=True)

        def serve_round(side, index, shape=shape, hf_dir=hf_dir, ms_dir=ms_dir):
            int8 = side == "ours-int8"
            server_args = (["--ours-server", ms_dir + "_int8" if int8 else ms_dir, str(args.max_batch_size)]
                           + (["--variant", side.split("-")[1]] if "-" in side and not int8 else [])
                           if side.startswith("ours") else ["--hf-server", hf_dir])
            proc, base, ready_s = start(server_args + ["--threads", str(args.threads)], args.threads)
            rss_ready = peak_rss_mb(proc.pid)
            print(f"{shape} {side} round {index + 1}: ready in {ready_s:.1f} s", flush=True)
            found = {"ready_s": ready_s}
            try:
                for clients in levels:
                    per_client = max(1, args.requests // clients)
                    load(base, 1, 1, 4, SHAPES[shape]["vocab_size"], seed=99)  # warm-up
                    before = phase_seconds(base)
                    rate, lat = load(base, clients, per_client, args.new, SHAPES[shape]["vocab_size"], seed=clients)
                    spent = {phase: seconds - before[phase] for phase, seconds in phase_seconds(base).items()}
                    found[clients] = dict(requests=clients * per_client, rate=rate,
                                          p50=float(np.percentile(lat, 50)), p99=float(np.percentile(lat, 99)))
                    print(f"{shape} {side} {clients:2d} clients: {rate:7.1f} tok/s  p50 {found[clients]['p50']:.2f} s  "
                          f"p99 {found[clients]['p99']:.2f} s" + ("  engine steps: " + ", ".join(
                              f"{phase} {100 * seconds / sum(spent.values()):.1f}%" for phase, seconds in spent.items())
                              if spent else ""), flush=True)
                found["rss_ready"] = rss_ready
                found["rss"] = peak_rss_mb(proc.pid)
                print(f"{shape} {side} peak RSS {found['rss']:.0f} MB (at ready {rss_ready:.0f} MB)", flush=True)
            finally:
                stop(proc)
            return found
        runs = C.alternate(tuple(args.sides.split(",")), args.rounds, serve_round)
        for side, found in runs.items():
            for clients in levels:
                rows.append(dict(shape=shape, side=side, clients=clients, requests=found[0][clients]["requests"],
                                 rates=[f[clients]["rate"] for f in found],
                                 p50=C.median([f[clients]["p50"] for f in found]),
                                 p99=C.median([f[clients]["p99"] for f in found]),
                                 rss=C.median([f["rss"] for f in found]),
                                 ready=C.median([f["ready_s"] for f in found])))
    print(f"\n{C.machine_line(args.threads)}")
    print(f"{PROMPT}-token prompts, {args.new} new tokens each, greedy, fp32 (ours-int8: its int8 model); "
          f"ours: --max-batch-size "
          f"{args.max_batch_size}; HF: one generate per request, one at a time; {args.rounds} server starts per side, "
          f"alternating; tokens/s median [min-max], latencies the median of the rounds' p50/p99\n")
    print("| shape | server | clients | requests | tokens/s | vs HF | p50 latency s | p99 latency s | vs own 1-client "
          "| peak RSS MB | RSS vs HF | ready s |")
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        def of(side, clients=None, r=r):
            return next((x for x in rows if x["shape"] == r["shape"] and x["side"] == side
                         and x["clients"] == (clients or r["clients"])), None)
        single, hf = of(r["side"], 1), of("hf")
        ratio = f"{C.median(r['rates']) / C.median(single['rates']):.2f}x" if single else "-"
        vs_hf = f"{C.median(r['rates']) / C.median(hf['rates']):.2f}x" if hf else "-"
        rss_hf = f"{r['rss'] / hf['rss']:.2f}x" if hf else "-"
        server = {"ours": "gptlocal serve", "ours-plain": "gptlocal serve, all shapes at start",
                  "ours-refill": "gptlocal serve, refills (--max-prefill-tokens 0)",
                  "ours-wide": "gptlocal serve, buckets 1,4,16, --max-prefill-tokens 128",
                  "ours-cached": "gptlocal serve, compile cache (round 1 stores, later rounds load)",
                  "ours-int8": "gptlocal serve, int8 model (gptlocal quantize)",
                  }.get(r["side"], "HF generate")
        print(f"| {r['shape']} | {server} | {r['clients']} | "
              f"{r['requests']} | {C.spread(r['rates'], '{:.1f}')} | {vs_hf} | {r['p50']:.2f} | {r['p99']:.2f} | "
              f"{ratio} | {r['rss']:.0f} | {rss_hf} | {r['ready']:.1f} |")
    for r in rows:  # a side against the fp32 server at the same level
        fp32 = next((x for x in rows if x["shape"] == r["shape"] and x["side"] == "ours"
                     and x["clients"] == r["clients"]), None)
        if fp32 and r["side"] not in ("ours", "hf"):
            print(f"{r['shape']} {r['side']} {r['clients']} clients / ours: "
                  f"{C.median(r['rates']) / C.median(fp32['rates']):.2f}x")


# ---------------------------------------------------------------------------------------------- multi-LoRA
def make_lora_dirs(work, adapters, rank, threads):
    """Worker: the base, ``adapters`` LoRA finetune directories (random A/B), and a1 merged."""
    env = C.check_threads(threads, "multi-LoRA setup worker")
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.checkpoint.lora import merge
    from mindformers_gptlocal.peft.lora import is_lora_name
    ms.set_seed(0)
    base = os.path.join(work, "base")
    GPTLocalForCausalLM(GPTLocalConfig(**LORA_SHAPE)).save_pretrained(base)
    rng = np.random.default_rng(0)
    pet = dict(pet_type="lora", lora_rank=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=LORA_TARGETS,
               freeze_include=["*"], freeze_exclude=["*lora*"])
    for k in range(1, adapters + 1):
        model = GPTLocalForCausalLM(GPTLocalConfig(**dict(LORA_SHAPE, pet_config=pet)))
        model.load_weights(base)
        for param in model.get_parameters():
            if is_lora_name(param.name):
                param.set_data(ms.Tensor(rng.normal(0, 0.05, param.shape).astype(np.float32)))
        model.save_pretrained(os.path.join(work, f"a{k}"))
    merge(base, os.path.join(work, "a1"), os.path.join(work, "a1-merged"))
    C.emit({"env": env})


def step_worker(adapters, rank, threads, rounds, shape, steps=30):
    """Worker: one compiled decode step (batch = ``adapters``) of the plain model against the same model with
    ``adapters`` MultiLoRA adapters, rows all on adapter 1 ("const") or one adapter each, rotated every step
    ("mixed", a new index each call); sides alternate within this one process. ms per step."""
    counts = C.check_threads(threads, "step worker")
    counts["mindspore"] = C.mindspore_threads(threads, "step worker")
    import mindspore as ms
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    from mindformers_gptlocal.model.lora_cells import MultiLoRASpec
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    caches, handles = {}, {}
    config = LORA_SMALL if shape == "small" else LORA_SHAPE
    for side in ("plain", "lora"):
        spec = None
        if side == "lora":
            hidden, inner = config["hidden_size"], 4 * config["hidden_size"]
            dims = {"attention.linear_qkv": (3 * hidden, hidden), "attention.linear_proj": (hidden, hidden),
                    "mlp.linear_fc1": (inner, hidden), "mlp.linear_fc2": (hidden, inner)}
            pairs = [{f"model.layers.{layer}.{linear}": (rng.normal(0, 0.05, (rank, n)).astype(np.float32),
                                                         rng.normal(0, 0.05, (o, rank)).astype(np.float32))
                      for layer in range(config["num_hidden_layers"]) for linear, (o, n) in dims.items()}
                     for _ in range(adapters)]
            spec = MultiLoRASpec([(f"a{k}", p, 2.0) for k, p in enumerate(pairs, 1)], adapters)
            handles["lora"] = spec.handle
        model = GPTLocalForCausalLM(GPTLocalConfig(**config), layer_spec=spec)
        model.set_train(False)
        caches[side] = model.kv_cache(adapters, 256)
    ids, pos, last = (np.zeros((adapters, 1), np.int32), np.full((adapters, 1), 5, np.int32),
                      np.zeros(adapters, np.int32))
    for cache in caches.values():
        cache.step(ids, pos, last)  # compile

    def measure(side, _index):
        cache, handle = caches[side.split("-")[0]], handles.get(side.split("-")[0])
        start = time.perf_counter()
        for step in range(steps):
            if handle is not None:
                handle.select([1] * adapters if side == "lora-const" else
                              list(np.roll(np.arange(1, adapters + 1), step)))
            cache.step(ids, pos, last)
        return (time.perf_counter() - start) / steps * 1e3
    C.emit({"env": counts, "ms": C.alternate(("plain", "lora-const", "lora-mixed"), rounds, measure)})


def lora_load(base, models, per_client, new, seed):
    """One client thread per entry of ``models`` (the model it sends to), ``per_client`` requests each; tokens/s."""
    import httpx
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, LORA_SHAPE["vocab_size"], (len(models), per_client, PROMPT)).tolist()
    tokens, errors, guard = [0], [], threading.Lock()

    def client(c):
        with httpx.Client(timeout=600) as http:
            for r in range(per_client):
                resp = http.post(base + "/v1/completions", json={"model": models[c], "prompt": prompts[c][r],
                                                                 "max_tokens": new, "temperature": 0,
                                                                 "ignore_eos": True})
                with guard:
                    if resp.status_code != 200:
                        errors.append(resp.text)
                    else:
                        tokens[0] += resp.json()["usage"]["completion_tokens"]

    threads = [threading.Thread(target=client, args=(c,)) for c in range(len(models))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed: {errors[:2]}")
    return tokens[0] / wall


def multi_lora(args):
    if args.steps_only:
        return print_steps(args)
    work = C.scratch_dir("gptlocal-multilora-")
    C.run_worker(__file__, ["--make-dirs", work, str(args.adapters), str(args.rank), "--threads", str(args.threads)],
                 args.threads)
    names = [f"a{k}" for k in range(1, args.adapters + 1)]
    specs = {"multi": (os.path.join(work, "base"), [f"{n}={os.path.join(work, n)}" for n in names], names),
             "single": (os.path.join(work, "base"), [f"a1={os.path.join(work, 'a1')}"], ["a1"] * args.adapters),
             "merged": (os.path.join(work, "a1-merged"), [], ["base"] * args.adapters)}
    servers = {}
    try:
        for side, (model_dir, loras, _) in specs.items():  # started together, measured one at a time
            servers[side] = launch(["--ours-server", model_dir, str(args.adapters), "--multi-lora",
                                    *[f"--lora={spec}" for spec in loras], "--threads", str(args.threads)],
                                   args.threads)
        for side, (proc, base) in servers.items():
            print(f"{side}: ready after {wait_ready(proc, base, side, timeout=1800):.1f} s", flush=True)
        for side, (_, base) in servers.items():  # warm-up
            lora_load(base, specs[side][2], 1, 4, seed=99)

        def measure(side, index):
            rate = lora_load(servers[side][1], specs[side][2], args.requests, args.new, seed=index)
            print(f"round {index + 1} {side}: {rate:.1f} tok/s", flush=True)
            return rate
        rates = C.alternate(tuple(specs), args.rounds, measure)
    finally:
        for proc, _ in servers.values():
            stop(proc)
    print(f"\n{C.machine_line(args.threads)}")
    print(f"tiny gpt_local (4 x 256, vocab 8192), rank {args.rank} on 4 Linears; {args.adapters} clients x "
          f"{args.requests} requests, {PROMPT}-token prompts, {args.new} new tokens, greedy, fp32, "
          f"--max-batch-size {args.adapters}; {args.rounds} rounds alternating; tokens/s median [min-max]\n")
    print("| server | clients send to | tokens/s | vs single adapter |")
    print("| --- | --- | ---: | ---: |")
    single = C.median(rates["single"])
    what = {"multi": f"{args.adapters} adapters, one each", "single": "one adapter (a1)",
            "merged": "a1 merged (no LoRA)"}
    for side in specs:
        print(f"| {side} | {what[side]} | {C.spread(rates[side], '{:.1f}')} | {C.median(rates[side]) / single:.2f}x |")
    return print_steps(args)


def print_steps(args):
    report, _ = C.run_worker(__file__, ["--step-worker", "--adapters", str(args.adapters), "--rank", str(args.rank),
                                        "--rounds", str(args.rounds), "--step-shape", args.step_shape, "--threads",
                                        str(args.threads)], args.threads)
    ms_ = report["ms"]
    plain = C.median(ms_["plain"])
    print(f"\none compiled decode step of the {args.step_shape} model, batch {args.adapters}, in one process, sides "
          f"alternating, {args.rounds} rounds of 30 steps; {C.machine_line(args.threads).split(';')[0]}\n")
    print("| model | rows use | ms per step | vs plain |")
    print("| --- | --- | ---: | ---: |")
    for side, what in (("plain", "no LoRA"), ("lora-const", f"{args.adapters} adapters loaded, all rows adapter 1"),
                       ("lora-mixed", "one adapter per row, rotated every step")):
        print(f"| {side} | {what} | {C.spread(ms_[side], '{:.1f}')} | {C.median(ms_[side]) / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
