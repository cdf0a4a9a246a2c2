"""A drop-in for MindFormers' ``run_mindformer.py`` (the wheel ships none): same flags, same flow.

``MindFormerConfig(yaml)`` -> apply flags -> pre-flight checks -> ``set_output_path`` ->
``build_context`` -> ``Trainer(config).train()/evaluate()/predict()``. The pre-flight checks
(``preflight/``) turn the usual mistakes into one clear error before anything compiles.
"""
import json
import os
import sys

from ..errors import ConfigError, GPTLocalError
from ..preflight.checks import preflight
from ..registration import mark_checked
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
}


def set_key(config, dotted, value):
    """config['a']['b'] = value for 'a.b', creating missing sections."""
    from mindformers.tools.register import MindFormerConfig
    parts = dotted.split(".")
    node = config
    for part in parts[:-1]:
        if node.get(part) is None:
            node[part] = MindFormerConfig()
        node = node[part]
    node[parts[-1]] = value


def load_config(argv=None):
    """Parse flags and return the resolved MindFormerConfig (nothing is built yet)."""
    from mindformers.tools.register import MindFormerConfig
    from mindformers.tools.utils import parse_value
    args, rest = run_parser().parse_known_args(argv)
    rest = [piece for item in rest for piece in item.split("=", 1)]
    if len(rest) % 2:
        raise ConfigError(f"extra arguments {rest} are not '--key value' pairs.")
    if not os.path.isfile(args.config):
        raise ConfigError(f"--config {args.config}: no such YAML file.")
    if args.register_path:
        os.environ["REGISTER_PATH"] = os.path.abspath(args.register_path)
        if os.environ["REGISTER_PATH"] not in sys.path:
            sys.path.append(os.environ["REGISTER_PATH"])
    try:
        config = MindFormerConfig(os.path.abspath(args.config),
                                  **({"run_mode": args.run_mode} if args.run_mode else {}))
    except Exception as err:  # YAML syntax, a missing base_config, a top level that is not a mapping
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
    while rest:
        key, value = rest.pop(0), rest.pop(0)
        if not key.startswith("--"):
            raise ConfigError(f"custom config key {key!r} must start with --, e.g. --model.model_config.seq_length 128")
        set_key(config, key[2:], parse_value(value))
    return config


def run(config):
    """Pre-flight, then the same calls as MindFormers' run_mindformer.py. Returns the trainer's result."""
    from mindformers.core.context import build_context
    from mindformers.trainer import Trainer
    from mindformers.utils.file_utils import set_output_path
    check_model_section(config)
    preflight(config)  # before set_output_path, which creates folders: a refused run writes nothing
    mark_checked(config)
    set_output_path(config.output_dir)
    build_context(config)
    metrics = _metrics(config)
    trainer = Trainer(config, compute_metrics=metrics)
    if config.run_mode in ("train", "finetune"):
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
    from mindformers.core.metric import build_metric
    metric = config.metric
    return {metric.type: build_metric(metric)}


def main(argv=None):
    try:
        config = load_config(argv)
        result = run(config)
    except GPTLocalError as err:
        print(f"gpt_local: error: {err}", file=sys.stderr)
        return 2
    if result is not None and config.run_mode == "eval":
        print(f"[gpt_local] eval: {result}", flush=True)
    if result is not None and config.run_mode.startswith("predict"):
        for item in result:
            for text in item.get("text_generation_text", []):
                print(f"[gpt_local] generated: {json.dumps(text)}", flush=True)
    return 0
