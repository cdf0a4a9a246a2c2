"""Training throughput of gpt_local (MindSpore, through MindFormers' trainer) against Hugging Face
GPT-2 on PyTorch, same shapes, same machine, same run.

    python benchmarks/train_throughput.py                 # tiny and GPT-2 small
    python benchmarks/train_throughput.py --shapes tiny --steps 40

Ours runs `gptlocal run` on the tiny YAML resized to each shape, reading MindRecord data that
`prepare-data` makes from the stdlib; per-step times come from GPTLocalThroughputMonitor. PyTorch
runs GPT2LMHeadModel with AdamW on the same token windows. Each side runs in its own process so
peak RSS is its own. MFU uses 6*N + 12*L*H*S FLOPs per token against the fp32 GEMM peak measured
here with torch. Medians over the steps after the first `--warmup`.
"""
import argparse
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


def params_count(s):
    h, l, v = s["hidden"], s["layers"], s["vocab"]
    return v * h + 1024 * h + l * (12 * h * h + 13 * h) + 2 * h


def flops_per_token(s):
    return 6 * params_count(s) + 12 * s["layers"] * s["hidden"] * s["seq"]


def gemm_peak_gflops():
    """fp32 GEMM peak of this machine (torch, 2048^3, best of 5)."""
    import torch
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(5))
    return 2 * 2048 ** 3 / best / 1e9


def _timed(fn):
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def own_peak_rss_mb():
    """VmHWM: this process's peak RSS (ru_maxrss would include this benchmark's RSS at fork)."""
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmHWM:"))


def torch_worker(shape, steps, data):
    """Train HF GPT2LMHeadModel on the same windows; print one JSON line."""
    import numpy as np
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    s = SHAPES[shape]
    config = GPT2Config(vocab_size=s["vocab"], n_positions=1024, n_embd=s["hidden"], n_layer=s["layers"],
                        n_head=s["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    windows = np.load(data)
    times = []
    for step in range(steps):
        batch = torch.from_numpy(windows[(step * s["batch"]) % (len(windows) - s["batch"]):][:s["batch"]]).long()
        start = time.perf_counter()
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    print(json.dumps({"step_times": times, "peak_rss_mb": own_peak_rss_mb()}))


def run_torch(shape, steps, data):
    out = subprocess.run([sys.executable, __file__, "--torch-worker", shape, "--steps", str(steps), "--data", data],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_ours(shape, steps, corpus, workdir):
    from mindformers_gptlocal import yaml_io
    s = SHAPES[shape]
    config = yaml_io.load_yaml(os.path.join(REPO, "model_configs", "pretrain_gpt_local_tiny_cpu.yaml"))
    config["model"]["model_config"].update(vocab_size=s["vocab"], hidden_size=s["hidden"],
                                           num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                                           seq_length=s["seq"], max_position_embeddings=1024)
    config["runner_config"]["batch_size"] = s["batch"]
    config["train_dataset"]["batch_size"] = s["batch"]
    config["train_dataset"]["data_loader"].update(dataset_dir=corpus["train_mindrecord"], shuffle=False,
                                                  num_samples=steps * s["batch"])
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    config["callbacks"] = [{"type": "GPTLocalThroughputMonitor", "per_print_times": 1}]
    config["output_dir"] = os.path.join(workdir, f"ours_{shape}")
    path = yaml_io.dump_yaml(config, os.path.join(workdir, f"ours_{shape}.yaml"))
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config", path],
                         capture_output=True, text=True, cwd=workdir,
                         env=dict(os.environ, PYTHONPATH=REPO, GLOG_v="3"))
    if out.returncode:
        raise SystemExit(out.stdout[-3000:] + out.stderr[-3000:])
    text = out.stdout + out.stderr
    ms = [float(x) for x in re.findall(r"\[gpt_local\] step \d+/\d+ .* ([0-9.]+) ms/step", text)]
    rss = float(re.search(r"peak RSS ([0-9,]+) MB", text).group(1).replace(",", ""))
    return {"step_times": [m / 1000 for m in ms], "peak_rss_mb": rss, "wall_s": time.perf_counter() - started}


def summarise(name, result, s, warmup, peak):
    steady = result["step_times"][warmup:] or result["step_times"]
    step = statistics.median(steady)
    tokens = s["batch"] * s["seq"] / step
    return {"who": name, "tokens_per_s": tokens, "step_s": step, "first_step_s": result["step_times"][0],
            "peak_rss_mb": result["peak_rss_mb"], "mfu": tokens * flops_per_token(s) / (peak * 1e9)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--steps", type=int, default=0, help="steps per run (default 30 tiny, 10 small)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--torch-worker")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.torch_worker:
        return torch_worker(args.torch_worker, args.steps, args.data)
    import numpy as np
    from mindformers_gptlocal.data.prepare import prepare
    workdir = tempfile.mkdtemp(prefix="gptlocal-bench-")
    corpus = prepare(out=os.path.join(workdir, "data"), seq_length=256, vocab_size=8192, max_bytes=1_500_000)
    from mindspore.mindrecord import FileReader
    reader = FileReader(corpus["train_mindrecord"])
    windows = np.stack([np.append(r["input_ids"], r["labels"][-1]) for r in reader.get_next()])
    reader.close()
    data = os.path.join(workdir, "windows.npy")
    np.save(data, windows)
    peak = gemm_peak_gflops()
    print(f"fp32 GEMM peak here (torch): {peak:.0f} GFLOP/s; {os.cpu_count()} CPUs")
    rows = []
    for shape in args.shapes.split(","):
        s = SHAPES[shape]
        steps = args.steps or (30 if shape == "tiny" else 10)
        ours = summarise("gpt_local (MindSpore)", run_ours(shape, steps, corpus, workdir), s, args.warmup, peak)
        ref = summarise("HF GPT-2 (PyTorch)", run_torch(shape, steps, data), s, args.warmup, peak)
        rows.append((shape, s, ours, ref))
    print(f"\n{'shape':6} {'who':24} {'tokens/s':>9} {'step s':>7} {'1st step s':>10} {'peak RSS MB':>11} {'MFU':>6}")
    for shape, s, ours, ref in rows:
        for r in (ours, ref):
            print(f"{shape:6} {r['who']:24} {r['tokens_per_s']:9.0f} {r['step_s']:7.3f} {r['first_step_s']:10.2f} "
                  f"{r['peak_rss_mb']:11.0f} {100 * r['mfu']:5.1f}%")
        print(f"{shape:6} {'ratio ours/PyTorch':24} {ours['tokens_per_s'] / ref['tokens_per_s']:9.2f}x "
              f"(batch {s['batch']} x {s['seq']}, {params_count(s) / 1e6:.1f}M params)")


if __name__ == "__main__":
    main()
