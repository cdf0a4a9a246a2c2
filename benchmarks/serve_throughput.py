"""Serving throughput and latency: `gptlocal serve` (continuous batching) against Hugging Face
`transformers` served the simplest honest way (one process, one `generate` call per request, requests
taken one at a time), same random GPT-2 weights, same prompts, same machine, same run.

    python benchmarks/serve_throughput.py                          # tiny and GPT-2 small, 1/4/16 clients
    python benchmarks/serve_throughput.py --shapes tiny --clients 1,16 --new 16 --threads 2

For each shape a random HF GPT-2 is saved and converted with `gptlocal convert hf2ms`. Each server is a
subprocess started with an explicit environment (OMP_NUM_THREADS = MKL_NUM_THREADS = OPENBLAS_NUM_THREADS =
--threads; `import mindspore` sets OMP_NUM_THREADS=1 in the C environment, so nothing is inherited); it
checks them in its C environment, sets torch's / MindSpore's thread count to the same and prints them
(benchmarks/_common.py). The servers are started alternately (ours, hf, hf, ours, ...) for --rounds rounds. Clients send 32-token random prompts, greedy, `ignore_eos` (HF:
`min_new_tokens`), --new tokens each, through the OpenAI completions API (httpx). Per level: total
tokens/s = generated tokens / wall time; latency = each request's end-to-end seconds (p50, p99). Each
server gets one warm-up request per level before timing; ours compiles every shape at start-up.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)

SHAPES = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),
          "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)}
PROMPT = 32


def report_threads(side, threads):
    """First thing in a server process: check the C environment's thread variables, set the framework's."""
    counts = C.check_threads(threads, f"{side} server")
    if side == "hf":
        counts["torch"] = C.torch_threads(threads, "hf server")
    else:
        counts["mindspore"] = C.mindspore_threads(threads, "ours server")
    print(f"[{side} server] threads: {json.dumps(counts)}", flush=True)


def ours_server(model_dir, port, batch, threads, variant=None):
    """``variant`` "plain": every shape compiled at start (no --warmup-tokens threshold), as before issue 25
    item 5; "refill": prompts join the decode call
    (--max-prefill-tokens 0, before issue 25 item 4's prefill calls); "wide": the defaults before the lean ones
    (--batch-buckets 1,4,16 --max-prefill-tokens 128: 4 x 32 prefills and a 4-row decode graph); "cached": the
    defaults through a compile-cache folder beside the model (round 1 compiles and stores, later rounds load);
    every other variant runs with --compile-cache off (each start compiles, as a first-ever run)."""
    plain = variant == "plain"
    refill = ["--max-prefill-tokens", "0"] if variant in ("refill", "plain") else []
    if variant == "wide":
        refill = ["--batch-buckets", "1,4,16", "--max-prefill-tokens", "128"]
    cache = os.path.join(os.path.dirname(os.path.abspath(model_dir)), "compile-cache") if variant == "cached" else "off"
    report_threads("ours", threads)
    from mindformers_gptlocal.cli.main import main
    return main(["serve", "--model", model_dir, "--port", str(port), "--max-batch-size", str(batch),
                 "--max-model-len", "256", "--prompt-buckets", str(PROMPT), "--served-model-name", "bench",
                 "--log-level", "warning", "--compile-cache", cache, *(["--warmup-tokens", str(1 << 30)] if plain else []), *refill])


def hf_server(model_dir, port, threads):
    """One generate call per request, one request at a time (a lock), on `threads` torch threads."""
    report_threads("hf", threads)
    import asyncio
    import torch
    import uvicorn
    from fastapi import FastAPI, Request
    from transformers import GPT2LMHeadModel
    model = GPT2LMHeadModel.from_pretrained(model_dir).eval()
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


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(args, threads, timeout=900):
    import httpx
    port = free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args, "--port", str(port)],
                            env=C.worker_env(threads))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    started = time.monotonic()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server {args} exited with {proc.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server {args} not ready in {timeout} s")


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
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--requests", type=int, default=16, help="requests per level (at least one per client)")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads per server process")
    parser.add_argument("--rounds", type=int, default=3, help="server starts per side, alternating")
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
        return ours_server(args.ours_server[0], args.port, int(args.ours_server[1]), args.threads, args.variant)
    if args.hf_server:
        return hf_server(args.hf_server, args.port, args.threads)
    C.machine_line(args.threads)  # the load average before any worker runs

    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
    torch.manual_seed(0)
    work = C.scratch_dir("gptlocal-serve-")
    levels = [int(c) for c in args.clients.split(",")]
    rows = []
    for shape in args.shapes.split(","):
        hf_dir, ms_dir = os.path.join(work, shape), os.path.join(work, shape + "_ms")
        GPT2LMHeadModel(GPT2Config(n_positions=1024, **SHAPES[shape])).save_pretrained(hf_dir)
        hf_to_ms(hf_dir, ms_dir)
        if "ours-int8" in args.sides.split(","):
            from mindformers_gptlocal.quantize import quantize_model
            quantize_model(ms_dir, ms_dir + "_int8", "int8", log=lambda line: None)

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
                    rate, lat = load(base, clients, per_client, args.new, SHAPES[shape]["vocab_size"], seed=clients)
                    found[clients] = dict(requests=clients * per_client, rate=rate,
                                          p50=float(np.percentile(lat, 50)), p99=float(np.percentile(lat, 99)))
                    print(f"{shape} {side} {clients:2d} clients: {rate:7.1f} tok/s  p50 {found[clients]['p50']:.2f} s  "
                          f"p99 {found[clients]['p99']:.2f} s", flush=True)
                found["rss_ready"] = rss_ready
                found["rss"] = peak_rss_mb(proc.pid)
                print(f"{shape} {side} peak RSS {found['rss']:.0f} MB (at ready {rss_ready:.0f} MB)", flush=True)
            finally:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
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


if __name__ == "__main__":
    sys.exit(main())
