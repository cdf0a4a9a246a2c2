"""The one entry point of the benchmarks: named suites, each a list of parts, each part one benchmark script of this
folder with the arguments that produced docs/performance.md's table for that job.

    python benchmarks/run.py --list                    # every suite, its parts and the exact commands
    python benchmarks/run.py train                     # regenerate performance.md's training table
    python benchmarks/run.py serve --part tiny         # one part of a suite
    python benchmarks/run.py generate --part gpt2 --rounds 1 --shapes tiny   # extra arguments go to the part's script
    python benchmarks/run.py kernels --dry-run         # print the commands, run nothing
    python benchmarks/run.py lora --keep               # keep the scratch folders (converted models, data)

Every part runs as its own process (``python benchmarks/SCRIPT ARGS``), one after another, so nothing of one is
left in the next; each script starts its measuring workers through ``_common.run_worker`` (threads pinned and
checked, sides alternating, median [min-max] over rounds, peak RSS) and prints the machine line. Arguments after
the suite's own options are appended to each part's (argparse takes the last value of a repeated option), so a
part's default can be overridden. ``--keep`` is passed on: ``_common.scratch_dir`` keeps its folder and prints
its path. Exit status: 0 when every part succeeded, else the first failing part's.

Run the suites on a quiet machine, one at a time (the scripts print BUSY when the 1-min load says otherwise; a part
that follows another first waits, up to 150 s, for the 1-min load of the one before to fade).
"""
import argparse
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package; _common imports the standard library only)

# suite -> (what it measures, [(part, script, arguments)]); the arguments are those of docs/performance.md's table
SUITES = {
    "train": ("pretraining tokens/s, MFU and peak RSS in fp32 and bf16 against Hugging Face GPT-2 / Llama under "
              "torch.compile and bf16 autocast", [
        ("tiny", "train_throughput.py", "--shapes tiny --rounds 3 --ours-bf16 "
                                        "--torch-variants compile,sdpa+fused-bf16,compile-bf16"),
        ("small", "train_throughput.py", "--shapes small --rounds 2 --steps 5 --warmup 2 --ours-bf16 "
                                         "--torch-variants compile,sdpa+fused-bf16,compile-bf16"),
        ("llama", "train_throughput.py", "--shapes llama --rounds 2 --steps 5 --warmup 2 --ours-bf16 "
                                         "--torch-variants compile,sdpa+fused-bf16,compile-bf16"),
    ]),
    "long": ("training at one long sequence (the fused attention kernel) against HF with SDPA and fused AdamW, and "
             "torch.compile, fp32 and bf16", [
        ("small1024", "train_throughput.py", "--shapes small --seq-length 1024 --batch-size 1 --steps 5 --warmup 2 "
                                             "--rounds 2 --ours-bf16 "
                                             "--torch-variants sdpa+fused,compile,sdpa+fused-bf16,compile-bf16"),
        ("llama1024", "train_throughput.py", "--shapes llama --seq-length 1024 --batch-size 1 --steps 5 --warmup 2 "
                                             "--rounds 2 --ours-bf16 "
                                             "--torch-variants sdpa+fused,compile,sdpa+fused-bf16,compile-bf16"),
        ("tiny2048", "train_throughput.py", "--shapes tiny --seq-length 2048 --batch-size 1 --steps 8 --rounds 2 "
                                            "--torch-variants sdpa+fused"),
    ]),
    "lora": ("parameter-efficient finetuning against Hugging Face peft (LoRA, prefix tuning)", [
        ("lora", "finetune_throughput.py", "--shape small --steps 5 --warmup 2 --rounds 2 --threads 2 --methods lora"),
        ("prefix", "finetune_throughput.py", "--shape tiny --steps 8 --rounds 2 --methods prefix"),
    ]),
    "generate": ("KV-cache generation (decode tok/s, TTFT, peak RSS) at fp32, bf16 and int8 against transformers' "
                 "generate and CTranslate2 (the bench extra); part llamacpp: against llama.cpp, an optional build "
                 "(give --llamacpp-converter DIR: benchmarks/generate_throughput.py's docstring)", [
        ("gpt2", "generate_throughput.py", "--shapes tiny,small --batches 1,8 --rounds 2 --threads 2 "
                                           "--recompute-shapes none "
                                           "--sides ours,ours-compiled,ours-bf16,ours-int8,"
                                           "ct2-fp32,ct2-int8,ct2-bf16,hf"),
        ("llama", "generate_throughput.py", "--shapes llama --batches 1,8 --rounds 2 --threads 2 "
                                            "--recompute-shapes none --sides ours,ours-compiled,ours-bf16,"
                                            "ours-int8,ct2-fp32,ct2-int8,ct2-bf16,hf --forward"),
        ("llamacpp", "generate_throughput.py", "--shapes llama,small --batches 1,8 --rounds 2 --threads 2 "
                                               "--recompute-shapes none --sides ours,ours-int8,ours-bf16,"
                                               "llamacpp-f32,llamacpp-q8_0,llamacpp-bf16,ct2-fp32,ct2-int8"),
    ]),
    "serve": ("gptlocal serve (continuous batching) against transformers (one generate per request), GPT-2 small "
              "beside the Llama-style shape, an int8 model against fp32, and multi-LoRA serving", [
        ("tiny", "serve_throughput.py", "--shapes tiny --clients 1,16 --new 32 --requests 16 --threads 2 --rounds 2 "
                                        "--sides ours,ours-cached,hf"),
        ("small", "serve_throughput.py", "--shapes small --clients 1,16 --new 16 --requests 16 --threads 2 --rounds 2 "
                                         "--sides ours,ours-cached,hf"),
        ("llama", "serve_throughput.py", "--shapes small,llama --clients 1,16 --new 16 --requests 16 --threads 2 "
                                         "--rounds 2 --sides ours,hf"),
        ("int8", "serve_throughput.py", "--shapes tiny,small --clients 1,16 --new 32 --requests 16 --threads 2 "
                                        "--rounds 2 --sides ours,ours-int8"),
        ("multi-lora", "serve_throughput.py", "--multi-lora --adapters 4 --requests 2 --new 32 --rounds 5 --threads 2"),
    ]),
    "eval": ("gptlocal eval (lm-eval) against lm-eval's hf backend on the same weights, cold and warm", [
        ("tiny", "eval_throughput.py", "--shape tiny --rounds 2 --threads 2 --limit 48 --docs 48"),
    ]),
    "precision": ("bf16 and int8 accuracy against fp32 (logits, greedy tokens, perplexity, bf16 training's loss)", [
        ("accuracy", "precision_accuracy.py", "--make"),
    ]),
    "kernels": ("each CPU kernel against the plain MindSpore ops it replaces, sides alternating", [
        ("attention", "kernels.py", "attention --rounds 3"),
        ("norm-gelu", "kernels.py", "norm-gelu --rounds 20 --threads 2"),
        ("linear", "kernels.py", "linear --rounds 20 --threads 2"),
        ("decode-layer", "kernels.py", "decode-layer --rounds 10 --threads 2"),
        ("kv-write", "kernels.py", "kv-write --shapes small --batches 1 8 --cache-lengths 64 512 2048 --steps 5 "
                                   "--rounds 2"),
        ("reduce", "kernels.py", "reduce"),
    ]),
    "memory": ("where the bytes go: conversion, a server process, the planner's CPU memory fit", [
        ("convert", "memory.py", "convert"),
        ("serve", "memory.py", "serve --shape small --threads 2"),
        ("rss-fit", "memory.py", "rss-fit fit benchmarks/cpu_rss_runs.jsonl --held-out small_v8192"),
    ]),
    "profile": ("per-op profiles (MindSpore's profiler) of a training step and of Llama-style inference", [
        ("train", "op_profile.py", "train --shape tiny --batch 4 --seq 256"),
        ("llama", "op_profile.py", "llama --batch 1 --seq 256 --new 32"),
    ]),
    "soak": ("a long training run: does memory creep, does the checkpoint folder stay bounded", [
        ("tiny", "memory.py", "soak"),
    ]),
}


def command(script, arguments, extra=(), keep=False):
    """The argv of one part: this interpreter, the script, its arguments, the extra ones, ``--keep``."""
    return [sys.executable, os.path.join(HERE, script), *shlex.split(arguments), *extra] + (["--keep"] if keep else [])


def shown(argv):
    """``python benchmarks/SCRIPT ARGS`` as a reader would type it from the repository's root."""
    return " ".join(["python", os.path.join("benchmarks", os.path.basename(argv[1])), *map(shlex.quote, argv[2:])])


def listing():
    lines = []
    for suite, (what, parts) in SUITES.items():
        lines.append(f"{suite}: {what}")
        lines += [f"  {part:<12} {shown(command(script, arguments))}" for part, script, arguments in parts]
    return "\n".join(lines)


SETTLE_LIMIT = 150.0  # seconds a part waits at most for the previous part's load to fade


def settle(limit=SETTLE_LIMIT, poll=5.0):
    """Before a part that follows another: wait until the 1-min load average falls below ``_common``'s BUSY line
    (at most ``limit`` s). The average trails the last minute, so right after a part it still counts that part's
    workers, and the next part's machine line would call a quiet machine busy. Returns the number of polls
    waited."""
    start = time.monotonic()
    load = C.load_average()
    polls = 0
    while load > C.busy_line() and time.monotonic() - start < limit:
        time.sleep(poll)
        polls += 1
        load = C.load_average()
    if polls:
        print(f"== waited {time.monotonic() - start:.0f} s for the previous part's load to fade (1-min load now "
              f"{load:.1f})", flush=True)
    return polls


def main(argv=None):
    # allow_abbrev=False: a script's option that begins like one of ours (--k, --li) goes to the script
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=listing(), allow_abbrev=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", nargs="?", choices=list(SUITES), help="the suite to run")
    parser.add_argument("--part", action="append", help="run only this part (repeatable); default every part")
    parser.add_argument("--list", action="store_true", help="print every suite, its parts and commands")
    parser.add_argument("--dry-run", action="store_true", help="print the commands without running them")
    parser.add_argument("--keep", action="store_true", help="keep the benchmarks' scratch folders")
    args, extra = parser.parse_known_args(argv)
    if args.list or not args.suite:
        print(listing())
        return 0 if args.list else 2
    _, parts = SUITES[args.suite]
    names = [part for part, _, _ in parts]
    unknown = [p for p in args.part or () if p not in names]
    if unknown:
        parser.error(f"suite {args.suite} has no part {unknown[0]!r}; its parts: {', '.join(names)}")
    chosen = [p for p in parts if not args.part or p[0] in args.part]
    status = 0
    for index, (part, script, arguments) in enumerate(chosen):
        argv_ = command(script, arguments, extra, args.keep)
        print(f"== {args.suite}/{part}: {shown(argv_)}", flush=True)
        if args.dry_run:
            continue
        if index:
            settle()
        code = subprocess.run(argv_, cwd=os.path.dirname(HERE), check=False).returncode
        if code and not status:
            status = code
            print(f"== {args.suite}/{part} failed with exit status {code}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
