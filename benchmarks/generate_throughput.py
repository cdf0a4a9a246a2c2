"""Generation speed of gpt_local's KV cache against Hugging Face GPT-2 `generate` (PyTorch, with its
cache), same weights, same prompts, same machine, same run.

    python benchmarks/generate_throughput.py                      # tiny and GPT-2 small, batch 1 and 8
    python benchmarks/generate_throughput.py --shapes tiny --batches 1

For each shape a random HF GPT-2 is saved and converted with `gptlocal convert hf2ms`. Prompts are
32 random tokens, 128 new tokens, greedy (no EOS). Time to first token (TTFT) = the prefill call;
decode tokens/s = batch x (new tokens - 1) / time after the first token; the TTFT is the median of TTFT_CALLS
calls. Each side gets one warm-up generation first (ours compiles its prefill and decode graphs there; the
compile time is printed). Also reported: our cache against our own recomputation of the whole sequence per token.

Each measurement is its own worker process, started with an explicit environment (OMP_NUM_THREADS =
MKL_NUM_THREADS = OPENBLAS_NUM_THREADS = --threads) that it checks in its C environment before importing
anything; torch.set_num_threads / MindSpore's runtime_num_threads get the same count, and each worker
reports them and its peak RSS (benchmarks/_common.py). The sides run alternately (ours, HF, HF, ours, ...)
for --rounds rounds per shape and batch; the table gives the median over rounds and [min-max].

    python benchmarks/generate_throughput.py --kernels-vs-plain --shapes small --batches 1,8 --cache-lengths 256,2048

``--kernels-vs-plain``: in ONE worker, the same random model twice (same seed, so the same weights): once as
``generate`` runs it (the prefill through the fused CPU attention kernel, ``KVCache.prefill``) and once plain
(``KVCache.step`` for the prefill, model_config.cpu_kernels {linear: plain}); the calls alternate for --rounds
rounds. Prints the prefill (32-token prompts, cache of 160 rows) and one decode step at each --cache-lengths (at the
last row and at the middle one, to show that masked rows are not read), wall (median [min]) and the process's CPU
time (median), plain / kernels, and the largest logit difference. The kernels side runs its Linears and head as
``generate`` does by default (cpu_kernels {linear: auto}: the GEMM kernel in graphs of at least
``kernels.provider.LINEAR_GEMM_ROWS`` rows: the prefill, not the decode step), the plain side through MatMul;
``--linear-kernel always``: the kernels side's in every graph ({linear: kernel}), ``off``: MatMul too
({linear: plain}).

``--sides ours,ours-matmul,hf``: ours-matmul is ours with model_config.cpu_kernels {linear: plain} (every Linear and
the head on MindSpore's MatMul, the path before the GEMM kernel by row count), alternating with the others in the
same run.
"""
import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)

SHAPES = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),
          "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)}
PROMPT, NEW = 32, 128
TTFT_CALLS = 5  # TTFT: the median of this many calls on each side (one call swung 2x on a loaded machine)
SIDES = ("ours", "ours-mf", "ours-matmul", "ours-cached", "hf")
# model_config.cpu_kernels given to from_pretrained (ours-matmul: every Linear and the head on MatMul); the other
# sides keep the converted folder's (auto), as gptlocal generate runs it
SIDE_KERNELS = {"ours-matmul": {"linear": "plain"}}
# --linear-kernel -> the kernels side's cpu_kernels of kernels_vs_plain (the plain side: {linear: plain})
LINEAR_KERNEL = {"rows": "auto", "always": "kernel", "off": "plain"}


def timed_ours(model, prompts, use_past):
    """(ttft, total) seconds of one greedy generation (after a warm-up call of the same shape)."""
    model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past)
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past)
    total = time.perf_counter() - start
    if use_past:  # TTFT: the prefill call of the cache that generation used (compiled by the warm-up)
        cache = model.kv_cache(len(prompts), PROMPT + NEW)
        return C.median([C.timed(lambda: cache.prefill(prompts)) for _ in range(TTFT_CALLS)]), total
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, do_sample=False, use_past=use_past)
    return time.perf_counter() - start, total


def timed_hf(model, prompts):
    import torch
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ttft = C.median([C.timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                                         pad_token_id=0)) for _ in range(TTFT_CALLS)])
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, use_cache=True)
        total = time.perf_counter() - start
    assert out.shape[1] == PROMPT + NEW
    return ttft, total


def decode_rate(batch, ttft, total):
    return batch * (NEW - 1) / max(total - ttft, 1e-9)


def setup(work, shape):
    """A random HF GPT-2 of ``shape`` saved under work/shape, converted to ours under work/shape_ms."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=1024, **SHAPES[shape])).save_pretrained(os.path.join(work, shape))
    hf_to_ms(os.path.join(work, shape), os.path.join(work, shape + "_ms"))


def worker(side, work, shape, batch, threads, recompute):
    """One side's numbers for one shape and batch; prints a WORKER line. ``phases``: each phase's own peak RSS
    (MB; VmHWM reset at the phase's start): import, build + load, the first generation (our compiles), the timed
    generations, and (``recompute``) our no-cache path; ``peak_rss_mb`` is generate's peak, without the no-cache
    path's full-width compiles (before, they counted in the tiny rows' peak)."""
    env = C.check_threads(threads, f"{side} generate worker")
    # PyTorch only where it runs: importing it into our side would add its ~180 MB to our peak RSS
    report = {"env": env, "torch_threads": C.torch_threads(threads, f"{side} generate worker") if side == "hf"
              else "not loaded"}
    prompts = np.random.default_rng(batch).integers(0, SHAPES[shape]["vocab_size"], (batch, PROMPT)).tolist()
    phases = C.Phases()  # each phase's own peak RSS (VmHWM reset at its start) and the RSS after it
    if side == "hf":
        with phases("import"):
            from transformers import GPT2LMHeadModel
        with phases("load"):
            model = GPT2LMHeadModel.from_pretrained(os.path.join(work, shape)).eval()
        with phases("first_call"):
            timed_hf(model, prompts)  # warm-up
        with phases("timed"):
            ttft, total = timed_hf(model, prompts)
    else:  # ours: the model's own classes (gptlocal generate's: no MindFormers); ours-mf: MindFormers' classes
        import mindspore as ms
        report["runtime_threads"] = C.mindspore_threads(threads, "ours generate worker")
        ms.set_context(mode=ms.GRAPH_MODE)
        with phases("import"):
            if side == "ours-mf":
                from mindformers_gptlocal import GPTLocalForCausalLM
            else:
                from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
        report["mindformers_loaded"] = "mindformers" in sys.modules
        with phases("load"):
            model_dir = os.path.join(work, shape + "_ms")
            kernels = {"cpu_kernels": SIDE_KERNELS[side]} if side in SIDE_KERNELS else {}
            model = GPTLocalForCausalLM.from_pretrained(model_dir, max_batch_size=max(8, batch), **kernels)
        if side == "ours-cached":  # as gptlocal generate's --compile-cache: round 1 stores, later rounds load
            from mindformers_gptlocal.runtime.graph_cache import attach
            attach(model, os.path.join(work, "compile-cache"), model_dir)
        with phases("first_call"):
            start = time.perf_counter()
            model.generate(prompts, max_new_tokens=NEW, do_sample=False)  # compiles prefill + decode
            report["first_call_s"] = time.perf_counter() - start
        with phases("timed"):
            ttft, total = timed_ours(model, prompts, True)
        if recompute:  # our no-cache path compiles full-width forwards: its own phase, not generate's peak
            with phases("recompute"):
                n_ttft, n_total = timed_ours(model, prompts, False)
            report["nocache_rate"] = decode_rate(batch, n_ttft, n_total)
            report["recompute_peak_rss_mb"] = phases.peaks["recompute"]
    if side != "hf" and "torch" in sys.modules:
        raise SystemExit("ours generate worker: PyTorch was imported (it would count in our peak RSS)")
    report.update(ttft=ttft, rate=decode_rate(batch, ttft, total), phases=phases.peaks, rss_after=phases.after,
                  peak_rss_mb=phases.peak(("import", "load", "first_call", "timed")), peak_resets=phases.resets)
    C.emit(report)


def kernels_vs_plain(shape, batch, lengths, rounds, threads, linear_kernel="rows"):
    """Prints kernels vs plain for the prefill and the decode step, in this process (``--kernels-vs-plain``)."""
    import mindspore as ms
    from mindformers_gptlocal.runtime.buckets import bucket_of
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    from mindformers_gptlocal.runtime.runner import prefill_inputs
    C.mindspore_threads(threads, "kernels-vs-plain worker")
    ms.set_context(mode=ms.GRAPH_MODE)
    sizes = SHAPES[shape]
    config = dict(vocab_size=sizes["vocab_size"], hidden_size=sizes["n_embd"], num_hidden_layers=sizes["n_layer"],
                  num_attention_heads=sizes["n_head"], max_position_embeddings=max(1024, *lengths),
                  seq_length=max(1024, *lengths), hidden_dropout=0.0, attention_dropout=0.0, max_batch_size=8)

    def built(plain):  # the plain prefill is KVCache.step (below); the plain side's Linears and head on MatMul
        linear = "plain" if plain else LINEAR_KERNEL[linear_kernel]
        ms.set_seed(0)
        model = GPTLocalForCausalLM(GPTLocalConfig(**config, cpu_kernels={"linear": linear}))
        model.set_train(False)
        return model

    models = {"kernels": built(False), "plain": built(True)}

    def compare(what, calls):
        outputs = {side: call() for side, call in calls.items()}  # compiles
        times = {side: [] for side in calls}
        for index in range(rounds):
            for side in (("kernels", "plain") if index % 2 == 0 else ("plain", "kernels")):
                wall, cpu = time.perf_counter(), time.process_time()
                calls[side]()
                times[side].append((time.perf_counter() - wall, time.process_time() - cpu))
        k, p = np.array(times["kernels"]) * 1e3, np.array(times["plain"]) * 1e3
        print(f"| {shape} | {batch} | {what} | {np.median(k[:, 0]):.1f} [{k[:, 0].min():.1f}] | "
              f"{np.median(p[:, 0]):.1f} [{p[:, 0].min():.1f}] | {np.median(k[:, 1]):.1f} | {np.median(p[:, 1]):.1f} | "
              f"{p[:, 0].min() / k[:, 0].min():.2f}x, {np.median(p[:, 1]) / np.median(k[:, 1]):.2f}x | "
              f"{np.abs(outputs['kernels'] - outputs['plain']).max():.1e} | {os.getloadavg()[0]:.1f} |", flush=True)

    prompts = np.random.default_rng(batch).integers(0, sizes["vocab_size"], (batch, PROMPT)).tolist()
    caches = {side: model.kv_cache(batch, PROMPT + NEW) for side, model in models.items()}
    width = bucket_of(PROMPT, caches["plain"].widths)
    ids, positions, lengths_ = prefill_inputs(prompts, batch, 0, width)
    compare(f"prefill {PROMPT} tokens, cache {caches['plain'].max_length}",
            {"kernels": lambda: caches["kernels"].prefill(prompts),
             "plain": lambda: caches["plain"].step(ids, positions, lengths_ - 1)})
    tokens = np.ones(batch, np.int32)
    for length in lengths:
        caches = {side: model.kv_cache(batch, length) for side, model in models.items()}
        for at in (length - 1, length // 2):
            where = np.full(batch, at, np.int32)
            compare(f"decode step, cache {length}, position {at}",
                    {side: (lambda c=cache: c.decode(tokens, where)) for side, cache in caches.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--recompute-shapes", default="tiny",
                        help="shapes that also time our no-cache path (slow: a full forward per token)")
    parser.add_argument("--sides", default="ours,hf",
                        help="ours (the model's own classes, as gptlocal generate: no MindFormers), ours-mf (the "
                             "model on MindFormers' bases, mindformers_gptlocal.GPTLocalForCausalLM), ours-matmul "
                             "(ours with model_config.cpu_kernels {linear: plain}: MatMul in every Linear), ours-cached (ours "
                             "through a compile-cache folder of this run, as gptlocal generate's default --compile-cache: "
                             "round 1 compiles and stores, later rounds load), hf")
    parser.add_argument("--kernels-vs-plain", action="store_true",
                        help="in one worker: prefill and decode step through the CPU kernels vs plain")
    parser.add_argument("--cache-lengths", default="256,1024,2048", help="decode cache lengths (--kernels-vs-plain)")
    parser.add_argument("--linear-kernel", choices=("rows", "always", "off"), default="rows",
                        help="--kernels-vs-plain: the kernels side's Linears and head on the GEMM kernel in graphs of "
                             "many rows (rows: cpu_kernels {linear: auto}, the default), in every graph (always: "
                             "{linear: kernel}) or never (off: {linear: plain}); the plain side's always on MatMul")
    parser.add_argument("--kvp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.work, args.shape, args.batch, args.threads, args.recompute)
    lengths = [int(x) for x in args.cache_lengths.split(",")]
    if args.kvp_worker:
        C.check_threads(args.threads, "kernels-vs-plain worker")
        return kernels_vs_plain(args.shape, args.batch, lengths, args.rounds, args.threads, args.linear_kernel)
    if args.kernels_vs_plain:
        print(C.machine_line(args.threads), flush=True)
        print("| shape | batch | call | kernels wall ms | plain wall ms | kernels CPU ms | plain CPU ms | "
              "plain / kernels (wall min, CPU) | max abs logit diff | 1-min load |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
        import subprocess
        for shape in args.shapes.split(","):
            for batch in (int(b) for b in args.batches.split(",")):
                subprocess.run([sys.executable, __file__, "--kvp-worker", "--shapes", shape, "--shape", shape,
                                "--batch", str(batch), "--rounds", str(args.rounds), "--threads", str(args.threads),
                                "--cache-lengths", args.cache_lengths,
                                "--linear-kernel", args.linear_kernel],
                               env=C.worker_env(args.threads), check=True)
        return None
    work = C.scratch_dir("gptlocal-gen-")
    print(C.machine_line(args.threads), flush=True)
    rows = []
    for shape in args.shapes.split(","):
        import subprocess
        subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); "
                        f"from generate_throughput import setup; setup({work!r}, {shape!r})"],
                       env=C.worker_env(args.threads), check=True, capture_output=True)
        for batch in (int(b) for b in args.batches.split(",")):
            def one(side, index, shape=shape, batch=batch):
                extra = ["--recompute"] if side.startswith("ours") and shape in args.recompute_shapes.split(",") else []
                report, _ = C.run_worker(__file__, ["--worker", side, "--work", work, "--shape", shape, "--batch",
                                                    str(batch), "--threads", str(args.threads), *extra], args.threads)
                phases = ", ".join(f"{k} {v:.0f}" for k, v in report["phases"].items())
                print(f"{shape} batch {batch} round {index + 1} {side:7}: {report['rate']:.1f} tok/s, TTFT "
                      f"{report['ttft']:.3f} s, peak RSS {report['peak_rss_mb']:.0f} MB (each phase's own peak: "
                      f"{phases}"
                      f"{'' if report['peak_resets'] else '; VmHWM not resettable here: cumulative'}), "
                      f"threads: C env "
                      f"{report['env']}, torch {report['torch_threads']}"
                      + (f", MindSpore {report['runtime_threads']}, first call {report['first_call_s']:.1f} s"
                         if side != "hf" else ""), flush=True)
                return report
            sides = tuple(args.sides.split(","))
            unknown = [x for x in sides if x not in SIDES]
            if unknown or "hf" not in sides or len(sides) < 2:
                raise SystemExit(f"--sides {args.sides}: give hf and one or more of ours, ours-mf, ours-matmul, "
                                 f"ours-cached")
            runs = C.alternate(sides, args.rounds, one)
            rows.append((shape, batch, runs))
    print(f"\n{C.machine_line(args.threads)}")
    print(f"{PROMPT}-token prompts, {NEW} new tokens, greedy, fp32; {args.rounds} rounds, sides alternating, each "
          f"in its own worker; median [min-max] over rounds; peak RSS = generate's (import, load, first call, timed "
          f"calls), without our no-cache path's compiles (given apart where it ran)\n")
    print("| shape | batch | side | decode tok/s | vs HF | TTFT s | TTFT vs HF | cache/no-cache | first call s "
          "| peak RSS MB | RSS vs HF | each phase's peak MB: import / load / first call / timed |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for shape, batch, runs in rows:
        hf = runs["hf"]
        hf_rate, hf_ttft = C.median([r["rate"] for r in hf]), C.median([r["ttft"] for r in hf])
        hf_rss = C.median([r["peak_rss_mb"] for r in hf])
        for side, reports in runs.items():
            rate, ttft = C.median([r["rate"] for r in reports]), C.median([r["ttft"] for r in reports])
            rss = C.median([r["peak_rss_mb"] for r in reports])
            nocache = C.median([r.get("nocache_rate") for r in reports])
            first = C.median([r.get("first_call_s") for r in reports])
            nocache_rss = C.median([r.get("recompute_peak_rss_mb") for r in reports])
            phases = " / ".join(f"{C.median([r['phases'][k] for r in reports]):.0f}"
                                for k in ("import", "load", "first_call", "timed"))
            print(f"| {shape} | {batch} | {side} | {C.spread([r['rate'] for r in reports], '{:.1f}')} | "
                  f"{rate / hf_rate:.2f}x | {ttft:.3f} | {ttft / hf_ttft:.2f}x | "
                  f"{f'{rate / nocache:.1f}x (its peak {nocache_rss:.0f} MB)' if nocache else '-'} | "
                  f"{f'{first:.1f}' if first else '-'} | "
                  f"{rss:.0f} | {rss / hf_rss:.2f}x | {phases} |")


if __name__ == "__main__":
    main()
