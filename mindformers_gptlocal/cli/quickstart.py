"""``gptlocal quickstart``: the whole product on one CPU, with no download.

1. prepare the Python standard library's sources as a corpus (tokenizer + MindRecord + Megatron);
2. eval perplexity of the untrained tiny model;
3. train it through MindFormers' trainer, printing loss and tokens/s;
4. eval perplexity again, from the model directory training wrote;
5. generate a sample through MindFormers' predict path.

Each run goes through ``gptlocal run`` (our run_mindformer.py) in a fresh
process, with the YAML it used written next to its output.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

from .. import yaml_io

REPO_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_configs")


def config_path(name):
    return os.path.join(REPO_CONFIGS, name)


def load_yaml(name):
    """A model_configs YAML with its base_config merged in, as a plain dict."""
    return yaml_io.load_yaml(config_path(name))


def launch(yaml_path, log_path, extra=()):
    """``gptlocal run --config yaml`` in a subprocess; our lines go to the console, everything to log_path. A Ctrl-C
    reaches the run too (passed on): it stops safely on its own, its last lines are still shown, and the
    quickstart ends with 130 (143 for SIGTERM; no traceback)."""
    command = [sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config", os.path.abspath(yaml_path),
               *extra]
    from .interrupt import Interrupted, waiting_for
    shown = []
    with open(log_path, "w", encoding="utf-8") as log:
        # in the run's own folder: MindFormers' predict writes text_generation_result.txt to the working directory;
        # a session of its own: a Ctrl-C reaches it once, passed on by cli/interrupt.py (a second one: at once)
        process = subprocess.Popen(command, cwd=os.path.dirname(os.path.abspath(log_path)), stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, start_new_session=True)
        stopped = None
        with waiting_for(process):
            while True:
                try:
                    _relay(process, log, shown)
                    break
                except KeyboardInterrupt as err:  # the run stops safely on its own; keep reading its end
                    stopped = err
            code = process.wait()
    if stopped is not None:
        signum = stopped.signum if isinstance(stopped, Interrupted) else signal.SIGINT
        raise Interrupted(signum, f"`gptlocal quickstart` starts over (its log: {log_path})")
    if code:
        raise SystemExit(f"quickstart: `{' '.join(command)}` failed (exit {code}); see {log_path}")
    return "".join(shown)


def _relay(process, log, shown):
    """The run's output into ``log``; gpt_local's own lines (and the eval table under them) also on the console."""
    table = False  # the rows under "[gptlocal] eval results" (launcher.eval_table) are ours too
    for line in process.stdout:
        log.write(line)
        table = line.startswith("[gptlocal] eval results") or (table and line.startswith("  "))
        if line.startswith("[gptlocal]") or table or "error" in line.lower() and "gptlocal" in line:
            print("   " + line.rstrip(), flush=True)
            shown.append(line)


def perplexity(output):
    match = re.search(r"^\s+PPL\s+([0-9.eE+-]+|inf)", output, re.M)  # launcher.eval_table
    return float(match.group(1)) if match else float("nan")


def main(args):
    """Run the five steps; ``args`` from ``cli/args.quickstart_parser``."""
    work = os.path.abspath(args.workdir)
    data = os.path.join(work, "data")
    os.makedirs(work, exist_ok=True)
    started = time.time()
    print(f"== quickstart: everything goes to {work} (data, YAMLs, logs, the trained model in "
          f"{os.path.join(work, 'train', 'model')})", flush=True)

    print(f"== 1/5 prepare data: Python {sys.version.split()[0]} standard library -> {data}", flush=True)
    from ..data.prepare import prepare
    summary = prepare(out=data, seq_length=256, vocab_size=8192, max_bytes=args.max_bytes, overwrite=True)
    print(f"   {summary['files']} files, {summary['tokens']:,} tokens, vocab {summary['vocab_size']}, "
          f"{summary['train_samples']} train / {summary.get('eval_samples', 0)} eval samples of 256 tokens",
          flush=True)
    eval_file = summary.get("eval_mindrecord", summary["train_mindrecord"])

    train_cfg = load_yaml("pretrain_gpt_local_tiny_cpu.yaml")
    train_cfg["output_dir"] = os.path.join(work, "train")
    train_cfg["overwrite_output_dir"] = True  # a quickstart run again redoes it (its data is replaced too)
    train_cfg["train_dataset"]["data_loader"]["dataset_dir"] = summary["train_mindrecord"]
    train_cfg["train_dataset"]["data_loader"]["num_samples"] = args.steps * train_cfg["runner_config"]["batch_size"]
    train_cfg["train_dataset_task"]["dataset_config"] = train_cfg["train_dataset"]
    for callback in train_cfg["callbacks"]:
        if callback["type"] == "GPTLocalSaveModelDir":
            callback["tokenizer_dir"] = summary["model_dir"]
    train_yaml = yaml_io.dump_yaml(train_cfg, os.path.join(work, "train.yaml"))

    eval_cfg = load_yaml("eval_gpt_local_tiny_cpu.yaml")
    eval_cfg["output_dir"] = os.path.join(work, "eval")
    eval_cfg["eval_dataset"]["data_loader"]["dataset_dir"] = eval_file
    eval_cfg["eval_dataset_task"]["dataset_config"] = eval_cfg["eval_dataset"]
    eval_yaml = yaml_io.dump_yaml(eval_cfg, os.path.join(work, "eval.yaml"))

    print("== 2/5 eval perplexity before training (random init)", flush=True)
    before = perplexity(launch(eval_yaml, os.path.join(work, "eval_before.log")))

    print(f"== 3/5 train {args.steps} steps on CPU through MindFormers' trainer", flush=True)
    launch(train_yaml, os.path.join(work, "train.log"))
    model_dir = os.path.join(work, "train", "model")

    print("== 4/5 eval perplexity after training", flush=True)
    after = perplexity(launch(eval_yaml, os.path.join(work, "eval_after.log"), ["--load_checkpoint", model_dir]))

    print("== 5/5 generate", flush=True)
    predict_cfg = load_yaml("predict_gpt_local_tiny_cpu.yaml")
    predict_cfg["output_dir"] = os.path.join(work, "predict")
    predict_cfg["pretrained_model_dir"] = model_dir
    predict_cfg["generation_config"].update(max_new_tokens=48, do_sample=True, top_k=40, top_p=0.95,
                                            temperature=0.8, repetition_penalty=1.1)
    predict_yaml = yaml_io.dump_yaml(predict_cfg, os.path.join(work, "predict.yaml"))
    launch(predict_yaml, os.path.join(work, "predict.log"),
           ["--load_checkpoint", model_dir, "--predict_data", args.prompt])
    sample = _read_sample(os.path.join(work, "predict.log"))

    result = {"perplexity_before": before, "perplexity_after": after, "sample": sample,
              "model_dir": model_dir, "seconds": round(time.time() - started)}
    with open(os.path.join(work, "result.json"), "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    print(f"\nperplexity: {before:.1f} before -> {after:.1f} after training")
    print(f"sample for {args.prompt!r}:\n{sample}\n")
    print(f"model directory: {model_dir}  (GPTLocalForCausalLM.from_pretrained loads it)")
    print(f"done in {result['seconds']} s; data, YAMLs, logs and result.json in {work}")
    shown = os.path.relpath(model_dir) if not os.path.relpath(model_dir).startswith("..") else model_dir
    print(f"next: gptlocal generate --model {shown} --prompt {json.dumps(args.prompt)}\n"
          f"      gptlocal chat --model {shown}\n"
          f"      gptlocal run --config model_configs/finetune_gpt_local_tiny_cpu.yaml --output_dir output/finetune   "
          f"(after prepare-data --tokenizer {shown} --out data/ft_tiny: README's tour, docs/finetune.md)")
    return 0


def _read_sample(log_path):
    with open(log_path, encoding="utf-8") as handle:
        text = handle.read()
    match = re.search(r"\[gptlocal\] generated: (.*)", text)
    return json.loads(match.group(1)) if match else ""
