"""lm-eval speed: gpt_local's `gptlocal` model against lm-eval's own `hf` backend on the same exported weights
(`gptlocal convert ms2hf`), same tasks, same run, explicit thread counts.

    python benchmarks/eval_throughput.py                       # GPT-2 small shape, 2 threads, 3 ABAB rounds
    python benchmarks/eval_throughput.py --shape tiny --rounds 3 --threads 2 --limit 8

Each measurement is its own worker process started with an explicit env (OMP_NUM_THREADS, MKL_NUM_THREADS,
OPENBLAS_NUM_THREADS = --threads; `import mindspore` sets OMP_NUM_THREADS=1 in the C environment, which
children would inherit otherwise); every worker checks them in its C environment, sets torch's (and
MindSpore's) thread count to the same, and prints them with its peak RSS (benchmarks/_common.py). The worker evaluates
the task once on the same --limit documents (compiles our graphs for those shapes; warms torch), then times
lm_eval.simple_evaluate on them again. Sides alternate (ours, hf, hf, ours, ...) for --rounds rounds per task; the table
gives requests/s medians and min-max. Tasks: gl_choice (multiple choice, 4 loglikelihood requests a
document) and gl_until (generate_until, stop "\\n", max_gen_toks 8) from benchmarks/eval_tasks.py.
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)
SHAPES = {"tiny": dict(vocab_size=512, n_positions=256, n_embd=256, n_layer=4, n_head=4),
          "small": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12)}
TASKS = {"gl_choice": "multiple choice", "gl_until": "generate_until"}


def setup(work, shape):
    """Tokenizer (prepare-data), a random GPT-2 with it, `hf2ms` -> ours, `ms2hf` -> the reference, the tasks."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms, ms_to_hf
    from mindformers_gptlocal.data.prepare import prepare
    sys.path.insert(0, HERE)
    from eval_tasks import write_tasks
    data = prepare(out=os.path.join(work, "data"), seq_length=64, vocab_size=512, max_bytes=150_000,
                   eval_fraction=0.1)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(bos_token_id=0, eos_token_id=0, **SHAPES[shape])).save_pretrained(
        os.path.join(work, "hf0"))
    for name in os.listdir(data["model_dir"]):
        if name != "config.json":
            shutil.copyfile(os.path.join(data["model_dir"], name), os.path.join(work, "hf0", name))
    hf_to_ms(os.path.join(work, "hf0"), os.path.join(work, "ms"))
    ms_to_hf(os.path.join(work, "ms"), os.path.join(work, "ref"))
    write_tasks(os.path.join(work, "tasks"))


def worker(args):
    env = C.check_threads(args.threads, f"{args.worker} eval worker")
    threads = {"torch": C.torch_threads(args.threads, f"{args.worker} eval worker"), **env}
    if args.worker == "ours":
        os.environ.setdefault("GPTLOCAL_LEAN", "1")  # as `gptlocal eval` in its own process: no MindFormers
        threads["mindspore"] = C.mindspore_threads(args.threads, "ours eval worker")
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=os.path.join(args.work, "tasks"))
    if args.worker == "ours":
        from mindformers_gptlocal.evaluation.harness import GPTLocalLM
        model = GPTLocalLM(pretrained=os.path.join(args.work, "ms"), batch_size=args.batch_size, progress=False)
    else:
        from lm_eval.api.registry import get_model
        model = get_model("hf")(pretrained=os.path.join(args.work, "ref"), batch_size=args.batch_size, device="cpu",
                                dtype="float32")
    lm_eval.simple_evaluate(model=model, tasks=[args.task], task_manager=manager, limit=args.limit,
                            log_samples=False)  # warm-up on the same documents: compile / caches, untimed
    start = time.perf_counter()
    out = lm_eval.simple_evaluate(model=model, tasks=[args.task], task_manager=manager, limit=args.limit,
                                  log_samples=True)
    seconds = time.perf_counter() - start
    requests = sum(len(s["arguments"]) for s in out["samples"][args.task])
    print("RESULT " + json.dumps({"side": args.worker, "task": args.task, "requests": requests, "seconds": seconds,
                                  "threads": threads, "peak_rss_mb": C.vm_hwm_mb()}), flush=True)


def measure(args, side, task):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--task", task, "--work", args.work,
           "--threads", str(args.threads), "--limit", str(args.limit),
           "--batch-size", str(args.batch_size)]
    proc = subprocess.run(cmd, env=C.worker_env(args.threads), capture_output=True, text=True, timeout=3600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"{side} {task} worker failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    print(f"  {side:4} {task:9} {result['requests'] / result['seconds']:8.2f} requests/s "
          f"({result['requests']} in {result['seconds']:.1f} s; peak RSS {result['peak_rss_mb']:.0f} MB; "
          f"threads {result['threads']})", flush=True)
    return result["requests"] / result["seconds"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=16, help="documents timed per task")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--work", help="reuse a set-up folder (default: a new temporary one)")
    parser.add_argument("--worker", choices=("ours", "hf"), help=argparse.SUPPRESS)
    parser.add_argument("--task", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    C.machine_line(args.threads)  # the load average before any worker runs
    if not args.work:
        args.work = C.scratch_dir("gptlocal-evalspeed-")
    if not os.path.isdir(os.path.join(args.work, "ref")):
        code = (f"import sys; sys.path.insert(0, {HERE!r}); from eval_throughput import setup; "
                f"setup({args.work!r}, {args.shape!r})")
        subprocess.run([sys.executable, "-c", code], env=C.worker_env(args.threads), check=True)
    rates = {}
    for task in args.tasks.split(","):  # per task: ours, hf, hf, ours, ... (alternating)
        found = C.alternate(("ours", "hf"), args.rounds, lambda side, _, task=task: measure(args, side, task))
        rates.update({(side, task): found[side] for side in found})
    print(f"\n{C.machine_line(args.threads)}")
    print(f"{args.shape} shape, batch {args.batch_size}, {args.limit} documents timed, {args.rounds} rounds, sides "
          f"alternating; requests/s median [min-max] over rounds\n")
    print("| task | ours requests/s | lm-eval hf requests/s | ours/hf |")
    print("| --- | ---: | ---: | ---: |")
    for task in args.tasks.split(","):
        ours, hf = rates[("ours", task)], rates[("hf", task)]
        print(f"| {task} ({TASKS.get(task, '')}) | {C.spread(ours, '{:.2f}')} | {C.spread(hf, '{:.2f}')} | "
              f"{statistics.median(ours) / statistics.median(hf):.2f}x |")

if __name__ == "__main__":
    main()
