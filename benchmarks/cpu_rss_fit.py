"""Measure the peak RSS of short CPU training runs and fit ``plan/memory.py``'s CPU terms.

    python benchmarks/cpu_rss_fit.py measure --optimizer GPTLocalAdamW --out rss.jsonl   # all shapes
    python benchmarks/cpu_rss_fit.py measure --optimizer AdamW --shapes tiny_b4 small_b2 --out rss.jsonl
    python benchmarks/cpu_rss_fit.py fit rss.jsonl --held-out small_v8192
    python benchmarks/cpu_rss_fit.py fit benchmarks/cpu_rss_runs.jsonl --held-out small_v8192   # the runs
        # behind plan/memory.py's CPU constants

Each run is `gptlocal run` on model_configs/pretrain_gpt_local_tiny_cpu.yaml resized to the shape
(the same setup as tests/plan/test_planner.py: 256-token windows from `prepare-data`, no shuffle,
GPTLocalTrainOneStepCell with grad clipping, graph mode), ``--steps`` steps, in its own process;
the peak RSS is the `[gptlocal] training done, peak RSS N MB` line (VmHWM). ``fit`` solves
peak = runtime + state_factor[optimizer] * (weights+grads+moments)
       + activation_factor * (activations - head) + head_factor * head activations
by least squares (runtime and activation factors shared, one state factor per optimizer type), the
byte counts being plan/memory.py's; rows named by --held-out (shape, or shape:optimizer) are left
out of the fit and reported with their ratio.
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

SMALL = dict(vocab_size=50257, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
             max_position_embeddings=1024)
SHAPES = {  # name: (model_config changes, batch); seq 256 everywhere
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
    config["model"]["model_config"].update(SHAPES[name][0])
    return config


def head_bytes(name):
    from mindformers_gptlocal.plan import memory as mem
    s = mem.shape_of(dict(base_config(name)["model"]["model_config"]))
    return mem.head_activation_bytes(s, SHAPES[name][1])


def run_yaml(name, optimizer, steps, corpus, workdir):
    from mindformers_gptlocal import yaml_io
    batch = SHAPES[name][1]
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


def measure(args):
    from mindformers_gptlocal.data.prepare import prepare
    root = tempfile.mkdtemp(prefix="rssfit_")
    corpus = prepare(out=os.path.join(root, "data"), seq_length=256, vocab_size=512, max_bytes=150_000,
                     eval_fraction=0.05)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
    for name in args.shapes:
        workdir = tempfile.mkdtemp(prefix=name + "_", dir=root)
        path = run_yaml(name, args.optimizer, args.steps, corpus, workdir)
        state, act, estimate = terms(path)
        proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config", path],
                              cwd=workdir, env=env, capture_output=True, text=True, timeout=1800)
        out = proc.stdout + proc.stderr
        found = re.search(r"peak RSS ([0-9,]+) MB", out)
        if proc.returncode != 0 or not found:
            print(f"{name}: run failed ({proc.returncode})\n{out[-3000:]}", file=sys.stderr)
            continue
        row = dict(shape=name, optimizer=args.optimizer, steps=args.steps, peak_mb=float(found.group(1).replace(",", "")),
                   state_bytes=state, activation_bytes=act, estimate_mb=estimate / 2 ** 20)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


def fit(args):
    rows = [json.loads(line) for path in args.files for line in open(path) if line.strip()]
    held = [r for r in rows if r["shape"] in args.held_out or f"{r['shape']}:{r['optimizer']}" in args.held_out]
    train = [r for r in rows if r not in held]
    opts = sorted({r["optimizer"] for r in rows})
    mb = 2 ** 20

    def design(r):
        head = head_bytes(r["shape"])
        return [1.0] + [r["state_bytes"] / mb if r["optimizer"] == o else 0.0 for o in opts] + \
            [(r["activation_bytes"] - head) / mb, head / mb]
    a = np.array([design(r) for r in train])
    b = np.array([r["peak_mb"] for r in train])
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    print("runtime %.0f MB, state factors %s, activation factor %.3f, head factor %.3f" %
          (coef[0], {o: round(float(c), 3) for o, c in zip(opts, coef[1:-2])}, coef[-2], coef[-1]))
    for r in rows:
        fitted = float(np.dot(design(r), coef))
        print(f"{r['shape']:14s} {r['optimizer']:14s} measured {r['peak_mb']:7,.0f} fitted {fitted:7,.0f} "
              f"ratio {fitted / r['peak_mb']:.3f}  estimate when measured {r['estimate_mb']:7,.0f}"
              f"{'  (held out)' if r in held else ''}")


def main():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--optimizer", default="GPTLocalAdamW")
    m.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    m.add_argument("--steps", type=int, default=3)
    m.add_argument("--out", required=True)
    f = sub.add_parser("fit")
    f.add_argument("files", nargs="+")
    f.add_argument("--held-out", nargs="*", default=[], help="shapes (or shape:optimizer rows) left out of the fit")
    args = parser.parse_args()
    measure(args) if args.cmd == "measure" else fit(args)


if __name__ == "__main__":
    main()
