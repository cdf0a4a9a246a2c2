"""A tokenizer's identity by content: a sha256 of its vocabulary and merges, normalised so that how the
``tokenizer.json`` is formatted (indentation, key order, ``"a b"`` or ``["a", "b"]`` merges, added tokens
listed apart or inside the vocabulary) does not change it, and GPT-2's ``vocab.json`` + ``merges.txt`` give
the same id as the ``tokenizer.json`` built from them.

Model directories keep the id of the tokenizer their weights were trained with in ``tokenizer_id``
(written by ``save_pretrained``, the converters, ``GPTLocalSaveModelDir`` and ``prepare-data``); each prepared
data set keeps the id of the tokenizer that made its token ids in its ``meta.json``. The pre-flight
(``preflight/tokenizers.py``) and ``from_pretrained`` compare them. Plain JSON only: no heavy import.
"""
import hashlib
import json
import os

from .errors import DataError

ID_FILE = "tokenizer_id"
META_FILE = "meta.json"


def _canonical(vocab, merges):
    merges = [" ".join(m) if isinstance(m, (list, tuple)) else str(m) for m in merges or []]
    if isinstance(vocab, dict):
        vocab = sorted(((str(k), int(v)) for k, v in vocab.items()), key=lambda kv: (kv[1], kv[0]))
    text = json.dumps({"vocab": vocab, "merges": merges}, ensure_ascii=False, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()


def id_of_tokenizer_json(data):
    """The id of a parsed ``tokenizer.json`` (a dict)."""
    model = data.get("model") or {}
    vocab = model.get("vocab") or {}
    if isinstance(vocab, dict):
        vocab = dict(vocab)
        for token in data.get("added_tokens") or []:
            vocab[token["content"]] = token["id"]
    return _canonical(vocab, model.get("merges"))


def id_of_gpt2_files(vocab_path, merges_path):
    """The id of GPT-2's ``vocab.json`` + ``merges.txt`` (equal to that of the tokenizer.json made from them)."""
    with open(vocab_path, encoding="utf-8") as handle:
        vocab = json.load(handle)
    with open(merges_path, encoding="utf-8") as handle:
        merges = [line.rstrip("\r\n") for line in handle]
    merges = [m for m in merges if m and not m.startswith("#version")]
    return _canonical(vocab, merges)


def id_of_tokenizer(tokenizer):
    """The id of a ``tokenizers.Tokenizer`` object."""
    return id_of_tokenizer_json(json.loads(tokenizer.to_str()))


def id_of_file(path):
    """The id of a ``tokenizer.json`` file; a DataError naming the file if it cannot be read."""
    try:
        with open(path, encoding="utf-8") as handle:
            return id_of_tokenizer_json(json.load(handle))
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as err:
        raise DataError(f"{path} is not a readable tokenizer.json ({err.__class__.__name__}: {err}); write it "
                        f"with `gptlocal prepare-data` or `gptlocal convert hf2ms`.") from err


def tokenizer_files_id(folder):
    """(id, file) of the tokenizer files in ``folder`` (tokenizer.json, else vocab.json + merges.txt), or
    (None, None) when it holds none."""
    path = os.path.join(folder, "tokenizer.json")
    if os.path.isfile(path):
        return id_of_file(path), path
    vocab, merges = os.path.join(folder, "vocab.json"), os.path.join(folder, "merges.txt")
    if os.path.isfile(vocab) and os.path.isfile(merges):
        return id_of_gpt2_files(vocab, merges), vocab
    return None, None


def recorded_id(folder):
    """The id stored in ``folder/tokenizer_id`` (None for folders written before ids existed)."""
    path = os.path.join(folder, ID_FILE)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as handle:
        value = handle.read().strip()
    return value or None


def write_id(folder, tokenizer_id=None):
    """Record ``tokenizer_id`` (default: that of the folder's own tokenizer files) in ``folder``. A folder with
    no tokenizer and no id given gets none. Returns the id."""
    if tokenizer_id is None:
        tokenizer_id, _ = tokenizer_files_id(folder)
    if tokenizer_id:
        with open(os.path.join(folder, ID_FILE), "w", encoding="utf-8") as handle:
            handle.write(tokenizer_id + "\n")
    return tokenizer_id


def model_dir_id(folder):
    """(id, file) of the tokenizer a model directory's weights were trained with: its ``tokenizer_id`` if
    recorded, else that of its tokenizer files (older folders), else (None, None)."""
    recorded = recorded_id(folder)
    if recorded:
        return recorded, os.path.join(folder, ID_FILE)
    return tokenizer_files_id(folder)


def check_model_dir(folder):
    """A model directory's tokenizer files must be the tokenizer its weights were trained with (its
    ``tokenizer_id``): a DataError naming both files otherwise. Returns the id (None if unknown)."""
    recorded = recorded_id(folder)
    files_id, path = tokenizer_files_id(folder)
    if recorded and files_id and recorded != files_id:
        raise DataError(f"{path} is not the tokenizer this model was trained with: it is {short(files_id)}, but "
                        f"{os.path.join(folder, ID_FILE)} records {short(recorded)}. Put the model's own "
                        f"tokenizer files back in {folder} (or retrain the model on data made with this tokenizer).")
    return recorded or files_id


def dataset_meta(path):
    """(meta dict, meta.json path) of the ``prepare-data`` folder a data file or Megatron prefix lies in, or
    (None, None). Looks in the file's folder and the one above it (``megatron/`` prefixes)."""
    if not isinstance(path, str) or not path:
        return None, None
    folder = os.path.dirname(os.path.abspath(path))
    for candidate in (folder, os.path.dirname(folder)):
        meta_path = os.path.join(candidate, META_FILE)
        if os.path.isfile(meta_path):
            try:
                with open(meta_path, encoding="utf-8") as handle:
                    meta = json.load(handle)
            except (OSError, ValueError):
                return None, None
            return (meta, meta_path) if isinstance(meta, dict) else (None, None)
    return None, None


def short(tokenizer_id):
    """``sha256:1a2b3c4d5e6f`` (the first 12 hex digits) for messages."""
    return tokenizer_id[:19] if tokenizer_id else "unknown"
