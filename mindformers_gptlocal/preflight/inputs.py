"""More pre-flight checks on user input: YAML structure and numbers, the output folder, data schemas,
tokenizers and checkpoint files. Each raises one GPTLocalError naming the key or file and the fix, and
none writes anything (a refused run leaves the output folder as it was).
"""
import json
import os
import tempfile

import numpy as np

from ..errors import ConfigError, DataError


def check_structure(config):
    """Sections that must be mappings and runner numbers that must be positive integers."""
    model = config.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("model_config"), dict):
        raise ConfigError("model.model_config must be a mapping of model keys (model_type: gpt_local, "
                          "hidden_size: ..., ...); check the YAML's indentation under model:.")
    model_config = model["model_config"]
    if model_config.get("model_type") != "gpt_local":
        raise ConfigError(f"model.model_config.model_type is {model_config.get('model_type')!r}; set it to "
                          f"gpt_local (architectures names GPTLocalForCausalLM).")
    if model_config.get("architectures") not in (["GPTLocalForCausalLM"], "GPTLocalForCausalLM"):
        raise ConfigError(f"model.model_config.architectures is {model_config.get('architectures')!r}; set it "
                          f"to [\"GPTLocalForCausalLM\"].")
    for section in ("runner_config", "train_dataset", "eval_dataset", "parallel_config", "runner_wrapper",
                    "lr_schedule", "optimizer", "context"):
        if config.get(section) is not None and not isinstance(config.get(section), dict):
            raise ConfigError(f"{section} must be a mapping, got {config.get(section)!r}; check the YAML.")
    if config.get("callbacks") is not None and (not isinstance(config.callbacks, list) or
                                                 not all(isinstance(c, dict) and c.get("type") for c in
                                                         config.callbacks)):
        raise ConfigError("callbacks must be a list of mappings, each with a type: (e.g. - type: "
                          "GPTLocalThroughputMonitor).")
    runner = config.get("runner_config") or {}
    for key in ("batch_size", "epochs", "gradient_accumulation_steps"):
        _positive_int(runner, key, "runner_config")
    for section in ("train_dataset", "eval_dataset"):
        _positive_int(config.get(section) or {}, "batch_size", section)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = model_config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigError(f"model.model_config.{key} must be a token id (an integer >= 0), got {value!r}.")


def check_device(config):
    """The device MindFormers will use (its default is Ascend when context.device_target is unset) must exist."""
    target = (config.get("context") or {}).get("device_target") or "Ascend"
    if target not in ("CPU", "GPU", "Ascend"):
        raise ConfigError(f"context.device_target {target!r} is not one of CPU, GPU, Ascend.")
    unset = "" if (config.get("context") or {}).get("device_target") else " (unset: MindFormers defaults to Ascend)"
    require_device(target, f"context.device_target is {target}{unset}",
                   "set context.device_target (or --device_target) to CPU")
    optimizer = config.get("optimizer") or {}
    if target == "CPU" and optimizer.get("use_fused"):
        raise ConfigError("optimizer.use_fused: True selects MindFormers' FusedAdamW, whose AdamW kernel does not "
                          "exist on CPU. Set optimizer.type: GPTLocalAdamW (the same update, fused, on every "
                          "backend) and remove use_fused.")


def require_device(target, what, fix):
    """``target`` (CPU, GPU, Ascend) has a usable backend in this MindSpore, else one ConfigError: ``what`` names
    where it was chosen, ``fix`` says what to do instead."""
    import logging
    import mindspore as ms
    from mindspore import log as ms_log
    logger = ms_log._get_logger()  # pylint: disable=protected-access
    level = logger.level
    logger.setLevel(logging.ERROR)  # its "backend not available" warnings: the error below says it once
    try:
        available = ms.hal.is_available(target)
    finally:
        logger.setLevel(level)
    if not available:
        raise ConfigError(f"{what}, but this MindSpore has no usable {target} backend; {fix} or install the "
                          f"{target} software.")


def _positive_int(section, key, name):
    """A key that is present must hold a positive integer (a YAML `key:` with no value is None)."""
    if key in section:
        value = section[key]
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ConfigError(f"{name}.{key} must be a positive integer, got {value!r}.")


def check_output_dir(config):
    """Probe by creating and removing a temp entry where output_dir would go: works for root too."""
    out = os.path.abspath(str(config.get("output_dir") or "./output"))
    probe = out
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise ConfigError(f"output_dir {out} cannot be created: {probe} is a file, not a folder; set output_dir "
                          f"(or --output_dir) to a folder you can write.")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".gptlocal-probe-", dir=probe))
    except OSError as err:
        raise ConfigError(f"output_dir {out} is not writable ({err.strerror} in {probe}); set output_dir (or "
                          f"--output_dir) to a folder you can write.") from err


OVERWRITE_KEY = "overwrite_output_dir"  # the run YAML's top-level key (gptlocal run --overwrite_output_dir True)


def model_subdirs(config):
    """The model directories a run writes under output_dir: each GPTLocalSaveModelDir's ``subdir``, and model/."""
    subdirs = ["model"]
    for callback in config.get("callbacks") or []:
        if isinstance(callback, dict) and callback.get("type") == "GPTLocalSaveModelDir":
            subdirs.append(str(callback.get("subdir") or "model"))
    return tuple(dict.fromkeys(subdirs))


def _inside(path, folder):
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return os.path.commonpath([path, folder]) == folder


def resumes_output_dir(config):
    """Whether a ``resume_training`` run continues the run in its own ``<output_dir>/checkpoint`` (as
    ``mf/run_yaml.py resume_folder`` picks it: load_checkpoint unset, a model directory, or inside that folder)."""
    source = config.get("load_checkpoint")
    if not source or not isinstance(source, str):
        return True
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "config.json")):
        return True
    return _inside(source, os.path.join(str(config.get("output_dir") or "./output"), "checkpoint"))


def check_earlier_run(config):
    """A training run never lands silently on an earlier one: an output_dir that holds a run's checkpoints or model
    directory is refused, naming its newest checkpoint and step and the choices, unless the run resumes that run
    (``resume_training``) or says ``overwrite_output_dir: True`` (``mf/run_yaml.py start_over`` then removes them).
    Decided from the files present before the run starts, so every rank of a launch decides the same."""
    from ..checkpoint.resume import earlier_run  # pylint: disable=import-outside-toplevel
    overwrite = config.get(OVERWRITE_KEY)
    if overwrite is not None and not isinstance(overwrite, bool):
        raise ConfigError(f"{OVERWRITE_KEY} is {overwrite!r}; use True (start over: the earlier run's checkpoints "
                          f"and model directory in output_dir are deleted) or False.")
    if config.run_mode not in ("train", "finetune"):
        return
    resume = bool(config.get("resume_training"))
    if overwrite and resume and resumes_output_dir(config):
        raise ConfigError(f"resume_training and {OVERWRITE_KEY} are both set: resume continues the run in output_dir, "
                          f"overwrite deletes it; keep one.")
    out = str(config.get("output_dir") or "./output")
    found = earlier_run(out, model_subdirs(config))
    if found is None or (resume and resumes_output_dir(config)):
        return
    if overwrite:
        checkpoint = config.get("load_checkpoint")
        doomed = [found.checkpoint_dir, *found.model_dirs]
        if isinstance(checkpoint, str) and checkpoint and any(_inside(checkpoint, d) for d in doomed):
            raise ConfigError(f"load_checkpoint {checkpoint} is inside what {OVERWRITE_KEY} deletes (the earlier "
                              f"run's {', '.join(doomed)}); copy the weights elsewhere first, or pass a new "
                              f"--output_dir.")
        return
    held = []
    if found.checkpoint:
        held.append(f"newest checkpoint {found.checkpoint} (step {found.step})")
    held += [f"model directory {d}" for d in found.model_dirs]
    if resume:
        raise ConfigError(f"output_dir {out} holds another training run: {', '.join(held)}; resuming "
                          f"{config.get('load_checkpoint')} into it would replace its model directory and mix the two "
                          f"runs' checkpoints. Pass a new --output_dir, or --{OVERWRITE_KEY} True to delete that run "
                          f"first.")
    raise ConfigError(f"output_dir {out} holds a training run: {', '.join(held)}; a new run would start at step 1 "
                      f"and replace it. Continue it with --resume_training True (a finished run: with a larger "
                      f"runner_config.epochs), start over with --{OVERWRITE_KEY} True (deletes its checkpoint folder "
                      f"and model directory), or pass a new --output_dir.")


def check_mindrecord_schema(reader, path, key, columns):
    """Every column the YAML feeds the model is present, token columns hold integers."""
    schema = reader.schema() if hasattr(reader, "schema") else {}
    fields = schema.get("schema", schema) if isinstance(schema, dict) else {}
    missing = [c for c in columns if c not in fields]
    if fields and missing:
        raise DataError(f"{key}: {path} lacks column(s) {missing} (it has {sorted(fields)}); the YAML's "
                        f"input_columns need them. Write the data with `gptlocal prepare-data`.")
    for column in ("input_ids", "labels", "position_ids"):
        kind = (fields.get(column) or {}).get("type")
        if kind and not kind.startswith("int"):
            raise DataError(f"{key}: {path} column '{column}' holds {kind}, not integers; token ids must be "
                            f"int32/int64. Write the data with `gptlocal prepare-data`.")


def check_enough_rows(rows, batch_size, path, key):
    if batch_size and rows < batch_size:
        raise DataError(f"{key}: {path} holds {rows} sample(s), fewer than one batch ({batch_size}), so training "
                        f"would run no step; prepare more text or lower batch_size.")


def check_megatron_pair(prefix, key, names):
    """The .idx parses as a Megatron index (MindFormers' reader, ``names.MegatronIndexReader``: ``mf/symbols.py``) and
    the .bin is exactly as long as the index says."""
    try:
        index = names.MegatronIndexReader(prefix + ".idx", multimodal=False)
        dtype, sizes, pointers = index.dtype, index.sequence_lengths, index.sequence_pointers
    except Exception as err:  # the reader asserts on its magic header and raises struct/numpy errors
        raise DataError(f"{key}: {prefix}.idx is not a Megatron index ({err.__class__.__name__}: {err}); "
                        f"write the pair with `gptlocal prepare-data`.") from err
    if len(sizes) == 0:
        raise DataError(f"{key}: {prefix}.idx lists no documents; prepare more text.")
    expected = int(pointers[-1]) + int(sizes[-1]) * np.dtype(dtype).itemsize
    actual = os.path.getsize(prefix + ".bin")
    if actual != expected:
        raise DataError(f"{key}: {prefix}.bin has {actual} bytes but {prefix}.idx describes {expected}; the pair "
                        f"does not belong together or one is truncated. Re-run `gptlocal prepare-data`.")
    return dtype


def tokenizer_size(path):
    """1 + the largest token id of a tokenizer.json (plain JSON, no code executed)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
        vocab = (data.get("model") or {}).get("vocab") or {}
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [t.get("id", 0) for t in data.get("added_tokens") or []]
        return max(int(i) for i in ids) + 1
    except (OSError, ValueError, TypeError, AttributeError) as err:
        raise DataError(f"{path} is not a readable tokenizer.json ({err.__class__.__name__}: {err}); write it "
                        f"with `gptlocal prepare-data` or `gptlocal convert hf2ms`.") from err


def check_tokenizers(config, model_config):
    """A tokenizer the run reads or copies must not produce ids the embedding cannot hold."""
    places = []
    if config.run_mode.startswith("predict") and config.get("pretrained_model_dir"):
        places.append(("pretrained_model_dir", config.pretrained_model_dir))
    for callback in config.get("callbacks") or []:
        if callback.get("type") == "GPTLocalSaveModelDir" and callback.get("tokenizer_dir"):
            places.append(("callbacks.GPTLocalSaveModelDir.tokenizer_dir", callback["tokenizer_dir"]))
    for key, folder in places:
        path = os.path.join(str(folder), "tokenizer.json")
        if not os.path.isfile(path):
            continue  # predict's own check names a missing tokenizer; the save callback copies what exists
        size = tokenizer_size(path)
        if size > model_config.vocab_size:
            raise DataError(f"{key}: {path} has {size} token ids but model_config.vocab_size is "
                            f"{model_config.vocab_size}; set vocab_size: {size} or use the tokenizer the data "
                            f"and model were made with.")


def check_instruct_records(section, key, seq_length):
    """An HFDataLoader with GPTLocalInstructHandler: the handler's seq_length is the model's, and every record
    of its local JSON/JSONL files is well-formed, so a bad one stops the run here, named by file and line
    (inside the handler, ``datasets`` has already dropped the lines)."""
    from ..data import instruct
    loader = section.get("data_loader") or {}
    handlers = loader.get("handler") or []
    handlers = [h for h in (handlers if isinstance(handlers, list) else [handlers])
                if isinstance(h, dict) and h.get("type") == "GPTLocalInstructHandler"]
    if loader.get("type") != "HFDataLoader" or not handlers:
        return
    handler = handlers[0]
    if handler.get("seq_length") != seq_length:
        raise ConfigError(f"{key}.data_loader.handler GPTLocalInstructHandler.seq_length is "
                          f"{handler.get('seq_length')} but model_config.seq_length is {seq_length}; set them equal.")
    fmt = handler.get("format", "alpaca")
    if fmt not in instruct.FORMATS:
        raise ConfigError(f"{key}.data_loader.handler GPTLocalInstructHandler.format is {fmt!r}; choose "
                          f"{' or '.join(instruct.FORMATS)}.")
    files = loader.get("data_files")
    files = [files] if isinstance(files, str) else list(files or []) if isinstance(files, list) else []
    make = instruct.alpaca_segments if fmt == "alpaca" else instruct.chat_segments
    for path in files:
        if not os.path.isfile(path):
            raise DataError(f"{key}.data_loader.data_files: {path} does not exist; give a local .json or .jsonl file "
                            f"of {fmt} records.")
        count = 0
        for line, record in instruct.read_records(path):
            make(record, f"{path}:{line}")
            count += 1
        if not count:
            raise DataError(f"{path}: no records; give JSONL (one object a line) or a JSON array of records.")
