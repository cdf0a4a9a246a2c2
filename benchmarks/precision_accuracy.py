"""Accuracy of bfloat16 and int8 against fp32, on the quickstart's tiny model and its held-out data: logits,
greedy continuations and perplexity of the same weights in each precision, and bf16 training's loss against fp32's.

    bash run_scripts/quickstart.sh                         # once: runs/quickstart (its data, the trained tiny model)
    python benchmarks/precision_accuracy.py                # both parts below on runs/quickstart
    python benchmarks/precision_accuracy.py --make         # run `gptlocal quickstart` first where it has not run
    python benchmarks/precision_accuracy.py --what inference --model DIR --data EVAL.mindrecord

``--what inference`` (in one worker, the models side by side, batch by batch): the model directory (default the
quickstart's ``train/model``) loaded three ways: fp32 as it is, bf16 as ``from_pretrained(dir,
compute_dtype="bfloat16")``, int8 as the directory ``mindformers_gptlocal.quantize.quantize_model(dir, out, "int8")``
writes (``gptlocal quantize``; or ``--int8-dir``). On the held-out MindRecord (default the quickstart's
``data/eval.mindrecord``, every row unless ``--max-rows``): the largest and the mean absolute difference of each
precision's logits from fp32's, how often their top-1 token agrees, and the perplexity (its relative difference from
fp32's; targets: bf16 within 1%, int8 within 2%). Greedy generation of ``--new`` (128) tokens, no end token, from
``--prompts`` (32) prompts of ``--prompt-tokens`` (32) tokens cut evenly from the held-out tokens: the share of the
generated tokens equal to fp32's at the same position, the mean length of the common start, and how many
continuations are identical.

``--what train``: the quickstart's training (its ``train.yaml``, the quickstart's steps) run twice through
``gptlocal run``: as it is (fp32) and with ``--model.model_config.compute_dtype bfloat16``; the losses its log
prints (every 20 steps and the last) compared (target: the last within 1% of fp32's).

A precision that does not run in this tree or on this CPU is given as one line (its error) and left out of its
table; the machine line names the CPU's bf16 / int8 instructions. Prints markdown tables.
"""
import argparse
import json
import os
import re
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402  (benchmarks/ is not a package)

PRECISIONS = ("bf16", "int8")
TARGETS = {"bf16": 0.01, "int8": 0.02}  # perplexity within this relative difference of fp32's
TRAIN_TARGET = 0.01  # bf16 training's last loss within 1% of fp32's
BF16 = {"compute_dtype": "bfloat16"}


# ---------------------------------------------------------------------------------------------- inference worker
def read_rows(path, max_rows):
    """The held-out MindRecord's rows: (input_ids, labels, loss_mask) int arrays [N, S]."""
    import numpy as np
    from mindspore.mindrecord import FileReader
    reader = FileReader(path)
    rows = []
    for row in reader.get_next():
        rows.append((row["input_ids"], row["labels"], row["loss_mask"]))
        if max_rows and len(rows) >= max_rows:
            break
    reader.close()
    if not rows:
        raise SystemExit(f"{path}: no rows")
    return tuple(np.stack([r[i] for r in rows]).astype(np.int64) for i in range(3))


def cut_prompts(input_ids, count, length):
    """``count`` prompts of ``length`` tokens, cut at even steps from the rows' tokens laid end to end."""
    import numpy as np
    stream = input_ids.reshape(-1)
    if len(stream) < length:
        raise SystemExit(f"the held-out data holds {len(stream)} tokens, fewer than one prompt of {length}")
    starts = np.linspace(0, len(stream) - length, count).astype(int)
    return [stream[s:s + length].tolist() for s in starts]


def token_nll(logits, labels, mask):
    """Summed negative log-likelihood of ``labels`` (already shifted) under ``logits`` [B, S, V] where ``mask``,
    and the count of those tokens."""
    import numpy as np
    top = logits.max(axis=-1, keepdims=True)
    lse = (top + np.log(np.exp(logits - top).sum(axis=-1, keepdims=True)))[..., 0]
    picked = np.take_along_axis(logits, np.maximum(labels, 0)[..., None], axis=-1)[..., 0]
    keep = mask.astype(bool) & (labels >= 0)
    return float((lse - picked)[keep].astype(np.float64).sum()), int(keep.sum())


def greedy_agreement(reference, other, prompt_length):
    """(share of generated tokens equal position by position, mean common-start length, identical count)."""
    equal, prefix, same = 0, 0, 0
    total = 0
    for ref, got in zip(reference, other):
        ref, got = ref[prompt_length:], got[prompt_length:]
        total += len(ref)
        equal += sum(a == b for a, b in zip(ref, got))
        start = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        prefix += start
        same += ref == got
    return equal / max(total, 1), prefix / max(len(reference), 1), same


def load_models(options, work):
    """{precision: model or its one-line failure}: fp32 (must load), bf16, int8 (quantized into ``work`` unless
    --int8-dir is given)."""
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    size = dict(max_batch_size=max(options["prompts"], options["batch"]))
    models = {"fp32": GPTLocalForCausalLM.from_pretrained(options["model"], **size)}
    for precision in options["precisions"]:
        try:
            if precision == "bf16":
                model = GPTLocalForCausalLM.from_pretrained(options["model"], **size, **BF16)
            else:
                folder = options["int8_dir"]
                if not folder:
                    from mindformers_gptlocal.quantize import quantize_model
                    folder = os.path.join(work, "int8")
                    quantize_model(options["model"], folder, "int8")
                model = GPTLocalForCausalLM.from_pretrained(folder, **size)
            models[precision] = model
        except Exception as err:  # pylint: disable=broad-except  (one line; the other precisions run)
            models[precision] = C.error_line(err)
    for model in models.values():
        if not isinstance(model, str):
            model.set_train(False)
    return models


def inference_worker(options):
    """Worker body: the inference comparison (``--what inference``); emits each precision's figures. ``model`` "-":
    the threads checked, nothing measured (tests/tools/test_benchmarks.py)."""
    env = C.check_threads(options["threads"], "accuracy worker")
    runtime = C.mindspore_threads(options["threads"], "accuracy worker")
    if options.get("model") == "-":
        return C.emit({"env": env, "runtime_threads": runtime})
    import numpy as np
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)
    work = C.scratch_dir("gptlocal-accuracy-")
    input_ids, labels, loss_mask = read_rows(options["data"], options["max_rows"])
    models = load_models(options, work)
    failed = {p: m for p, m in models.items() if isinstance(m, str)}
    live = {p: m for p, m in models.items() if not isinstance(m, str)}
    stats = {p: dict(max_diff=0.0, sum_diff=0.0, values=0, top1=0, positions=0, nll=0.0, tokens=0) for p in live}
    batch = options["batch"]
    for start in range(0, len(input_ids), batch):
        real = min(batch, len(input_ids) - start)
        rows = np.arange(start, start + batch).clip(max=len(input_ids) - 1)  # the last batch padded: one shape
        ids = ms.Tensor(input_ids[rows].astype(np.int32))
        logits = {}
        for precision, model in list(live.items()):
            try:
                logits[precision] = model(ids).asnumpy()[:real]
            except Exception as err:  # pylint: disable=broad-except  (e.g. a kernel this CPU cannot select)
                failed[precision] = C.error_line(err)
                del live[precision], stats[precision]
        reference = logits["fp32"]
        for precision, got in logits.items():
            figures = stats[precision]
            nll, tokens = token_nll(got, labels[start:start + real], loss_mask[start:start + real])
            figures["nll"] += nll
            figures["tokens"] += tokens
            diff = np.abs(got - reference)
            figures["max_diff"] = max(figures["max_diff"], float(diff.max()))
            figures["sum_diff"] += float(diff.astype(np.float64).sum())
            figures["values"] += diff.size
            figures["top1"] += int((got.argmax(-1) == reference.argmax(-1)).sum())
            figures["positions"] += got.shape[0] * got.shape[1]
    prompts = cut_prompts(input_ids, options["prompts"], options["prompt_tokens"])
    sequences = {}
    for precision, model in list(live.items()):
        try:
            sequences[precision] = model.generate(prompts, max_new_tokens=options["new"], do_sample=False,
                                                  eos_token_id=[])
        except Exception as err:  # pylint: disable=broad-except
            failed[precision] = C.error_line(err)
            del live[precision], stats[precision]
    results = {}
    for precision, figures in stats.items():
        agree, prefix, same = greedy_agreement(sequences["fp32"], sequences[precision], options["prompt_tokens"])
        results[precision] = dict(max_diff=figures["max_diff"], mean_diff=figures["sum_diff"] / figures["values"],
                                  top1=figures["top1"] / figures["positions"], tokens=figures["tokens"],
                                  perplexity=float(np.exp(figures["nll"] / figures["tokens"])),
                                  greedy_agreement=agree, common_prefix=prefix, identical=same)
    C.emit({"env": env, "runtime_threads": runtime, "rows": int(len(input_ids)), "results": results,
            "failed": failed, "peak_rss_mb": C.vm_hwm_mb()})
    return None


def inference_table(report, options):
    fp32 = report["results"]["fp32"]["perplexity"]
    new, prompts = options["new"], options["prompts"]
    print(f"held-out: {options['data']}, {report['rows']} rows, {report['results']['fp32']['tokens']:,} scored "
          f"tokens; model: {options['model']}; greedy: {prompts} prompts of {options['prompt_tokens']} tokens, {new} "
          f"new tokens, no end token\n")
    print(f"| precision | max abs logit diff | mean abs logit diff | top-1 agreement | greedy token agreement "
          f"({prompts} x {new}) | mean common start (of {new}) | identical continuations | perplexity | vs fp32 | "
          f"target |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for precision, r in report["results"].items():
        change = r["perplexity"] / fp32 - 1
        target = TARGETS.get(precision)
        verdict = (f"within {target:.0%}: {'yes' if abs(change) <= target else 'NO'}" if target else "reference")
        print(f"| {precision} | {r['max_diff']:.3g} | {r['mean_diff']:.3g} | {r['top1']:.2%} | "
              f"{r['greedy_agreement']:.2%} | {r['common_prefix']:.1f} | {r['identical']}/{prompts} | "
              f"{r['perplexity']:.3f} | {change:+.2%} | {verdict} |")
    for precision, reason in report["failed"].items():
        print(f"\n{precision}: not in the table: {reason}")


# ---------------------------------------------------------------------------------------------- training
def step_losses(text):
    """{step: loss} of GPTLocalThroughputMonitor's lines (``[gptlocal] step N/M  loss X``)."""
    return {int(step): float(loss) for step, loss in re.findall(r"\[gptlocal\] step (\d+)/\d+\s+loss (\S+)", text)}


def train_once(name, yaml_path, work, threads, extra=()):
    """``gptlocal run --config yaml_path`` into work/name (its log work/name.log): ({step: loss}, failure or None)."""
    log = os.path.join(work, name + ".log")
    command = [sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config", yaml_path,
               "--output_dir", os.path.join(work, name), *extra]
    with open(log, "w", encoding="utf-8") as handle:
        code = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, env=C.worker_env(threads),
                              cwd=work, check=False).returncode
    with open(log, encoding="utf-8", errors="replace") as handle:
        text = handle.read()
    losses = step_losses(text)
    if code or not losses:
        kept = f"log: {log}" if C.KEEP else "rerun with --keep to keep its log"
        return losses, f"{C.last_error_line(text, code)} ({kept})"
    return losses, None


def train_table(train_yaml, work, threads):
    """The quickstart's training in fp32 and in bf16; prints the comparison."""
    runs = {"fp32": train_once("train_fp32", train_yaml, work, threads)}
    runs["bf16"] = train_once("train_bf16", train_yaml, work, threads, ("--model.model_config.compute_dtype",
                                                                        "bfloat16"))
    fp32, failed = runs["fp32"]
    if failed:
        raise SystemExit(f"the fp32 training failed: {failed}")
    bf16, failed = runs["bf16"]
    print(f"training: {train_yaml} (the quickstart's) through gptlocal run, fp32 as it is, bf16 with "
          f"--model.model_config.compute_dtype bfloat16; losses as its log prints them\n")
    if failed:
        last = max(fp32)
        print(f"fp32: last loss {fp32[last]:.4f} at step {last}; bf16: no table, its run failed: {failed}")
        return
    steps = sorted(set(fp32) & set(bf16))
    print("| step | fp32 loss | bf16 loss | bf16 vs fp32 |")
    print("| ---: | ---: | ---: | ---: |")
    for step in steps:
        print(f"| {step} | {fp32[step]:.4f} | {bf16[step]:.4f} | {bf16[step] / fp32[step] - 1:+.2%} |")
    last = steps[-1]
    change = bf16[last] / fp32[last] - 1
    print(f"\nlast step {last}: bf16 {bf16[last]:.4f} against fp32 {fp32[last]:.4f}, {change:+.2%} "
          f"(target within {TRAIN_TARGET:.0%}: {'yes' if abs(change) <= TRAIN_TARGET else 'NO'})")


# ---------------------------------------------------------------------------------------------- main
def ensure_quickstart(folder, make, what):
    """The quickstart's folder holds what ``what`` reads; ``make``: run ``gptlocal quickstart --out folder`` first
    where it does not. Else one line naming the command, exit 2."""
    needed = {"inference": os.path.join(folder, "train", "model", "config.json"),
              "train": os.path.join(folder, "train.yaml")}
    missing = [needed[w] for w in what if not os.path.exists(needed[w])]
    if not missing:
        return
    if not make:
        print(f"{missing[0]} is missing: run the quickstart first (bash run_scripts/quickstart.sh, or gptlocal "
              f"quickstart --out {folder}), pass --make to run it, or give --model DIR --data FILE", file=sys.stderr)
        raise SystemExit(2)
    print(f"== gptlocal quickstart --out {folder}", flush=True)
    subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "quickstart", "--out", folder],
                   env=C.worker_env(len(os.sched_getaffinity(0))), check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--what", default="inference,train", help="comma list of inference, train")
    parser.add_argument("--quickstart", default=os.path.join(C.REPO, "runs", "quickstart"),
                        help="the quickstart's folder (default runs/quickstart): its model, held-out data, train.yaml")
    parser.add_argument("--make", action="store_true", help="run gptlocal quickstart first where it has not run")
    parser.add_argument("--model", help="model directory (default: the quickstart's train/model)")
    parser.add_argument("--data", help="held-out MindRecord (default: the quickstart's data/eval.mindrecord)")
    parser.add_argument("--int8-dir", help="an int8 model directory of --model (default: quantize_model into a "
                                           "scratch folder)")
    parser.add_argument("--precisions", default=",".join(PRECISIONS), help="comma list of bf16, int8")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--new", type=int, default=128, help="greedy tokens generated per prompt")
    parser.add_argument("--max-rows", type=int, default=0, help="held-out rows scored (default every row)")
    parser.add_argument("--batch", type=int, default=8, help="rows a forward")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return inference_worker(json.loads(args.worker))
    what = [w for w in args.what.split(",") if w]
    precisions = [p for p in args.precisions.split(",") if p]
    bad = [w for w in what if w not in ("inference", "train")] + [p for p in precisions if p not in PRECISIONS]
    if bad or not what:
        print(f"--what {args.what} / --precisions {args.precisions}: {bad[0] if bad else 'nothing'} is not one of "
              f"inference, train / {', '.join(PRECISIONS)}", file=sys.stderr)
        raise SystemExit(2)
    folder = os.path.abspath(args.quickstart)
    ensure_quickstart(folder, args.make, [w for w in what if w == "train" or not (args.model and args.data)])
    print(C.machine_line(args.threads), flush=True)
    print(C.precision_line(), flush=True)
    if "inference" in what:
        options = dict(model=os.path.abspath(args.model or os.path.join(folder, "train", "model")),
                       data=os.path.abspath(args.data or os.path.join(folder, "data", "eval.mindrecord")),
                       int8_dir=args.int8_dir and os.path.abspath(args.int8_dir), precisions=precisions,
                       prompts=args.prompts, prompt_tokens=args.prompt_tokens, new=args.new, max_rows=args.max_rows,
                       batch=args.batch, threads=args.threads)
        report, _ = C.run_worker(__file__, ["--worker", json.dumps(options), "--threads", str(args.threads)],
                                 args.threads)
        print()
        inference_table(report, options)
    if "train" in what:
        print()
        train_table(os.path.join(folder, "train.yaml"), C.scratch_dir("gptlocal-accuracy-train-"), args.threads)
    return None


if __name__ == "__main__":
    main()
