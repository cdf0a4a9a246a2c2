"""Finetune speed and memory on CPU: gpt_local LoRA vs gpt_local full finetune, and gpt_local LoRA vs
Hugging Face ``peft`` LoRA on PyTorch, same shapes, same machine, same run.

    python benchmarks/finetune_throughput.py                       # GPT-2 small, 3 rounds
    python benchmarks/finetune_throughput.py --shape tiny --steps 8  # a quick check that it runs

Sides (each run in its own process, so its peak RSS, VmHWM, is its own):
  ms-lora    ``gptlocal run`` (MindFormers' trainer) with model_config.pet_config (LoRA r=8 on
             linear_qkv/proj/fc1/fc2, base frozen)
  ms-full    the same YAML without pet_config: every weight trains
  torch-lora GPT2LMHeadModel + ``peft.get_peft_model`` (r=8, alpha 16, c_attn/c_proj/c_fc), AdamW on
             the adapters, grad-norm clip 1.0 (as our wrapper), same token windows
Every worker gets an explicit environment (``env=``): OMP_NUM_THREADS, MKL_NUM_THREADS and
OPENBLAS_NUM_THREADS = --threads (``import mindspore`` sets OMP_NUM_THREADS=1 in the C environment,
which children would inherit); MindSpore's runtime_num_threads and torch.set_num_threads get the same
number, and each worker prints the counts it ran with. Sides alternate (A B C, C B A, ...) for
--rounds rounds; each run's tokens/s is the median over the steps after --warmup; the table gives the
median over rounds and the min-max.
"""
import argparse
import ctypes
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SHAPES = {
    "tiny": dict(layers=4, hidden=256, heads=4, vocab=8192, batch=4, seq=256),
    "small": dict(layers=12, hidden=768, heads=12, vocab=50257, batch=2, seq=256),
}
LORA = dict(rank=8, alpha=16, dropout=0.05)
TARGETS = ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2"
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
SIDES = ("ms-lora", "torch-lora", "ms-full")


def worker_env(threads):
    """The explicit environment of every worker: thread counts set, this tree importable, quiet logs."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update({k: str(threads) for k in THREAD_VARS}, PYTHONPATH=REPO, GLOG_v="3")
    return env


def c_getenv(name):
    """The C environment's value (what OpenMP reads), which os.environ does not see after a setenv."""
    value = ctypes.CDLL(None).getenv
    value.restype = ctypes.c_char_p
    found = value(name.encode())
    return found.decode() if found else None


def check_threads(threads, who):
    """Refuse to measure with other thread counts than asked; return them for the report."""
    seen = {k: os.environ.get(k) for k in THREAD_VARS}
    if any(v != str(threads) for v in seen.values()):
        raise SystemExit(f"{who}: thread variables {seen} differ from --threads {threads}")
    return seen


def vm_hwm_mb():
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))


# ---------------------------------------------------------------------------------------------- workers
def ms_worker(yaml_path, threads):
    """Our side: MindFormers' trainer through ``gptlocal run``, in this process."""
    env = check_threads(threads, "ms worker")
    from mindformers_gptlocal.cli.launcher import main as launch
    code = launch(["--config", yaml_path])
    import mindspore as ms
    report = {"env": env, "c_env_after_import_mindspore": {k: c_getenv(k) for k in THREAD_VARS},
              "runtime_num_threads": ms.get_context("runtime_num_threads"), "peak_rss_mb": vm_hwm_mb(), "code": code}
    print("WORKER " + json.dumps(report), flush=True)


def torch_worker(shape, steps, data, threads, lora):
    """Hugging Face GPT2LMHeadModel (+ peft LoRA) on the same windows."""
    env = check_threads(threads, "torch worker")
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    s = SHAPES[shape]
    config = GPT2Config(vocab_size=s["vocab"], n_positions=1024, n_embd=s["hidden"], n_layer=s["layers"],
                        n_head=s["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                                                 target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                                                 task_type="CAUSAL_LM"))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)
    windows = np.load(data)
    times = []
    for step in range(steps):
        batch = torch.from_numpy(windows[(step * s["batch"]) % (len(windows) - s["batch"]):][:s["batch"]]).long()
        start = time.perf_counter()
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    print("WORKER " + json.dumps({"env": env, "torch_threads": torch.get_num_threads(), "step_times": times,
                                  "trainable": sum(p.numel() for p in trainable), "peak_rss_mb": vm_hwm_mb()}))


# ---------------------------------------------------------------------------------------------- parent
def ours_yaml(shape, steps, corpus, workdir, lora, threads):
    from mindformers_gptlocal import yaml_io
    s = SHAPES[shape]
    config = yaml_io.load_yaml(os.path.join(REPO, "model_configs", "pretrain_gpt_local_tiny_cpu.yaml"))
    config["model"]["model_config"].update(vocab_size=s["vocab"], hidden_size=s["hidden"],
                                           num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                           seq_length=s["seq"], max_position_embeddings=1024,
                                           hidden_dropout=0.0, attention_dropout=0.0, embedding_dropout=0.0)
    if lora:
        config["model"]["model_config"]["pet_config"] = dict(
            pet_type="lora", lora_rank=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
            target_modules=TARGETS, freeze_include=["*"], freeze_exclude=["*lora*"])
    config["context"]["runtime_num_threads"] = threads
    config["runner_config"]["batch_size"] = s["batch"]
    config["train_dataset"]["batch_size"] = s["batch"]
    config["train_dataset"]["data_loader"].update(dataset_dir=corpus, shuffle=False, num_samples=steps * s["batch"])
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    config["callbacks"] = [{"type": "GPTLocalThroughputMonitor", "per_print_times": 1}]
    name = f"ours_{shape}_{'lora' if lora else 'full'}"
    config["output_dir"] = os.path.join(workdir, name)
    return yaml_io.dump_yaml(config, os.path.join(workdir, name + ".yaml"))


def run_worker(args, threads):
    out = subprocess.run([sys.executable, os.path.abspath(__file__), *args], capture_output=True, text=True,
                         env=worker_env(threads), cwd=tempfile.gettempdir())
    text = out.stdout + out.stderr
    line = [x for x in text.splitlines() if x.startswith("WORKER ")]
    if out.returncode or not line:
        raise SystemExit(f"worker {args[0]} failed:\n{text[-4000:]}")
    report = json.loads(line[-1][len("WORKER "):])
    if "step_times" not in report:
        ms = [float(x) for x in re.findall(r"\[gpt_local\] step \d+/\d+ .* ([0-9.]+) ms/step", text)]
        report["step_times"] = [m / 1000 for m in ms]
        found = re.search(r"LoRA: ([0-9,]+) trainable", text)
        report["trainable"] = int(found.group(1).replace(",", "")) if found else None
    return report


def tokens_per_s(report, s, warmup):
    steady = report["step_times"][warmup:] or report["step_times"]
    return s["batch"] * s["seq"] / statistics.median(steady)


def spread(values):
    return f"{statistics.median(values):8.0f} [{min(values):.0f}-{max(values):.0f}]"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--ms-worker")
    parser.add_argument("--torch-worker")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.ms_worker:
        return ms_worker(args.ms_worker, args.threads)
    if args.torch_worker:
        return torch_worker(args.torch_worker, args.steps, args.data, args.threads, args.lora)

    import numpy as np
    workdir = tempfile.mkdtemp(prefix="gptlocal-ftbench-")
    # prepare-data in a worker too: this process never imports MindSpore
    prep = subprocess.run([sys.executable, "-c", (
        "import json, sys, numpy as np; from mindformers_gptlocal.data.prepare import prepare; "
        "from mindspore.mindrecord import FileReader; "
        f"c = prepare(out={os.path.join(workdir, 'data')!r}, seq_length=256, vocab_size=8192, max_bytes=1_000_000); "
        "r = FileReader(c['train_mindrecord']); "
        "w = np.stack([np.append(x['input_ids'], x['labels'][-1]) for x in r.get_next()]); r.close(); "
        f"np.save({os.path.join(workdir, 'windows.npy')!r}, w); print('DATA ' + c['train_mindrecord'])")],
        capture_output=True, text=True, env=worker_env(args.threads))
    found = re.search(r"^DATA (.*)$", prep.stdout, re.M)
    if not found:
        raise SystemExit(prep.stdout[-2000:] + prep.stderr[-2000:])
    corpus, data = found.group(1), os.path.join(workdir, "windows.npy")
    del np
    s = SHAPES[args.shape]
    yamls = {"ms-lora": ours_yaml(args.shape, args.steps, corpus, workdir, True, args.threads),
             "ms-full": ours_yaml(args.shape, args.steps, corpus, workdir, False, args.threads)}
    commands = {"ms-lora": ["--ms-worker", yamls["ms-lora"], "--threads", str(args.threads)],
                "ms-full": ["--ms-worker", yamls["ms-full"], "--threads", str(args.threads)],
                "torch-lora": ["--torch-worker", args.shape, "--lora", "--steps", str(args.steps), "--data", data,
                               "--threads", str(args.threads)]}
    results = {side: [] for side in SIDES}
    for round_index in range(args.rounds):
        order = SIDES if round_index % 2 == 0 else tuple(reversed(SIDES))
        for side in order:
            report = run_worker(commands[side], args.threads)
            report["tokens_per_s"] = tokens_per_s(report, s, args.warmup)
            results[side].append(report)
            threads = report.get("torch_threads", report.get("runtime_num_threads"))
            print(f"round {round_index + 1} {side:10} {report['tokens_per_s']:8.0f} tokens/s  peak RSS "
                  f"{report['peak_rss_mb']:7.0f} MB  threads: env {report['env']}, runtime {threads}"
                  + (f", C env after import mindspore {report['c_env_after_import_mindspore']}"
                     if "c_env_after_import_mindspore" in report else ""), flush=True)
    print(f"\n{args.shape}: batch {s['batch']} x {s['seq']}, {args.steps} steps per run (median after {args.warmup}), "
          f"{args.rounds} rounds alternating, {args.threads} threads per process, {os.cpu_count()} CPUs")
    print(f"{'side':10} {'tokens/s median [min-max]':>28} {'peak RSS MB median [min-max]':>30} {'trainable':>10}")
    for side in SIDES:
        rows = results[side]
        print(f"{side:10} {spread([r['tokens_per_s'] for r in rows]):>28} "
              f"{spread([r['peak_rss_mb'] for r in rows]):>30} {rows[0].get('trainable') or 'all':>10}")

    def median(side, key):
        return statistics.median(r[key] for r in results[side])
    summary = {
        "lora_vs_full_rss": median("ms-lora", "peak_rss_mb") / median("ms-full", "peak_rss_mb"),
        "lora_vs_full_tokens": median("ms-lora", "tokens_per_s") / median("ms-full", "tokens_per_s"),
        "ours_vs_peft_tokens": median("ms-lora", "tokens_per_s") / median("torch-lora", "tokens_per_s"),
        "ours_vs_peft_rss": median("ms-lora", "peak_rss_mb") / median("torch-lora", "peak_rss_mb")}
    print(f"LoRA / full finetune (ours): peak RSS {summary['lora_vs_full_rss']:.2f}x, tokens/s "
          f"{summary['lora_vs_full_tokens']:.2f}x")
    print(f"ours / peft LoRA: tokens/s {summary['ours_vs_peft_tokens']:.2f}x (target >= 1.0), peak RSS "
          f"{summary['ours_vs_peft_rss']:.2f}x (target <= 1.0)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "results": results, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
