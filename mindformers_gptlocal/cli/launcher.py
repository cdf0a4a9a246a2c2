"""A drop-in for MindFormers' ``run_mindformer.py`` (the wheel ships none): same flags, same flow.

``MindFormerConfig(yaml)`` -> apply flags -> pre-flight checks -> ``set_output_path`` ->
``build_context`` -> ``Trainer(config).train()/evaluate()/predict()``. The pre-flight checks
(``preflight/``) turn the usual mistakes into one clear error before anything compiles.
"""
import json
import os
import sys

from ..errors import ConfigError, GPTLocalError
from ..training import stop
from ..mf.logs import HeldLog, config_dump_to_log
from ..mf.run_yaml import preflight
from ..mf.compat import mark_checked
from ..runtime.graph_cache import store_root
from .args import run_parser

RUN_MODES = ("train", "finetune", "eval", "predict", "predict_with_train_model")


# flag -> dotted config key, for flags that copy straight into the config
DIRECT = {
    "device_id": "context.device_id", "device_target": "context.device_target", "mode": "context.mode",
    "do_eval": "do_eval", "seed": "seed", "use_parallel": "use_parallel", "load_checkpoint": "load_checkpoint",
    "src_strategy_path_or_dir": "src_strategy_path_or_dir", "auto_trans_ckpt": "auto_trans_ckpt",
    "transform_process_num": "transform_process_num", "only_save_strategy": "only_save_strategy",
    "resume_training": "resume_training", "remote_save_url": "remote_save_url", "profile": "profile",
    "train_dataset_dir": "train_dataset.data_loader.dataset_dir",
    "eval_dataset_dir": "eval_dataset.data_loader.dataset_dir", "do_sample": "model.model_config.do_sample",
    "predict_batch_size": "predict_batch_size", "epochs": "runner_config.epochs",
    "batch_size": "runner_config.batch_size",
    "gradient_accumulation_steps": "runner_config.gradient_accumulation_steps",
    "sink_mode": "runner_config.sink_mode", "output_dir": "output_dir", "trust_remote_code": "trust_remote_code",
    "overwrite_output_dir": "overwrite_output_dir",
}


def set_key(config, dotted, value):
    """config['a']['b'] = value for 'a.b', creating missing sections."""
    from ..mf.symbols import MindFormerConfig
    parts = dotted.split(".")
    node = config
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = MindFormerConfig()
        node = node[part]
    node[parts[-1]] = value


def load_config(argv=None):
    """Parse flags and return the resolved MindFormerConfig (nothing is built yet)."""
    from .. import yaml_io
    from ..mf.symbols import MindFormerConfig, parse_value
    from ..mf import symbols
    from ..mf.compat import is_gpt_local
    from ..preflight.sections import check_sections
    args, rest = run_parser().parse_known_args(argv)
    rest = [piece for item in rest for piece in item.split("=", 1)]
    if len(rest) % 2:
        raise ConfigError(f"extra arguments {rest} are not '--key value' pairs.")
    if not args.config:
        for key in rest[::2]:
            check_override_key(key, {})  # a mistyped flag first: its suggestion is the better line
        raise ConfigError("--config is missing: the YAML to run, e.g. --config "
                          "model_configs/pretrain_gpt_local_tiny_cpu.yaml (gptlocal run --help lists the flags).")
    if not os.path.isfile(args.config):
        raise ConfigError(f"--config {args.config}: no such YAML file.")
    raw = yaml_io.load_yaml(args.config)  # a syntax error named by line and column (yaml_io)
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {args.config}: the top level is not a mapping of keys; start from a file in "
                          f"model_configs/.")
    if is_gpt_local(raw):
        check_sections(raw, symbols)  # before MindFormerConfig, which raises KeyError on a runner_config typo
    if args.register_path:
        os.environ["REGISTER_PATH"] = os.path.abspath(args.register_path)
        if os.environ["REGISTER_PATH"] not in sys.path:
            sys.path.append(os.environ["REGISTER_PATH"])
    try:
        config = MindFormerConfig(os.path.abspath(args.config),
                                  **({"run_mode": args.run_mode} if args.run_mode else {}))
    except Exception as err:  # a missing base_config, a section MindFormers' template refuses
        raise ConfigError(f"--config {args.config} cannot be read as a MindFormers YAML "
                          f"({err.__class__.__name__}: {str(err).splitlines()[0] if str(err) else ''}); fix the "
                          f"place it names.") from err
    for flag, key in DIRECT.items():
        value = getattr(args, flag)
        if value is not None:
            set_key(config, key, value)
    if args.strategy_load_checkpoint:
        set_key(config, "parallel.strategy_ckpt_load_file", args.strategy_load_checkpoint)
    if args.options:
        config.merge_from_dict(args.options)
    if args.num_samples is not None:
        for section in ("train_dataset", "eval_dataset"):
            if config.get(section) and config[section].get("data_loader"):
                config[section].data_loader.num_samples = args.num_samples
    if config.run_mode not in RUN_MODES:
        raise ConfigError(f"run_mode {config.run_mode!r} is not one of {', '.join(RUN_MODES)}; set run_mode in "
                          f"the YAML or pass --run_mode.")
    if config.run_mode.startswith("predict"):
        data = args.predict_data
        if isinstance(data, list) and len(data) == 1:
            data = data[0].replace(r"\n", "\n")
        config.input_data = data
    check_predict_flags(args, config)
    while rest:
        key, value = rest.pop(0), rest.pop(0)
        check_override_key(key, config)
        set_key(config, key[2:], parse_value(value))
    return config


def check_predict_flags(args, config):
    """``--modal_type`` and ``--adapter_id`` as MindFormers' launcher takes them, for a text-only model without
    an slora pet_config: text is the one modal type, and there is no adapter to pick."""
    if args.modal_type and any(kind.lower() != "text" for kind in args.modal_type):
        raise ConfigError(f"--modal_type {' '.join(args.modal_type)}: gpt_local models read text only; drop "
                          f"--modal_type (or give text for each --predict_data).")
    if args.modal_type and args.predict_data and len(args.modal_type) != len(args.predict_data):
        raise ConfigError(f"--modal_type gives {len(args.modal_type)} type(s) for {len(args.predict_data)} "
                          f"--predict_data input(s); give one per input, or drop --modal_type.")
    if args.adapter_id:
        pet = ((config.get("model") or {}).get("model_config") or {}).get("pet_config") or {}
        if pet.get("pet_type") != "slora":
            raise ConfigError(f"--adapter_id {' '.join(args.adapter_id)} picks an adapter of an slora pet_config, "
                              f"which this model does not have; merge a LoRA run with `gptlocal lora merge`, or "
                              f"serve several adapters with `gptlocal serve --lora NAME=DIR`.")
        config.adapter_id = args.adapter_id


def check_override_key(key, config):
    """A free ``--key value`` pair sets a YAML key, as MindFormers' launcher does, written as the key's dotted
    path (``--runner_config.stop_step 5``); its first part must be a top-level key MindFormers reads, so a
    mistyped flag (``--stepz 5``) is refused with the closest flags and keys instead of becoming a key."""
    import difflib
    from ..mf import symbols
    from ..preflight.sections import known_top_level
    if not key.startswith("--"):
        raise ConfigError(f"custom config key {key!r} must start with --, e.g. --model.model_config.seq_length 128")
    name = key[2:]
    top = name.split(".", 1)[0]
    if top in config or top in known_top_level(symbols):
        return
    flags = sorted(set(run_parser()._all_flags()) - {"--help"})  # pylint: disable=protected-access
    dotted = [f"--{section}.{leaf}" for section, value in config.items() if isinstance(value, dict)
              for leaf in value if not isinstance(value[leaf], dict)]
    if not config:  # no YAML read (no --config): the keys of MindFormers' section templates
        from ..mf.symbols import CONFIG_NAME_TO_CLASS
        dotted = [f"--{section}.{leaf}" for section, template in CONFIG_NAME_TO_CLASS.items()
                  if section != "general_config" for leaf in template.keys()]
    leaves = {candidate.rsplit(".", 1)[-1]: candidate for candidate in dotted}
    rest = name[len(top):]
    known = sorted(known_top_level(symbols))
    close = ["--" + k + rest for k in difflib.get_close_matches(top, known, n=1, cutoff=0.75)]
    if not rest:
        close += [leaves[leaf] for leaf in difflib.get_close_matches(name, list(leaves), n=2, cutoff=0.55)]
        close += difflib.get_close_matches(key, flags, n=2, cutoff=0.6)
    hint = f" Did you mean {' or '.join(dict.fromkeys(close))}?" if close else ""
    raise ConfigError(f"unknown flag {key}: not a flag of gptlocal run nor a YAML key.{hint} (A YAML key is set "
                      f"by its dotted path, e.g. --runner_config.stop_step 5; gptlocal run --help lists the flags.)")


def run(config, held=None, verbose=False):
    """Pre-flight, then the same calls as MindFormers' run_mindformer.py. Returns the trainer's result."""
    from ..mf.symbols import Trainer, build_context, set_output_path
    check_model_section(config)
    preflight(config)  # before set_output_path, which creates folders: a refused run writes nothing
    mark_checked(config)
    set_output_path(config.output_dir)
    if held is not None:
        held.release(verbose)
    out = os.path.abspath(config.output_dir or "./output")
    cached = store_root((config.get("runner_wrapper") or {}).get("compile_cache")) is not None
    print(f"[gptlocal] {config.run_mode}: checks passed; output in {out}, MindFormers' log in "
          f"{os.path.join(out, 'log')}{'' if verbose else ' (--verbose: also here)'}; the first step compiles "
          f"the graph{' (or loads it from the compile cache)' if cached else ''}", flush=True)
    if (config.get("context") or {}).get("device_target", "CPU") == "CPU":
        # MindFormers sets MS_ALLOC_CONF=enable_vmm:False for eval/predict (an Ascend memory option) unless it is set,
        # and MindSpore then prints "[MS_ALLOC_CONF] config: ..." on stdout; on CPU it chooses nothing
        os.environ.setdefault("MS_ALLOC_CONF", "")
    build_context(config)
    metrics = _metrics(config)
    progress = None
    if config.run_mode == "eval":
        from ..training.callbacks import GPTLocalEvalProgress
        progress = [GPTLocalEvalProgress()]
    trainer = Trainer(config, compute_metrics=metrics, eval_callbacks=progress)
    with config_dump_to_log(verbose):
        if config.run_mode in ("train", "finetune"):
            stop.STATE.launcher = True  # a stop on a signal: main() returns its exit status
            return trainer.train()
        if config.run_mode == "eval":
            trainer.evaluate(eval_checkpoint=config.load_checkpoint)
            return {name: metric.eval() for name, metric in (metrics or {}).items()}
        return trainer.predict(predict_checkpoint=config.load_checkpoint, input_data=config.input_data,
                               batch_size=config.predict_batch_size, adapter_id=config.get("adapter_id"))


def check_model_section(config):
    """A YAML without a model section (a cut or mis-indented file) would run MindFormers' defaults."""
    model = config.get("model")
    if not isinstance(model, dict) or not model.get("model_config"):
        raise ConfigError("the YAML has no model.model_config section; start from a file in model_configs/ "
                          "(model_type: gpt_local).")


def _metrics(config):
    """Hand the eval metric in ourselves so its value can be returned (MindFormers only logs it)."""
    if config.run_mode != "eval" or not config.get("metric"):
        return None
    from ..mf.symbols import build_metric
    metric = config.metric
    return {metric.type: build_metric(metric)}


def eval_table(result):
    """The eval metrics as a small table: one block per metric, one ``name  value`` row per figure."""
    lines = []
    for metric, values in result.items():
        values = values if isinstance(values, dict) else {"value": values}
        lines.append(f"[gptlocal] eval results ({metric}):")
        width = max(len(str(name)) for name in values) if values else 0
        for name, value in values.items():
            shown = f"{value:,}" if isinstance(value, int) else f"{value:.8g}" if isinstance(value, float) else value
            lines.append(f"  {str(name):<{width}}  {shown}")
    return "\n".join(lines)


def main(argv=None, own_process=None):
    """``own_process`` (default: ``argv`` is None, i.e. the process's own command line): this launcher owns the
    process, so it takes SIGINT/SIGTERM before MindSpore starts (``training/stop.py hold``)."""
    if own_process is None:
        own_process = argv is None
    if own_process:
        stop.hold()
    held = HeldLog()  # before anything imports MindFormers: its import-time log is held too
    try:
        config = load_config(argv)
        result = run(config, held, verbose=run_parser().parse_known_args(argv)[0].verbose)
    except GPTLocalError as err:
        held.drop()
        print(f"gptlocal run: error: {err}", file=sys.stderr)
        return 2
    finally:
        held.drop()
        signum = stop.stopped()
        if not own_process:
            stop.release()
    if signum:
        return stop.exit_status(signum)
    if result is not None and config.run_mode == "eval":
        print(eval_table(result), flush=True)
    if result is not None and config.run_mode.startswith("predict"):
        for item in result:
            for text in item.get("text_generation_text", []):
                print(f"[gptlocal] generated: {json.dumps(text)}", flush=True)
    return 0
