"""Pre-flight: a model meets only data made by its own tokenizer.

Every place a run takes a tokenizer from has an id by content (``tokenizer_id.py``): the model directory it
loads (``load_checkpoint``: its recorded ``tokenizer_id``), the tokenizer predict and the instruction handler
tokenize with (``pretrained_model_dir``), each prepared data set (its ``meta.json``) and the tokenizer the
run's model directory will be saved with (``GPTLocalSaveModelDir.tokenizer_dir``). All known ids must be
equal; the first that differs stops the run with one DataError naming both files and the fix.

Older folders, written before ids existed, are checked as far as they can be: a model directory without
``tokenizer_id`` is identified by its tokenizer files; a data set whose ``meta.json`` has no ``tokenizer_id``
(or that has no ``meta.json``: not made by ``prepare-data``) gets one warning line and is not compared,
because refusing every data set made before this check would break runs that were right.
"""
import os

from ..errors import ConfigError, DataError
from ..tokenizer_id import check_model_dir, dataset_meta, model_dir_id, short, tokenizer_files_id

SECTIONS = {"train": ["train_dataset"], "finetune": ["train_dataset"], "eval": ["eval_dataset"]}


def _model_folder(path):
    """The model directory a load_checkpoint value names (a folder, or a file inside one), or None."""
    if not isinstance(path, str) or not path:
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path)) if os.path.isfile(path) else None
    return folder if folder and os.path.isfile(os.path.join(folder, "config.json")) else None


def tokenizer_sources(config, log=print):
    """[(yaml key, file, tokenizer id, folder)] of every tokenizer this run meets, the model's first."""
    from .checks import dataset_files  # checks.py imports this module
    sources = []
    run_mode = config.get("run_mode") or "train"
    resuming = config.get("resume_training") and run_mode in ("train", "finetune")
    folder = None if resuming else _model_folder(config.get("load_checkpoint"))
    if folder:
        check_model_dir(folder)
        tid, path = model_dir_id(folder)
        if tid:
            sources.append(("load_checkpoint", path, tid, folder))
        else:
            log(f"[gptlocal] warning: load_checkpoint {folder} has no tokenizer files and no tokenizer_id, so "
                f"the tokenizer of its data cannot be checked.")
    pretrained = config.get("pretrained_model_dir")
    if pretrained:
        if not os.path.isdir(str(pretrained)):
            raise ConfigError(f"pretrained_model_dir {pretrained} does not exist; point it at a model directory "
                              f"(tokenizer.json + config.json), e.g. the one load_checkpoint names.")
        check_model_dir(pretrained)
        tid, path = tokenizer_files_id(pretrained)
        if tid:
            sources.append(("pretrained_model_dir", path, tid, pretrained))
    names = list(SECTIONS.get(run_mode, []))
    if run_mode in ("train", "finetune") and config.get("do_eval"):
        names.append("eval_dataset")
    for name in names:
        for _, data_path, key in dataset_files(config.get(name) or {}, name):
            meta, meta_path = dataset_meta(data_path)
            if meta is None or not meta.get("tokenizer_id"):
                why = "has no meta.json beside it" if meta is None else f"{meta_path} records no tokenizer_id"
                log(f"[gptlocal] warning: {key} {data_path} {why} (not made by this version of `gptlocal "
                    f"prepare-data`), so its tokenizer cannot be checked against the model's.")
                continue
            model_dir = meta.get("model_dir") if os.path.isdir(str(meta.get("model_dir"))) else None
            sources.append((key, meta_path, meta["tokenizer_id"], model_dir))
    if run_mode in ("train", "finetune"):
        for callback in config.get("callbacks") or []:
            if callback.get("type") != "GPTLocalSaveModelDir" or not callback.get("tokenizer_dir"):
                continue
            key, tokenizer_dir = "callbacks.GPTLocalSaveModelDir.tokenizer_dir", str(callback["tokenizer_dir"])
            if not os.path.isdir(tokenizer_dir):
                raise ConfigError(f"{key} {tokenizer_dir} does not exist, so the trained model directory would "
                                  f"have no tokenizer; point it at the folder of the tokenizer the data was made "
                                  f"with (prepare-data's <out>/model, or the model directory you finetune).")
            check_model_dir(tokenizer_dir)
            tid, path = tokenizer_files_id(tokenizer_dir)
            if tid is None:
                raise ConfigError(f"{key} {tokenizer_dir} holds no tokenizer.json (nor vocab.json + merges.txt), "
                                  f"so the trained model directory would have no tokenizer; point it at the folder "
                                  f"of the tokenizer the data was made with.")
            sources.append((key, path, tid, tokenizer_dir))
    return sources


def _fix(reference, other):
    ref_key, _, _, ref_folder = reference
    key, _, _, _ = other
    where = ref_folder or os.path.dirname(reference[1])
    if key.endswith("tokenizer_dir"):
        return f"set {key} to {where}"
    if key == "pretrained_model_dir":
        return f"set pretrained_model_dir to {where}"
    if ref_folder and not ref_key.endswith(("dataset_dir", "data_path")):
        return (f"make the data with the model's tokenizer (`gptlocal prepare-data --tokenizer "
                f"{os.path.join(where, 'tokenizer.json')} --out DIR ...`) and point {key} at it, or set "
                f"{ref_key} to the model that data was made for")
    return f"give {key} data made with the same tokenizer as {ref_key} (`gptlocal prepare-data --tokenizer ...`)"


def check_tokenizer_identity(config, log=print):
    """One DataError, naming both files and the fix, when two tokenizers of this run differ."""
    sources = tokenizer_sources(config, log)
    if not sources:
        return
    reference = sources[0]
    for other in sources[1:]:
        if other[2] != reference[2]:
            raise DataError(f"tokenizer mismatch: {other[0]} {other[1]} is tokenizer {short(other[2])}, but "
                            f"{reference[0]} {reference[1]} is tokenizer {short(reference[2])}: the same token ids "
                            f"would mean other text. Fix: {_fix(reference, other)}.")
