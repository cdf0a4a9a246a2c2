"""``gptlocal quickstart``: the whole product on one CPU, with no download.

1. prepare the Python standard library's sources as a corpus (tokenizer + MindRecord + Megatron);
2. eval perplexity of the untrained tiny model;
3. train it through MindFormers' trainer, printing loss and tokens/s;
4. eval perplexity again, from the model directory training wrote;
5. generate a sample through MindFormers' predict path.

Each run goes through ``gptlocal run`` (our run_mindformer.py) in a fresh
process, with the YAML it used written next to its output. Steps 2 and 3 run at
once (the untrained model's eval needs nothing of training), and so do 4 and 5
(both read the trained model): one process per CPU core where most of each
run is importing and compiling; the console shows the steps in order.
"""
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

from .. import yaml_io

REPO_CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "model_configs")


def config_path(name):
    return os.path.join(REPO_CONFIGS, name)


def load_yaml(name):
    """A model_configs YAML with its base_config merged in, as a plain dict."""
    return yaml_io.load_yaml(config_path(name))


class Run:
    """``gptlocal run --config yaml`` in a subprocess, started at once: everything it prints goes to ``log_path``, and
    gpt_local's own lines (and the eval table under them) to the console, held until ``show()`` (two runs at once
    print one after the other, as run one by one). Its own session: a Ctrl-C reaches it once, passed on by
    cli/interrupt.py (``together`` registers it), and a second one at once."""

    def __init__(self, title, yaml_path, log_path, extra=()):
        self.title, self.log_path = title, log_path
        self.command = [sys.executable, "-m", "mindformers_gptlocal.cli", "run", "--config",
                        os.path.abspath(yaml_path), *extra]
        self.shown = []  # our lines so far
        self.printed = None  # how many of them are on the console (None: held)
        self.log = open(log_path, "w", encoding="utf-8")  # pylint: disable=consider-using-with  (closed at EOF)
        # in the run's own folder: MindFormers' predict writes text_generation_result.txt to the working directory
        self.process = subprocess.Popen(self.command, cwd=os.path.dirname(os.path.abspath(log_path)),
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.reader = threading.Thread(target=self._relay, name="quickstart-relay", daemon=True)
        self.reader.start()

    def _relay(self):
        table = False  # the rows under "[gptlocal] eval results" (launcher.eval_table) are ours too
        with self.log:
            for line in self.process.stdout:
                self.log.write(line)
                table = line.startswith("[gptlocal] eval results") or (table and line.startswith("  "))
                if line.startswith("[gptlocal]") or table or "error" in line.lower() and "gptlocal" in line:
                    with _CONSOLE:
                        self.shown.append(line)
                        self._print()

    def show(self):
        """The title, the lines held so far, and from now on each line as it comes."""
        with _CONSOLE:
            if self.printed is None:
                print(self.title, flush=True)
                self.printed = 0
                self._print()

    def _print(self):
        if self.printed is not None:
            for line in self.shown[self.printed:]:
                print("   " + line.rstrip(), flush=True)
            self.printed = len(self.shown)

    def ended(self):
        """Whether the run exited and its output is all read (its log closed)."""
        return self.process.poll() is not None and not self.reader.is_alive()

    def output(self):
        return "".join(self.shown)


_CONSOLE = threading.Lock()  # the relays' lines and the titles, one at a time


def together(*runs):
    """``[(title, yaml_path, log_path, extra), ...]`` started at once (each step of the pair independent of the other:
    the two CPU cores each run one), shown in this order: the first's lines as they come, the next's held until the
    one before it ended. Returns the Runs. A Ctrl-C (or SIGTERM) is passed on to every run still going: each stops
    safely on its own (training saves a checkpoint), their last lines are still shown, and the quickstart ends with
    130 (143; no traceback). A run that fails stops the others the same way (SIGTERM), then the quickstart ends
    naming it."""
    from .interrupt import Interrupted, waiting_for
    started, stopped, failed = [], None, None
    with contextlib.ExitStack() as children:
        try:
            for title, yaml_path, log_path, extra in runs:
                run = Run(title, yaml_path, log_path, extra)
                children.enter_context(waiting_for(run.process))
                started.append(run)
        except KeyboardInterrupt as err:  # the runs started got it too (passed on); the others do not start
            stopped = err
        while True:
            try:
                for run in started:  # each shown once the ones before it ended
                    run.show()
                    if not run.ended():
                        break
                if all(run.ended() for run in started):
                    break
                if failed is None and stopped is None:
                    failed = next((run for run in started if run.process.poll()), None)
                    if failed is not None:
                        _signal(started, signal.SIGTERM)
                time.sleep(0.05)
            except KeyboardInterrupt as err:  # each run stops safely on its own; keep reading their ends
                stopped = stopped or err
    if stopped is not None:
        signum = stopped.signum if isinstance(stopped, Interrupted) else signal.SIGINT
        logs = ", ".join(run.log_path for run in started)
        raise Interrupted(signum, "`gptlocal quickstart` starts over" + (
            f" (its log{'s' if len(started) > 1 else ''}: {logs})" if started else ""))
    for run in [failed] + started if failed else started:
        if run.process.returncode:
            raise SystemExit(f"quickstart: `{' '.join(run.command)}` failed (exit {run.process.returncode}); see "
                             f"{run.log_path}")
    return started


def _signal(runs, signum):
    for run in runs:
        if run.process.poll() is None:
            try:
                run.process.send_signal(signum)
            except OSError:
                pass


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

    # steps 2 and 3 at once (the eval reads the untrained model, not training's), so are 4 and 5 (both read the
    # trained model): shown in order, each step's lines once the one before it ended
    eval_before, _ = together(
        ("== 2/5 eval perplexity before training (random init)", eval_yaml, os.path.join(work, "eval_before.log"),
         ()),
        (f"== 3/5 train {args.steps} steps on CPU through MindFormers' trainer", train_yaml,
         os.path.join(work, "train.log"), ()))
    before = perplexity(eval_before.output())
    model_dir = os.path.join(work, "train", "model")

    predict_cfg = load_yaml("predict_gpt_local_tiny_cpu.yaml")
    predict_cfg["output_dir"] = os.path.join(work, "predict")
    predict_cfg["pretrained_model_dir"] = model_dir
    predict_cfg["generation_config"].update(max_new_tokens=48, do_sample=True, top_k=40, top_p=0.95,
                                            temperature=0.8, repetition_penalty=1.1)
    predict_yaml = yaml_io.dump_yaml(predict_cfg, os.path.join(work, "predict.yaml"))
    eval_after, _ = together(
        ("== 4/5 eval perplexity after training", eval_yaml, os.path.join(work, "eval_after.log"),
         ["--load_checkpoint", model_dir]),
        ("== 5/5 generate", predict_yaml, os.path.join(work, "predict.log"),
         ["--load_checkpoint", model_dir, "--predict_data", args.prompt]))
    after = perplexity(eval_after.output())
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
