"""Checks run before anything is built or compiled, each failing with one clear error.

They cover what otherwise surfaces as a deep MindSpore traceback minutes later:
a YAML on the legacy path, bad model keys or types, missing, empty or
mis-shaped data, token ids the embedding cannot hold, sequence lengths that
disagree, a tokenizer larger than the vocabulary, a checkpoint of another size,
a damaged or pickle-based checkpoint, a checkpoint folder single-card
MindFormers will not load, resume without a checkpoint, an unwritable output
folder, an output folder that holds an earlier run. More checks live in ``inputs.py``; the checkpoint ones run
while ``mf/run_yaml.py`` resolves the file to load (its ``preflight``: ``check_run``, then that). This package sits
below ``mf/``: MindFormers' tables come in as ``names`` (``mf/symbols.py``).
"""
import os

import numpy as np

from ..errors import ConfigError, DataError
from ..parallel.rules import check_yaml_layout, launch_device_count, raise_if_bad
from .inputs import (check_earlier_run, check_enough_rows, check_instruct_records, check_megatron_pair, check_mindrecord_schema, check_output_dir,
                           check_device, check_structure,
                           check_tokenizers)
from .sections import check_sections
from .tokenizers import check_tokenizer_identity

SCAN_ROWS = 20000


def ensure_mcore(config, log=print):
    """gpt_local lives on MindFormers' mcore path; a gpt_local YAML without ``use_legacy: False`` is switched to it."""
    if config.get("use_legacy", True) is not False:
        config.use_legacy = False
        log("[gptlocal] model_type gpt_local runs on MindFormers' mcore path: using use_legacy: False "
            "(add `use_legacy: False` to the YAML to silence this).")


def model_config_of(config):
    """GPTLocalConfig from the YAML's model_config: validates names, types and shapes."""
    # imported here, not at the top: mf/registration.py imports this module before model.config
    from ..model.config import GPTLocalConfig
    values = {k: v for k, v in dict(config.model.model_config).items()
              if k not in ("model_type", "architectures", "auto_register")}
    values = {k: (v.to_dict() if hasattr(v, "to_dict") and not isinstance(v, dict) else v) for k, v in values.items()}
    return GPTLocalConfig(**_plain(values))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def dataset_files(section, key_prefix):
    """(kind, path, yaml key) of the data a dataset section reads."""
    loader = section.get("data_loader") or {}
    kind = loader.get("type")
    if kind == "MindDataset":
        return [("mindrecord", loader.get("dataset_dir"), f"{key_prefix}.data_loader.dataset_dir")]
    if kind == "BlendedMegatronDatasetDataLoader":
        paths = (loader.get("config") or {}).get("data_path") or []
        prefixes = [p for i, p in enumerate(paths) if i % 2 == 1] if len(paths) > 1 else list(paths)
        return [("megatron", p, f"{key_prefix}.data_loader.config.data_path") for p in prefixes]
    return []


def require_data_files(kind, path, key):
    """The data file (MindRecord) or pair (Megatron .bin/.idx) a dataset key names is there."""
    if kind == "mindrecord":
        if not path or not isinstance(path, str) or not os.path.isfile(path):
            split = "eval" if key.startswith("eval") else "train"
            raise DataError(f"{key}: {path!r} does not exist. Run `gptlocal prepare-data --out DIR` and point "
                            f"{key} at DIR/{split}.mindrecord (or pass --{split}_dataset_dir).")
        return
    for suffix in (".bin", ".idx"):
        if not isinstance(path, str) or not os.path.isfile(path + suffix):
            raise DataError(f"{key}: {path}{suffix} does not exist; give the prefix of a Megatron "
                            f".bin/.idx pair (without the suffix), as written by `gptlocal prepare-data`.")


def check_data_present(config):
    """Every data file the run reads is there (before the tokenizer checks, which read what lies beside it)."""
    for name in data_sections(config):
        for kind, path, key in dataset_files(config.get(name) or {}, name):
            require_data_files(kind, path, key)


def check_mindrecord(path, key, vocab_size, seq_length, columns=None, batch_size=None):
    require_data_files("mindrecord", path, key)
    from mindspore.mindrecord import FileReader
    try:
        reader = FileReader(path)
    except Exception as err:  # MindRecord raises RuntimeError/MRMOpenError variants
        raise DataError(f"{key}: {path} is not a readable MindRecord file ({err}).") from err
    try:
        check_mindrecord_schema(reader, path, key, columns or ("input_ids",))
        rows = 0
        for row in reader.get_next():
            rows += 1
            ids = np.asarray(row.get("input_ids", []))
            labels = np.asarray(row.get("labels", ids))
            if "input_ids" not in row:
                raise DataError(f"{key}: {path} has no 'input_ids' column (columns: {', '.join(row)}); write it "
                                f"with `gptlocal prepare-data`.")
            _check_ids(np.concatenate([ids.ravel(), labels.ravel()[labels.ravel() >= 0]]), vocab_size, key, path)
            if ids.size != seq_length:
                raise DataError(f"{key}: {path} holds sequences of {ids.size} tokens but model_config.seq_length "
                                f"is {seq_length}; prepare the data with --seq-length {seq_length} or set "
                                f"seq_length: {ids.size}.")
            if rows >= SCAN_ROWS:
                break
        if rows == 0:
            raise DataError(f"{key}: {path} holds no samples; prepare more text.")
        check_enough_rows(rows, batch_size, path, key)
    except DataError:
        raise
    except Exception as err:  # a damaged page surfaces while reading rows
        raise DataError(f"{key}: {path} could not be read ({err.__class__.__name__}: {err}); re-run "
                        f"`gptlocal prepare-data`.") from err
    finally:
        reader.close()


def check_megatron(prefix, key, vocab_size, names):
    require_data_files("megatron", prefix, key)
    dtype = check_megatron_pair(prefix, key, names)
    tokens = np.memmap(prefix + ".bin", dtype=dtype, mode="r")
    if tokens.size == 0:
        raise DataError(f"{key}: {prefix}.bin is empty; prepare more text.")
    _check_ids(tokens, vocab_size, key, prefix + ".bin")


def _check_ids(ids, vocab_size, key, path):
    if ids.size and (ids.max() >= vocab_size or ids.min() < 0):
        bad = int(ids.max()) if ids.max() >= vocab_size else int(ids.min())
        raise DataError(f"{key}: {path} holds token id {bad}, outside model_config.vocab_size ({vocab_size}). "
                        f"Set vocab_size to at least {int(ids.max()) + 1} or re-tokenize with the model's tokenizer.")


def data_sections(config):
    """The dataset sections this run reads."""
    sections = {"train": ["train_dataset"], "finetune": ["train_dataset"], "eval": ["eval_dataset"]}
    names = list(sections.get(config.run_mode, []))
    if config.run_mode in ("train", "finetune") and config.get("do_eval"):
        names.append("eval_dataset")
    return names


def check_data(config, model_config, names):
    for name in data_sections(config):
        section = config.get(name)
        if not section:
            raise ConfigError(f"run_mode {config.run_mode} needs a '{name}' section in the YAML.")
        for kind, path, key in dataset_files(section, name):
            if kind == "mindrecord":
                columns = section.get("input_columns") or ["input_ids"]
                batch_size = section.get("batch_size") or (config.get("runner_config") or {}).get("batch_size")
                if section.get("data_loader", {}).get("num_samples"):  # the loader reads only that many
                    batch_size = None
                check_mindrecord(path, key, model_config.vocab_size, model_config.seq_length, columns,
                                 batch_size if section.get("drop_remainder", True) else None)
            else:
                check_megatron(path, key, model_config.vocab_size, names)
        check_instruct_records(section, name, model_config.seq_length)


def check_not_int8_training(config, model_config):
    """An int8 model (``gptlocal quantize``: model_config or pretrained_model_dir's config.json ``quantization``,
    or int8 tensors in the weights load_checkpoint names) is for inference: training or finetuning from it is
    refused with one line naming where it came from."""
    if config.run_mode not in ("train", "finetune"):
        return
    from ..model.quantization import read_quantization  # pylint: disable=import-outside-toplevel
    from ..safetensors_io import CONFIG_NAME, SafetensorsReader, resolve_weights_file  # pylint: disable=import-outside-toplevel
    found = "model_config.quantization" if read_quantization(model_config.quantization) else None
    pretrained = config.get("pretrained_model_dir")
    if not found and pretrained and os.path.isfile(os.path.join(pretrained, CONFIG_NAME)):
        import json  # pylint: disable=import-outside-toplevel
        with open(os.path.join(pretrained, CONFIG_NAME), encoding="utf-8") as handle:
            if (json.load(handle) or {}).get("quantization"):
                found = f"pretrained_model_dir {pretrained}"
    checkpoint = config.get("load_checkpoint")
    if not found and checkpoint and isinstance(checkpoint, str) and os.path.exists(checkpoint):
        try:
            reader = SafetensorsReader(resolve_weights_file(checkpoint))
        except Exception:  # pylint: disable=broad-except  # not ours to judge here: the loader names it
            reader = None
        if reader is not None and any(reader.header[name]["dtype"] == "I8" for name in reader.names()):
            found = f"load_checkpoint {checkpoint}"
    if found:
        raise ConfigError(f"{found} is an int8 model (`gptlocal quantize`), which is for inference only (generate, "
                          f"chat, serve, eval); run_mode {config.run_mode} needs the float model directory it was "
                          f"quantized from.")


def check_layout(config):
    """The parallel layout rules ``gptlocal plan`` applies, on the run's YAML."""
    raise_if_bad(check_yaml_layout(config, launch_device_count(config)))


def check_run(config, names, log=print):
    """Every check of a gpt_local run; writes nothing and changes no key but use_legacy (``ensure_mcore``).
    ``names``: MindFormers' (``mf/symbols.py``, handed down by ``mf/run_yaml.py`` ``preflight``: this package sits
    below ``mf/``). Returns the model's GPTLocalConfig."""
    ensure_mcore(config, log)
    check_structure(config)
    check_sections(config, names)  # top-level keys, runner, context, parallel, optimizer, lr_schedule, callbacks
    check_device(config)
    model_config = model_config_of(config)
    check_layout(config)
    check_output_dir(config)
    check_earlier_run(config)  # a run already in output_dir: resume, overwrite or a new folder
    check_data_present(config)  # a missing file is named as missing, not by what lies beside it
    check_tokenizers(config, model_config)  # before the data: a wrong tokenizer is the root cause of bad ids
    check_tokenizer_identity(config, log)  # model, data and saved tokenizer: one tokenizer (tokenizers.py)
    check_data(config, model_config, names)
    check_not_int8_training(config, model_config)
    if config.run_mode == "predict" and config.get("pretrained_model_dir"):
        tokenizer = os.path.join(config.pretrained_model_dir, "tokenizer.json")
        if not os.path.isfile(tokenizer):
            raise DataError(f"pretrained_model_dir: {tokenizer} does not exist; predict loads the tokenizer from "
                            f"there (write it with `gptlocal prepare-data`).")
    return model_config


