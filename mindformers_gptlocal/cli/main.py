"""``gptlocal``: prepare-data, convert (Hugging Face GPT-2, Llama/Qwen2, GPT-NeoX <-> gpt_local), ckpt (split/merge per-rank shards),
run (the run_mindformer.py drop-in), quickstart, plan (layout check and per-device memory, before any compile),
lora merge (fold LoRA adapters into the weights), generate and chat (a model directory, no YAML), quantize (int8 or
bfloat16 inference model directories).

Arguments are defined in ``args.py``; each command imports only what its work needs (``plan``,
``convert`` and every ``--help`` load neither MindSpore nor MindFormers: ``main`` answers ``--help`` from
``args.py`` before a command imports its work).
"""
import contextlib
import functools
import json
import os
import sys

from ..errors import CheckpointError, ConfigError, GPTLocalError
from ..training.stop import exit_status
from . import args as cli_args
from .interrupt import Catch, Interrupted, line as interrupt_line


def prepare_data(argv):
    options = cli_args.prepare_data_parser().parse_args(argv)
    if options.seq_length is not None and options.seq_length < 1:
        raise ConfigError(f"--seq-length must be an integer >= 1, got {options.seq_length}.")
    if options.from_mf_mindrecord:  # MindFormers 1.x GPT-2 data, rewritten once
        from ..data.mf_mindrecord import rewrite
        given = any(a == "--out" or a.startswith("--out=") for a in argv)  # else <FILE stem>_gptlocal
        out = options.out if given else None
        summary = rewrite(options.from_mf_mindrecord, out, seq_length=options.seq_length,
                          overwrite=options.overwrite)
        print(json.dumps(summary, indent=2))
        return 0
    from ..data.prepare import prepare
    summary = prepare(inputs=options.input, out=options.out,
                      seq_length=256 if options.seq_length is None else options.seq_length,
                      vocab_size=options.vocab_size, tokenizer_path=options.tokenizer, vocab=options.vocab,
                      merges=options.merges, jsonl_key=options.jsonl_key, eval_fraction=options.eval_fraction,
                      max_bytes=options.max_bytes, overwrite=options.overwrite, fmt=options.format,
                      too_long=options.too_long, pack=options.pack)
    print(json.dumps(summary, indent=2))
    return 0


def _replacing(out, overwrite, write):
    """``write(folder)`` into ``out``; with ``overwrite`` an existing ``out`` is replaced only once the new
    folder is complete (written beside it, then renamed), so a failed conversion leaves it as it was."""
    import os
    if not (os.path.isdir(out) and os.listdir(out)):
        return write(out)
    if not overwrite:
        raise CheckpointError(f"--out {os.path.abspath(out)} already holds files; pass --overwrite to replace it "
                              f"or choose another folder.")
    from ..staging import write_folder
    return write_folder(out, write, CheckpointError, overwrite=True)


def convert(argv):
    options = cli_args.convert_parser().parse_args(argv)
    if options.direction in ("mf2ms", "ms2mf"):
        return convert_mindformers(options)
    from ..checkpoint import hf_models  # GPT-2, Llama/Qwen2, GPT-NeoX: the family from config.json
    from ..model.loader import check_config_json
    overwrite = getattr(options, "overwrite", False)
    if options.direction == "hf2ms":
        from ..checkpoint.hub import resolve_hf_dir
        hf_dir = resolve_hf_dir(options.hf_dir)  # a folder, or a model id in the local Hugging Face cache
        check_config_json(hf_dir, "--hf-dir")
        summary = _replacing(options.out, overwrite,
                             lambda out: hf_models.hf_to_ms(hf_dir, out, allow_pickle=options.allow_pickle))
        print(f"wrote {summary['tensors']} tensors to {options.out}")
        return 0
    check_config_json(options.ms_dir, "--ms-dir")
    if options.peft and _is_prefix_run(options.ms_dir):
        from ..checkpoint import lora
        summary = _replacing(options.out, overwrite, lambda out: lora.prefix_to_peft(options.ms_dir, out))
        print(f"wrote a PEFT prefix-tuning adapter ({summary['tokens']} virtual tokens, from {summary['pet_type']}) "
              f"to {options.out}")
        return 0
    if options.lora_only or options.peft:
        from ..checkpoint import lora
        summary = _replacing(options.out, overwrite, lambda out: lora.to_peft(options.ms_dir, out))
        print(f"wrote a PEFT LoRA adapter ({summary['tensors']} tensors, target_modules {summary['targets']}) "
              f"to {options.out}")
        return 0
    summary = _replacing(options.out, overwrite, lambda out: hf_models.ms_to_hf(options.ms_dir, out))
    if summary.get("lora_left_out") and _is_prefix_run(options.ms_dir):
        print(f"note: {options.ms_dir} is a prefix-tuning run; only its base weights were written. Export the "
              f"prefix with --peft (a PEFT PrefixTuningConfig adapter).")
    elif summary.get("lora_left_out"):
        print(f"note: {options.ms_dir} is a LoRA run; only its base weights were written. Fold the adapters "
              f"in first (gptlocal lora merge) or export them with --lora-only.")
    print(f"wrote {summary['tensors']} tensors to {options.out}")
    return 0


def _is_prefix_run(ms_dir):
    """Whether ``ms_dir``'s config.json has a prefix-tuning pet_config (``convert ms2hf --peft``)."""
    import os
    from ..peft.prefix import PREFIX_TYPES
    try:
        with open(os.path.join(ms_dir, "config.json"), encoding="utf-8") as handle:
            pet = json.load(handle).get("pet_config") or {}
    except (OSError, ValueError):
        return False  # the converter reports the folder
    return pet.get("pet_type") in PREFIX_TYPES


def convert_mindformers(options):
    """convert mf2ms / ms2mf: MindFormers' own GPT-2 of the 1.x line (a MindSpore .ckpt)."""
    from ..checkpoint import mf_gpt2
    if options.direction == "ms2mf":
        summary = mf_gpt2.ms_to_mf(options.ms_dir, options.out)
        print(f"wrote {summary['tensors']} tensors to {summary['out']}")
        return 0
    summary = mf_gpt2.mf_to_ms(options.mf_ckpt, options.out, mf_yaml=options.mf_yaml, tokenizer=options.tokenizer,
                               num_heads=options.num_heads)
    for note in summary["notes"]:
        print(f"note: {note}")
    print(f"wrote {summary['tensors']} tensors to {options.out}")
    return 0


def migrate_yaml(argv):
    options = cli_args.migrate_yaml_parser().parse_args(argv)
    from ..migrate.mf_yaml import migrate_file
    notes = migrate_file(options.old, options.out, device_target=options.device_target, model_dir=options.model_dir)
    for note in notes:
        print(f"- {note}")
    print(f"wrote {options.out}; check it with `gptlocal plan --config {options.out}`")
    return 0


def lora(argv):
    options = cli_args.lora_parser().parse_args(argv)
    from ..checkpoint.lora import merge
    summary = merge(options.base, options.adapter, options.out, alpha=options.lora_alpha,
                    overwrite=options.overwrite)
    print(f"merged {summary['adapters']} LoRA adapters (rank {summary['rank']}, alpha {summary['alpha']:g}) "
          f"into {summary['out']}")
    return 0


def quantize(argv):
    options = cli_args.quantize_parser().parse_args(argv)
    from ..model.loader import check_config_json
    check_config_json(options.model, "--model")
    from ..quantize import quantize_model
    summary = quantize_model(options.model, options.out, options.dtype)
    print(f"wrote {summary['out']}: {summary['dtype']}, {summary['tensors']} tensors, weights "
          f"{summary['bytes_after'] / 2**20:.1f} MiB ({summary['bytes_after'] / summary['bytes_before']:.0%} of "
          f"{summary['bytes_before'] / 2**20:.1f} MiB)")
    return 0


def ckpt(argv):
    options = cli_args.ckpt_parser().parse_args(argv)
    from ..checkpoint import distributed
    if options.action == "split":
        config = distributed.config_from_yaml(options.config)
        summary = distributed.split_checkpoint(options.ckpt, config, options.out, overwrite=options.overwrite)
        print(f"wrote {summary['tensors']} tensors as {summary['ranks']} rank shards to {summary['out']}")
    else:
        summary = distributed.merge_checkpoint(options.dir, options.out)
        print(f"merged {summary['ranks']} rank shards into {summary['tensors']} tensors: {summary['out']}")
    return 0


def run(argv, own_process=False):
    if own_process:  # before MindSpore is imported (the launcher's module imports it): training/stop.py
        from ..training import stop
        stop.hold()
    from .launcher import main as launch
    return launch(argv, own_process=own_process)


def plan(argv):
    options = cli_args.plan_parser().parse_args(argv)
    from .. import yaml_io
    from ..parallel.rules import raise_if_bad
    from ..plan.report import format_plan, plan as make_plan, plan_json
    result = make_plan(yaml_io.load_yaml(options.config), options.devices)
    if options.json:
        print(plan_json(result))
        return 2 if result["problems"] else 0
    if result["problems"]:
        raise_if_bad(result["problems"], where=options.config)
    print(format_plan(result, options.config))
    if result.get("fits") is False:
        raise ConfigError(f"{options.config}: the peak per-device estimate exceeds the {result['card']} card; lower "
                          f"runner_config.batch_size, enable recompute_config.recompute, or add model/pipeline "
                          f"parallel.")
    return 0


def quickstart(argv):
    options = cli_args.quickstart_parser().parse_args(argv)
    from .quickstart import main as run_quickstart
    return run_quickstart(options)


def model_by_name(options):
    """``--model``: an existing path as is; else a Hugging Face id from the local cache (``checkpoint/hub.py``:
    a gpt_local snapshot as is, another converted once into gpt_local's cache). Names the server's model after
    the id unless --served-model-name says otherwise."""
    from ..checkpoint.hub import looks_like_id, resolve_model
    given = options.model
    options.model = resolve_model(given)
    if looks_like_id(given) and hasattr(options, "served_model_name") and not options.served_model_name:
        options.served_model_name = given


def check_device_target(options):
    """--device-target names a backend this MindSpore has, checked before the model loads (one line)."""
    target = getattr(options, "device_target", None) or "CPU"
    if target != "CPU":
        from ..preflight.inputs import require_device
        require_device(target, f"--device-target {target}", "pass --device-target CPU")


def serve(argv):
    options = cli_args.serve_parser().parse_args(argv)
    try:
        import fastapi  # noqa: F401
        import prometheus_client  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as err:
        raise ConfigError(f"gptlocal serve needs the [serve] extra ({err}); pip install "
                          f"'mindformers-gptlocal[serve]'.") from err
    check_device_target(options)
    model_by_name(options)
    from ..serve.app import serve as run_server
    return run_server(options)



def evaluate(argv, own_process=False):
    options = cli_args.eval_parser().parse_args(argv)
    check_device_target(options)
    model_by_name(options)
    from ..evaluation.run import run_eval
    return run_eval(options, own_process=own_process)



def generate(argv):
    options = cli_args.generate_parser().parse_args(argv)
    check_device_target(options)
    model_by_name(options)
    from .generate import generate as run_generate
    return run_generate(options)


def chat(argv):
    """Replies on stdout with runs of empty lines squeezed to one (a small model's reply of newlines is not
    forty blank lines)."""
    options = cli_args.chat_parser().parse_args(argv)
    check_device_target(options)
    model_by_name(options)
    from .generate import chat as run_chat
    squeezed = SqueezedBlankLines(sys.stdout)
    sys.stdout = squeezed
    try:
        return run_chat(options)
    finally:
        sys.stdout = squeezed.stream


class SqueezedBlankLines:
    """A stdout that ends lines as they come but never writes two empty lines in a row (nor one first)."""

    def __init__(self, stream):
        self.stream, self.pending, self.started = stream, 0, False

    def write(self, text):
        out = []
        for char in text:
            if char == "\n":
                if self.started and self.pending == 0:
                    out.append("\n")  # the line ends now (a prompt may follow on stderr)
                self.pending += 1
                continue
            if self.pending >= 2 and self.started:
                out.append("\n")  # one empty line for a run of them
            self.pending, self.started = 0, True
            out.append(char)
        if out:
            self.stream.write("".join(out))
        return len(text)

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


COMMANDS = {"prepare-data": prepare_data, "convert": convert, "ckpt": ckpt, "run": run, "quickstart": quickstart,
            "plan": plan, "serve": serve, "eval": evaluate, "lora": lora, "migrate-yaml": migrate_yaml, "generate": generate, "chat": chat,
            "quantize": quantize}


def _asks_for_help(argv):
    """-h/--help before any `--`: answered from args.py alone, before a command imports its work."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    return any(a in ("-h", "--help") for a in head)


def main(argv=None):
    own_process = argv is None  # the console script (or a script calling main()), not a caller's own argv
    if own_process and "--verbose" not in sys.argv[2:]:  # a process of its own: MindSpore's own warnings stay
        os.environ.setdefault("GLOG_v", "3")  # off the terminal (its errors show); `run --verbose` shows them
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "--version"):
        cli_args.main_parser().parse_args(argv or ["--help"])
        return 0
    if argv[0] not in COMMANDS and argv[0].replace("_", "-") in COMMANDS:  # the spelling rule, for commands
        argv[0] = argv[0].replace("_", "-")
    if argv[0] not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=2, cutoff=0.6)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        print(f"gptlocal: unknown command {argv[0]!r}.{hint} Commands: {', '.join(cli_args.COMMANDS)} "
              f"(gptlocal --help).", file=sys.stderr)
        return 2
    if _asks_for_help(argv[1:]) and argv[0] in cli_args.PARSERS:
        cli_args.PARSERS[argv[0]]().parse_args(argv[1:])  # prints the help and exits
    command = COMMANDS[argv[0]]
    if own_process and command in (evaluate, run):  # its own process: eval's tokenizer without torch; run takes
        command = functools.partial(command, own_process=True)  # SIGINT/SIGTERM before MindSpore starts
    # SIGINT/SIGTERM: one line and 130/143, nothing partial left (cli/interrupt.py); `run` keeps training/stop.py's
    # safe stop (a checkpoint, then the command that resumes)
    catch = Catch(argv[0]) if own_process and argv[0] != "run" else None
    with catch or contextlib.nullcontext():
        try:
            code = command(argv[1:])
            if catch is not None and catch.signum is not None:  # it came while the output was put in place
                raise Interrupted(catch.signum, finished=True)
            return code
        except GPTLocalError as err:
            print(f"gptlocal {argv[0]}: error: {err}", file=sys.stderr)
            return 2
        except Interrupted as err:
            if catch is None:  # main(argv) inside another program: the line and the status, the caller goes on
                print(interrupt_line(argv[0], err.signum, err.detail, err.finished), file=sys.stderr)
                return exit_status(err.signum)
            catch.report(err.signum, err.detail, err.finished)
            return catch.end(exit_status(err.signum))  # ends the process
