"""Long-run soak: does memory creep, does the checkpoint folder stay bounded?

    python benchmarks/soak.py                     # 3,000 steps of the tiny model, a save every 200
    python benchmarks/soak.py --steps 600 --save-every 100 --threads 2

Trains the tiny YAML (model_configs/pretrain_gpt_local_tiny_cpu.yaml, stdlib data made by
prepare-data) through `gptlocal run` in a child process with an explicit thread environment,
samples the child's resident memory (VmRSS) and the checkpoint folder's size each time its
progress line reaches a multiple of --save-every, and prints one row per sample. The verdict
compares RSS after the last step with RSS after step 500 (or the first sample past 1/6 of the
run): within 5% means no growth. It also times SHA-256 on this CPU (the manifest's checksum),
to give its cost per GB of checkpoint.
"""
import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def rss_mb(pid):
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--keep", type=int, default=3, help="keep_checkpoint_max")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--work", default=None, help="folder for data and output (default: a temp folder)")
    parser.add_argument("--size", choices=("yaml", "test"), default="yaml",
                        help="yaml: the tiny YAML's model (4 x 256, seq 256, batch 4); test: the test suite's "
                             "(2 x 64, seq 64, batch 4), ~10x faster per step")
    args = parser.parse_args()

    from mindformers_gptlocal import yaml_io
    from mindformers_gptlocal.data.prepare import prepare
    work = args.work or tempfile.mkdtemp(prefix="gptlocal-soak-")
    seq, vocab = (256, 8192) if args.size == "yaml" else (64, 512)
    data = prepare(out=os.path.join(work, "data"), seq_length=seq, vocab_size=vocab, max_bytes=2_000_000,
                   eval_fraction=0.02)
    config = yaml_io.load_yaml(os.path.join(REPO, "model_configs", "pretrain_gpt_local_tiny_cpu.yaml"))
    if args.size == "test":
        config["model"]["model_config"].update(vocab_size=512, hidden_size=64, num_hidden_layers=2,
                                               num_attention_heads=4, seq_length=64, max_position_embeddings=64)
    config["output_dir"] = os.path.join(work, "output")
    config["train_dataset"]["data_loader"]["dataset_dir"] = data["train_mindrecord"]
    config["runner_config"]["epochs"] = 10_000  # stopped by stop_step
    config["runner_config"]["stop_step"] = args.steps
    config.pop("eval_dataset", None)
    config.pop("eval_dataset_task", None)
    config["do_eval"] = False
    if "train_dataset_task" in config:
        config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    callbacks = []
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = args.save_every
        if callback["type"] == "GPTLocalCheckpointMonitor":
            callback.update(save_checkpoint_steps=args.save_every, keep_checkpoint_max=args.keep)
        if callback["type"] != "GPTLocalSaveModelDir":
            callbacks.append(callback)
    config["callbacks"] = callbacks
    yaml_path = yaml_io.dump_yaml(config, os.path.join(work, "soak.yaml"))

    threads = str(args.threads)
    env = dict(os.environ, OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads,
               GLOG_v="3", PYTHONPATH=REPO)
    print(f"soak: {args.steps} steps of the {args.size} tiny model, save every {args.save_every}, keep {args.keep}; worker "
          f"env OMP_NUM_THREADS={threads} MKL_NUM_THREADS={threads} OPENBLAS_NUM_THREADS={threads}; {work}",
          flush=True)
    proc = subprocess.Popen([sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config", yaml_path],
                            cwd=work, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    samples, tail, start = [], [], time.time()
    ckpt_dir = os.path.join(work, "output", "checkpoint")

    def read():
        for line in proc.stdout:
            tail.append(line)
            del tail[:-50]
            found = re.search(r"\[gptlocal\] step (\d+)/\d+", line)
            if found and int(found.group(1)) % args.save_every == 0:
                step = int(found.group(1))
                samples.append(dict(step=step, rss_mb=rss_mb(proc.pid), ckpt_mb=folder_mb(ckpt_dir),
                                    seconds=time.time() - start))
                print(f"step {step:>6}  RSS {samples[-1]['rss_mb']:8.1f} MB  checkpoint folder "
                      f"{samples[-1]['ckpt_mb']:7.1f} MB  {samples[-1]['seconds']:7.1f} s", flush=True)
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    code = proc.wait()
    reader.join(timeout=10)
    if code != 0 or not samples:
        print("".join(tail))
        sys.exit(f"soak: the run failed (exit {code})")

    early_step = 500 if args.steps >= 1000 else args.steps // 6
    early = next(s for s in samples if s["step"] >= early_step)
    last = samples[-1]
    growth = last["rss_mb"] / early["rss_mb"] - 1
    from mindformers_gptlocal.checkpoint import manifest
    entries = manifest.read_manifest(ckpt_dir)
    one = max(e["bytes"] for e in entries) / 1e6 if entries else 0.0
    bound = (args.keep + 1) * one + 1.0  # keep_checkpoint_max files, one more during a save, manifest/meta
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
    print(f"checkpoint folder at most {biggest:.1f} MB (bound {bound:.1f} MB = {args.keep}+1 checkpoints of "
          f"{one:.2f} MB + 1 MB): {'bounded' if result['folder_ok'] else 'NOT BOUNDED'}; manifest lists "
          f"{len(entries)} files")
    print(f"SHA-256 on this CPU: {per_gb:.2f} s per GB of checkpoint (GPTLocalCheckpointMonitor checksum: "
          f"sha256, the default; checksum: size skips it)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
