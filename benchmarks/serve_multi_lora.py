"""Multi-LoRA serving: `gptlocal serve --lora` with one client per adapter against the same load on a
single-adapter server and on the merged model (plain server, no LoRA), same weights, same run.

    python benchmarks/serve_multi_lora.py                       # 4 adapters, 4 clients, tiny shape
    python benchmarks/serve_multi_lora.py --adapters 4 --new 64 --requests 4 --rounds 3 --threads 2

Sides (all three servers are up at once and idle while another side is measured; rounds alternate
multi single merged, merged single multi, ...):
* multi:  --lora a1=.. --lora aK=..; client k sends to adapter ak (every decode step mixes K adapters);
* single: --lora a1=..; all K clients send to a1;
* merged: `gptlocal lora merge` of a1 served plainly; all K clients send to it (no LoRA cost at all).
Base and adapters: random tiny gpt_local (4 layers, hidden 256, vocab 8192), rank --rank on all four Linears,
made in a worker. Clients send 32-token random prompts, greedy, `ignore_eos`, --new tokens each, through the
OpenAI completions API (httpx). Each server process gets the explicit thread environment (_common.worker_env)
and checks it. tokens/s = generated tokens / wall time of the level.

Then (or alone, ``--steps-only``) one worker times a compiled decode step of the plain model against the same
model with the --adapters MultiLoRA Linears, rows on one adapter or one adapter per row rotated every step,
sides alternating within that one process (ms per step; what the HTTP numbers above are made of).
"""
import argparse
import os
import subprocess
import sys
import threading
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)
import serve_throughput as S  # noqa: E402

SHAPE = dict(vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4, max_position_embeddings=256,
             seq_length=256, hidden_dropout=0.0, attention_dropout=0.0)
SMALL = dict(SHAPE, vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12)  # GPT-2 small
TARGETS = ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2"


def make_dirs(work, adapters, rank):
    """Worker: the base, ``adapters`` LoRA finetune directories (random A/B), and a1 merged."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.checkpoint.lora import merge
    from mindformers_gptlocal.peft.lora import is_lora_name
    ms.set_seed(0)
    base = os.path.join(work, "base")
    GPTLocalForCausalLM(GPTLocalConfig(**SHAPE)).save_pretrained(base)
    rng = np.random.default_rng(0)
    pet = dict(pet_type="lora", lora_rank=rank, lora_alpha=2 * rank, lora_dropout=0.0, target_modules=TARGETS,
               freeze_include=["*"], freeze_exclude=["*lora*"])
    for k in range(1, adapters + 1):
        model = GPTLocalForCausalLM(GPTLocalConfig(**dict(SHAPE, pet_config=pet)))
        model.load_weights(base)
        for param in model.get_parameters():
            if is_lora_name(param.name):
                param.set_data(ms.Tensor(rng.normal(0, 0.05, param.shape).astype(np.float32)))
        model.save_pretrained(os.path.join(work, f"a{k}"))
    merge(base, os.path.join(work, "a1"), os.path.join(work, "a1-merged"))
    C.emit({"ok": True})


def step_worker(adapters, rank, threads, rounds, shape, steps=30):
    """Worker: one compiled decode step (batch = ``adapters``) of the plain model against the same model with
    ``adapters`` MultiLoRA adapters, rows all on adapter 1 ("const") or one adapter each, rotated every step
    ("mixed", a new index each call); sides alternate within this one process. ms per step."""
    counts = C.check_threads(threads, "step worker")
    counts["mindspore"] = C.mindspore_threads(threads, "step worker")
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.peft.lora_cells import MultiLoRASpec
    ms.set_context(mode=ms.GRAPH_MODE)
    rng = np.random.default_rng(0)
    caches, handles = {}, {}
    config = SMALL if shape == "small" else SHAPE
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

    def measure(side, index):
        cache, handle = caches[side.split("-")[0]], handles.get(side.split("-")[0])
        start = time.perf_counter()
        for step in range(steps):
            if handle is not None:
                handle.select([1] * adapters if side == "lora-const" else
                              list(np.roll(np.arange(1, adapters + 1), step)))
            cache.step(ids, pos, last)
        return (time.perf_counter() - start) / steps * 1e3
    C.emit({"threads": counts, "ms": C.alternate(("plain", "lora-const", "lora-mixed"), rounds, measure)})


def server(model_dir, loras, port, batch, threads):
    S.report_threads("ours", threads)
    from mindformers_gptlocal.cli.main import main
    return main(["serve", "--model", model_dir, "--port", str(port), "--max-batch-size", str(batch),
                 "--max-model-len", "256", "--prompt-buckets", str(S.PROMPT), "--served-model-name", "base",
                 "--log-level", "warning", *[f"--lora={spec}" for spec in loras]])


def launch(args, threads):
    """This script's ``--server ...`` in a subprocess with the workers' environment; (proc, url)."""
    port = S.free_port()
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), *args, "--port", str(port)],
                            env=C.worker_env(threads))
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(proc, base, args, timeout=1800):
    """Seconds until ``/health`` says ready."""
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
    proc.kill()
    raise RuntimeError(f"server {args} not ready in {timeout} s")


def load(base, models, per_client, new, seed):
    """One client thread per entry of ``models`` (the model it sends to), ``per_client`` requests each."""
    import httpx
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, SHAPE["vocab_size"], (len(models), per_client, S.PROMPT)).tolist()
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", type=int, default=4, help="adapters on the multi server = clients per side")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--requests", type=int, default=4, help="requests per client per round")
    parser.add_argument("--new", type=int, default=64, help="new tokens per request")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads per server")
    parser.add_argument("--make-dirs", nargs=3, metavar=("WORK", "ADAPTERS", "RANK"))
    parser.add_argument("--step-worker", action="store_true")
    parser.add_argument("--steps-only", action="store_true", help="only the in-process decode-step comparison")
    parser.add_argument("--step-shape", default="tiny", choices=("tiny", "small"),
                        help="model of the decode-step comparison (small: GPT-2 small, 12 x 768)")
    parser.add_argument("--server", nargs="+", metavar="DIR [NAME=DIR ...]")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    if args.make_dirs:
        return make_dirs(args.make_dirs[0], int(args.make_dirs[1]), int(args.make_dirs[2]))
    if args.server:
        return server(args.server[0], args.server[1:], args.port, args.adapters, args.threads)
    if args.step_worker:
        return step_worker(args.adapters, args.rank, args.threads, args.rounds, args.step_shape)
    C.machine_line(args.threads)  # the load average before any worker runs
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
            server_args = ["--server", model_dir, *loras, "--adapters", str(args.adapters), "--threads",
                           str(args.threads)]
            servers[side] = launch(server_args, args.threads)
        for side, (proc, base) in servers.items():
            print(f"{side}: ready after {wait_ready(proc, base, side):.1f} s", flush=True)
        for side, (_, base) in servers.items():  # warm-up
            load(base, specs[side][2], 1, 4, seed=99)

        def measure(side, index):
            rate = load(servers[side][1], specs[side][2], args.requests, args.new, seed=index)
            print(f"round {index + 1} {side}: {rate:.1f} tok/s", flush=True)
            return rate
        rates = C.alternate(tuple(specs), args.rounds, measure)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    print(f"\n{C.machine_line(args.threads)}")
    print(f"tiny gpt_local (4 x 256, vocab 8192), rank {args.rank} on 4 Linears; {args.adapters} clients x "
          f"{args.requests} requests, {S.PROMPT}-token prompts, {args.new} new tokens, greedy, fp32, "
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
                                        "--rounds", str(args.rounds), "--step-shape", args.step_shape, "--threads", str(args.threads)],
                           args.threads)
    ms_ = report["ms"]
    plain = C.median(ms_["plain"])
    print(f"\none compiled decode step of the {args.step_shape} model, batch {args.adapters}, in one process, sides alternating, {args.rounds} "
          f"rounds of 30 steps; {C.machine_line(args.threads).split(';')[0]}\n")
    print("| model | rows use | ms per step | vs plain |")
    print("| --- | --- | ---: | ---: |")
    for side, what in (("plain", "no LoRA"), ("lora-const", f"{args.adapters} adapters loaded, all rows adapter 1"),
                       ("lora-mixed", "one adapter per row, rotated every step")):
        print(f"| {side} | {what} | {C.spread(ms_[side], '{:.1f}')} | {C.median(ms_[side]) / plain:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
