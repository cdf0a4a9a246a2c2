"""lm-eval speed: gpt_local's `gptlocal` model against lm-eval's own `hf` backend on the same exported weights
(`gptlocal convert ms2hf`), same tasks, same run, explicit thread counts.

    python benchmarks/eval_throughput.py                       # GPT-2 small shape, 2 threads, 3 ABAB rounds
    python benchmarks/eval_throughput.py --shape tiny --rounds 3 --threads 2 --limit 8

Each measurement is its own worker process started with an explicit env (OMP_NUM_THREADS, MKL_NUM_THREADS,
OPENBLAS_NUM_THREADS = --threads; `import mindspore` sets OMP_NUM_THREADS=1 in the C environment, which
children would inherit otherwise); every worker checks them in its C environment, sets torch's (and
MindSpore's) thread count to the same, and prints them with its peak RSS (benchmarks/_common.py). A worker
times a **cold** run as a user sees one (`lm_eval --model ...` end to end: its imports, the model load and
lm_eval.simple_evaluate on --limit documents, our graph compiles included), then a **warm** run of the same
documents in the same process (graphs compiled, torch warm). Sides alternate (ours, hf, hf, ours, ...) for
--rounds rounds per task; the table gives requests/s medians and min-max of both, the cold run's parts
(imports, model load, first evaluate; for ours also the graph compiles it made) and each side's peak RSS
(VmHWM; per worker also after each step). Each round ours runs twice over a new compile-cache folder (as
`gptlocal eval`, whose default is on): **first-ever cold** (its columns "ours cold") and **cached cold** (a second
process loading the graphs the first one stored: the scoring graphs and generate's, runtime/graph_cache.py);
`--no-compile-cache`: once, without it. Ours' worker also prints VmRSS after each call that compiled (or loaded)
a graph ("graphs": the call, the process's compiled graph count, VmRSS MB), where its memory goes. Ours runs as `gptlocal eval` does: no torch in the process (it prints
whether torch got imported), no torch seed, lm-eval's env info without torch (evaluation/run.py). Tasks: gl_choice (multiple choice, 4 loglikelihood requests a document) and gl_until
(generate_until, stop "\\n", max_gen_toks 8) from benchmarks/eval_tasks.py, --docs documents each.
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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
    started = time.perf_counter()  # cold: from here (the interpreter is up) to the first results
    env = C.check_threads(args.threads, f"{args.worker} eval worker")
    if args.worker == "ours":
        # as `gptlocal eval` in its own process: no MindFormers, no torch (the harness never imports it)
        threads = {"mindspore": C.mindspore_threads(args.threads, "ours eval worker"), **env}
    else:
        threads = {"torch": C.torch_threads(args.threads, f"{args.worker} eval worker"), **env}
    if args.work == "-":  # the threads checked, nothing measured (tests/tools/test_benchmarks.py)
        return C.emit({"env": env, "runtime_threads": threads.get("mindspore", threads.get("torch"))})
    import lm_eval
    from lm_eval.tasks import TaskManager
    manager = TaskManager(include_path=os.path.join(args.work, "tasks"))
    if args.worker == "ours":
        from mindformers_gptlocal.evaluation.harness import GPTLocalLM, import_transformers_without_torch
        from mindformers_gptlocal.evaluation.run import env_info_without_torch
        import_transformers_without_torch()  # as run_eval in gptlocal eval's own process
        lean, seeds = env_info_without_torch(), {"torch_random_seed": None}  # as run_eval: torch never imported
    else:
        import contextlib
        from lm_eval.api.registry import get_model
        lean, seeds = contextlib.nullcontext(), {}
    imported = time.perf_counter()
    rss = {"imported": C.vm_hwm_mb()}
    if args.worker == "ours":
        model = GPTLocalLM(pretrained=os.path.join(args.work, "ms"), batch_size=args.batch_size, progress=False,
                           compile_cache=args.compile_cache or "off")
    else:
        model = get_model("hf")(pretrained=os.path.join(args.work, "ref"), batch_size=args.batch_size, device="cpu",
                                dtype="float32")
    loaded = time.perf_counter()
    rss["loaded"] = C.vm_hwm_mb()
    graphs = []
    if args.worker == "ours":
        trace_graphs(model, graphs)
    runs = {}
    with lean:
        for run in ("cold", "warm"):
            start = time.perf_counter()
            out = lm_eval.simple_evaluate(model=model, tasks=[args.task], task_manager=manager, limit=args.limit,
                                          log_samples=True, **seeds)
            runs[run] = time.perf_counter() - start
            rss[run] = C.vm_hwm_mb()
    requests = sum(len(s["arguments"]) for s in out["samples"][args.task])
    compiles = getattr(model, "compiled_shapes", lambda: None)()
    return C.emit({"side": args.worker, "task": args.task, "requests": requests,
                   "cold_seconds": loaded - started + runs["cold"], "import_seconds": imported - started,
                   "load_seconds": loaded - imported, "first_eval_seconds": runs["cold"],
                   "warm_seconds": runs["warm"], "compiles": compiles, "threads": threads,
                   "torch_imported": "torch" in sys.modules, "peak_rss_steps_mb": rss, "graphs": graphs,
                   "peak_rss_mb": C.vm_hwm_mb()})


def trace_graphs(model, graphs):
    """Record [call, compiled graphs in the process, VmRSS MB] after each scoring or generate call of ``model``
    (a GPTLocalLM) that added a graph (MindSpore's per-Cell compile sets, ``cells_compile_cache``), the compile's
    freed heap handed back first (as the harness does right after such a call: ``release_freed_heap``)."""
    from mindspore.common import api
    from mindformers_gptlocal.host_memory import release_freed_heap

    def count():
        return sum(len(phases) for phases in api.cells_compile_cache.values())

    def traced(owner, name, label):
        original = getattr(owner, name)

        def call(*a, **k):
            before = count()
            out = original(*a, **k)
            if count() != before:
                release_freed_heap()
                graphs.append([label, count(), round(C.rss_mb())])
            return out
        setattr(owner, name, call)
    graphs.append(["loaded", count(), round(C.rss_mb())])
    traced(model, "_score", "score")
    traced(model.model, "generate", "generate")


def measure(args, side, task, round_index=0):
    """One worker; for ours two, over one new compile-cache folder: the first-ever cold run, then a cached cold
    run (a second process loading the scoring graphs the first wrote), the second as ``r["cached"]``."""
    if side == "ours" and not args.no_cache:
        folder = os.path.join(args.work, f"compile-cache-{task}-{round_index}-{os.getpid()}")
        shutil.rmtree(folder, ignore_errors=True)
        first = run_one(args, side, task, folder, "first-ever")
        first["cached"] = run_one(args, side, task, folder, "cached")
        return first
    return run_one(args, side, task, None, "")


def run_one(args, side, task, cache, label):
    r, _ = C.run_worker(__file__, ["--worker", side, "--task", task, "--work", args.work, "--threads",
                                   str(args.threads), "--limit", str(args.limit), "--docs", str(args.docs),
                                   "--batch-size", str(args.batch_size)] + (["--compile-cache", cache] if cache else []),
                        args.threads, timeout=3600)
    print(f"  {side + (' ' + label if label else ''):15} {task:9} cold {r['requests'] / r['cold_seconds']:7.2f} requests/s ({r['cold_seconds']:.1f} s: "
          f"import {r['import_seconds']:.1f}, load {r['load_seconds']:.1f}, "
          f"first evaluate {r['first_eval_seconds']:.1f}"
          f"{'' if r['compiles'] is None else ', compiled shapes ' + str(r['compiles'])}); warm "
          f"{r['requests'] / r['warm_seconds']:7.2f} requests/s ({r['requests']} in {r['warm_seconds']:.1f} s); "
          f"peak RSS {r['peak_rss_mb']:.0f} MB (after imports, load, cold, warm: "
          f"{', '.join(f'{v:.0f}' for v in r['peak_rss_steps_mb'].values())}); torch imported "
          f"{r['torch_imported']}; threads {r['threads']}"
          f"{'; graphs (call, count, VmRSS MB) ' + str(r['graphs']) if r.get('graphs') else ''}", flush=True)
    return r


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="small", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--limit", type=int, default=16, help="documents evaluated per task")
    parser.add_argument("--docs", type=int, default=24, help="documents written per task (eval_tasks.py)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--work", help="reuse a set-up folder (default: a new temporary one)")
    parser.add_argument("--no-compile-cache", dest="no_cache", action="store_true",
                        help="ours without the compile cache (default: each round ours runs twice over a new cache "
                             "folder, first-ever cold then cached cold, as `gptlocal eval` does by default)")
    parser.add_argument("--compile-cache", help=argparse.SUPPRESS)  # a worker's folder
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
        subprocess.run([sys.executable, "-c", code], env=C.worker_env(args.threads), cwd=tempfile.gettempdir(),
                       check=True)
    tasks = os.path.join(args.work, "tasks")
    code = (f"import sys; sys.path.insert(0, {HERE!r}); from eval_tasks import write_tasks; "
            f"write_tasks({tasks!r}, {args.docs})")
    subprocess.run([sys.executable, "-c", code], check=True)  # --docs documents a task (cheap: JSONL + YAML)
    rates = {}
    for task in args.tasks.split(","):  # per task: ours, hf, hf, ours, ... (alternating)
        found = C.alternate(("ours", "hf"), args.rounds,
                            lambda side, index, task=task: measure(args, side, task, index))
        rates.update({(side, task): found[side] for side in found})
    print(f"\n{C.machine_line(args.threads)}")
    print(f"{args.shape} shape, batch {args.batch_size}, {args.limit} documents a task, {args.rounds} rounds, sides "
          f"alternating; requests/s median [min-max] over rounds. cold = one process end to end (imports, model load, "
          f"first simple_evaluate: our compiles included); warm = simple_evaluate again in that process\n")
    print("| task | requests | ours cold | hf cold | ours/hf cold | ours cached cold | ours cached/hf cold | "
          "ours warm | hf warm | ours/hf warm | ours cold parts s (import, load, evaluate) | hf cold parts s | "
          "peak RSS ours / cached / hf MB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | ---: |")
    for task in args.tasks.split(","):
        ours, hf = rates[("ours", task)], rates[("hf", task)]
        row = [f"{task} ({TASKS.get(task, '')})", str(ours[0]["requests"])]
        cached = [r["cached"]["requests"] / r["cached"]["cold_seconds"] for r in ours if "cached" in r]
        for key in ("cold_seconds", "warm_seconds"):
            a = [r["requests"] / r[key] for r in ours]
            b = [r["requests"] / r[key] for r in hf]
            row += [C.spread(a, "{:.2f}"), C.spread(b, "{:.2f}"), f"{statistics.median(a) / statistics.median(b):.2f}x"]
            if key == "cold_seconds":
                row += [C.spread(cached, "{:.2f}") if cached else "-",
                        f"{statistics.median(cached) / statistics.median(b):.2f}x" if cached else "-"]
        for side in (ours, hf):
            row.append(", ".join(f"{statistics.median(r[k] for r in side):.1f}"
                                 for k in ("import_seconds", "load_seconds", "first_eval_seconds")))
        cached_rss = [r["cached"]["peak_rss_mb"] for r in ours if "cached" in r]
        row.append(f"{statistics.median(r['peak_rss_mb'] for r in ours):.0f} / "
                   f"{statistics.median(cached_rss) if cached_rss else float('nan'):.0f} / "
                   f"{statistics.median(r['peak_rss_mb'] for r in hf):.0f}")
        print("| " + " | ".join(row) + " |")
    for task in args.tasks.split(","):
        print(f"ours' compiled shapes, {task} (first round): {rates[('ours', task)][0]['compiles']}")


if __name__ == "__main__":
    main()
