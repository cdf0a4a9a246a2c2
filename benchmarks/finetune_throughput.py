"""Finetune speed and memory on CPU: gpt_local LoRA vs gpt_local full finetune, gpt_local LoRA vs
Hugging Face ``peft`` LoRA on PyTorch, and gpt_local prefix tuning (P-Tuning v2) vs peft prefix tuning, same
shapes, same machine, same run.

    python benchmarks/finetune_throughput.py                       # GPT-2 small, 3 rounds, every side
    python benchmarks/finetune_throughput.py --shape tiny --steps 8  # a quick check that it runs
    python benchmarks/finetune_throughput.py --methods prefix      # prefix tuning only (ms-prefix, torch-prefix)

Sides (each run in its own process, so its peak RSS, VmHWM, is its own):
  ms-lora    ``gptlocal run`` (MindFormers' trainer) with model_config.pet_config (LoRA r=8 on
             linear_qkv/proj/fc1/fc2, base frozen)
  ms-lora-plaindrop  ms-lora with model_config.cpu_kernels {lora_dropout: plain}: lora_dropout through the plain
             counter dropout (its graph ops) instead of gpt_local's CPU kernel (the kernel's reference;
             ``--methods lora-dropout``)
  ms-full    the same YAML without pet_config: every weight trains
  torch-lora GPT2LMHeadModel (sdpa) + ``peft.get_peft_model`` (r=8, alpha 16, c_attn/c_proj/c_fc), fused
             AdamW on the adapters, grad-norm clip 1.0 (as our wrapper), same token windows
  ms-prefix  ``gptlocal run`` with pet_config pet_type ptuning2, pre_seq_len 20, no projection (base frozen;
             prefix tuning takes the plain attention path, not the fused CPU kernel)
  torch-prefix GPT2LMHeadModel (sdpa) + ``peft.get_peft_model(PrefixTuningConfig(num_virtual_tokens=20))``,
             the same optimizer and clip
Every worker gets an explicit environment (OMP_NUM_THREADS = MKL_NUM_THREADS = OPENBLAS_NUM_THREADS =
--threads; ``import mindspore`` sets OMP_NUM_THREADS=1 in the C environment, which children would
inherit), checks it in its C environment before importing anything, and reports it; MindSpore's
runtime_num_threads and torch.set_num_threads get the same number (benchmarks/_common.py). Sides
alternate (A B C, C B A, ...) for --rounds rounds; each run's tokens/s is the median over the steps
after --warmup; the table gives the median over rounds and the min-max.
"""
import argparse
import json
import statistics
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)

LORA = dict(rank=8, alpha=16, dropout=0.05)
TARGETS = ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2"
SIDES = ("ms-lora", "torch-lora", "ms-full", "ms-prefix", "torch-prefix")
METHODS = {"lora": ("ms-lora", "torch-lora", "ms-full"), "prefix": ("ms-prefix", "torch-prefix"), "all": SIDES,
           "lora-dropout": ("ms-lora", "torch-lora", "ms-lora-plaindrop")}
PLAIN_DROPOUT = {"cpu_kernels": {"lora_dropout": "plain"}}  # ms-lora-plaindrop's model_config
PREFIX_TOKENS = 20
PREFIX_CONFIG = dict(pet_type="ptuning2", pre_seq_len=PREFIX_TOKENS, prefix_projection=False, dropout_prob=0.0)
PET_CONFIG = dict(pet_type="lora", lora_rank=LORA["rank"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"],
                  target_modules=TARGETS, freeze_include=["*"], freeze_exclude=["*lora*"])


def run_side(side, commands, threads):
    report, text = C.run_worker(__file__, commands[side], threads)
    if side.startswith("ms-"):
        report["step_times"], report["trainable"] = C.ms_step_times(text)
    return report


def tokens_per_s(report, s, warmup):
    steady = report["step_times"][warmup:] or report["step_times"]
    return s["batch"] * s["seq"] / statistics.median(steady)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=[k for k, v in C.SHAPES.items() if "arch" not in v])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--ms-worker")
    parser.add_argument("--torch-worker")
    parser.add_argument("--methods", default="all", choices=sorted(METHODS))
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--prefix", action="store_true")
    parser.add_argument("--data")
    args = parser.parse_args()
    if args.ms_worker:
        return C.ms_train_worker(args.ms_worker, args.threads)
    if args.torch_worker:
        return C.torch_train_worker(C.SHAPES[args.torch_worker], args.steps, args.data, args.threads, "sdpa+fused",
                                    LORA if args.lora else None, PREFIX_TOKENS if args.prefix else None)

    workdir = C.scratch_dir("gptlocal-ftbench-")
    s = C.SHAPES[args.shape]
    corpus, data, _ = C.prepare_windows(workdir, s["seq"], args.threads, max_bytes=1_000_000)
    yamls = {"ms-lora": C.ours_yaml(s, args.steps, corpus, workdir, f"ours_{args.shape}_lora", args.threads,
                                    PET_CONFIG),
             "ms-lora-plaindrop": C.ours_yaml(s, args.steps, corpus, workdir, f"ours_{args.shape}_lora_plaindrop",
                                              args.threads, PET_CONFIG, model_extra=PLAIN_DROPOUT),
             "ms-full": C.ours_yaml(s, args.steps, corpus, workdir, f"ours_{args.shape}_full", args.threads),
             "ms-prefix": C.ours_yaml(s, args.steps, corpus, workdir, f"ours_{args.shape}_prefix", args.threads,
                                      PREFIX_CONFIG)}
    commands = {"ms-lora": ["--ms-worker", yamls["ms-lora"], "--threads", str(args.threads)],
                "ms-full": ["--ms-worker", yamls["ms-full"], "--threads", str(args.threads)],
                "ms-lora-plaindrop": ["--ms-worker", yamls["ms-lora-plaindrop"], "--threads", str(args.threads)],
                "torch-lora": ["--torch-worker", args.shape, "--lora", "--steps", str(args.steps), "--data", data,
                               "--threads", str(args.threads)],
                "ms-prefix": ["--ms-worker", yamls["ms-prefix"], "--threads", str(args.threads)],
                "torch-prefix": ["--torch-worker", args.shape, "--prefix", "--steps", str(args.steps), "--data", data,
                                 "--threads", str(args.threads)]}
    sides = METHODS[args.methods]
    print(C.machine_line(args.threads), flush=True)

    def one(side, index):
        report = run_side(side, commands, args.threads)
        report["tokens_per_s"] = tokens_per_s(report, s, args.warmup)
        print(f"round {index + 1} {side:10} {report['tokens_per_s']:8.0f} tokens/s  peak RSS "
              f"{report['peak_rss_mb']:7.0f} MB  threads: C env {report['env']}, runtime {report['runtime_threads']}",
              flush=True)
        return report
    results = C.alternate(sides, args.rounds, one)
    print(f"\n{C.machine_line(args.threads)}")
    print(f"{args.shape}: batch {s['batch']} x {s['seq']}, {args.steps} steps per run (median after {args.warmup}), "
          f"{args.rounds} rounds, sides alternating; median [min-max] over rounds\n")
    print("| side | tokens/s | peak RSS MB | trainable parameters |")
    print("| --- | ---: | ---: | ---: |")
    for side in sides:
        rows = results[side]
        print(f"| {side} | {C.spread([r['tokens_per_s'] for r in rows])} | "
              f"{C.spread([r['peak_rss_mb'] for r in rows])} "
              f"| {rows[0].get('trainable') or 'all'} |")

    def median(side, key):
        return statistics.median(r[key] for r in results[side])
    summary = {}
    if "ms-lora" in sides:
        summary.update({
            "ours_vs_peft_tokens": median("ms-lora", "tokens_per_s") / median("torch-lora", "tokens_per_s"),
            "ours_vs_peft_rss": median("ms-lora", "peak_rss_mb") / median("torch-lora", "peak_rss_mb")})
    if "ms-full" in sides:
        summary.update({
            "lora_vs_full_rss": median("ms-lora", "peak_rss_mb") / median("ms-full", "peak_rss_mb"),
            "lora_vs_full_tokens": median("ms-lora", "tokens_per_s") / median("ms-full", "tokens_per_s")})
        print(f"LoRA / full finetune (ours): peak RSS {summary['lora_vs_full_rss']:.2f}x, tokens/s "
              f"{summary['lora_vs_full_tokens']:.2f}x")
    if "ms-lora-plaindrop" in sides:
        plain = "ms-lora-plaindrop"
        summary.update({
            "kernel_vs_plaindrop_tokens": median("ms-lora", "tokens_per_s") / median(plain, "tokens_per_s"),
            "kernel_vs_plaindrop_rss": median("ms-lora", "peak_rss_mb") / median(plain, "peak_rss_mb"),
            "plaindrop_vs_peft_tokens": median(plain, "tokens_per_s") / median("torch-lora", "tokens_per_s")})
        print(f"LoRA dropout kernel / the plain counter dropout (ours): tokens/s "
              f"{summary['kernel_vs_plaindrop_tokens']:.2f}x, peak RSS {summary['kernel_vs_plaindrop_rss']:.2f}x; "
              f"the plain counter dropout / peft: tokens/s {summary['plaindrop_vs_peft_tokens']:.2f}x")
    if "ms-lora" in sides:
        print(f"ours / peft LoRA: tokens/s {summary['ours_vs_peft_tokens']:.2f}x (target >= 1.0), peak RSS "
              f"{summary['ours_vs_peft_rss']:.2f}x (target <= 1.0)")
    if "ms-prefix" in sides:
        summary.update({
            "ours_vs_peft_prefix_tokens": median("ms-prefix", "tokens_per_s") / median("torch-prefix", "tokens_per_s"),
            "ours_vs_peft_prefix_rss": median("ms-prefix", "peak_rss_mb") / median("torch-prefix", "peak_rss_mb")})
        print(f"ours / peft prefix tuning ({PREFIX_TOKENS} virtual tokens): tokens/s "
              f"{summary['ours_vs_peft_prefix_tokens']:.2f}x, peak RSS {summary['ours_vs_peft_prefix_rss']:.2f}x")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "results": results, "summary": summary}, handle, indent=1)


if __name__ == "__main__":
    main()
