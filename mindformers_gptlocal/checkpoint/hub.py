"""Models by name: a Hugging Face model id (``gpt2``, ``openai-community/gpt2``) found in the LOCAL Hugging Face
cache, for ``--model`` (generate, chat, serve, eval) and ``convert hf2ms --hf-dir``. Never the network.

* A path that exists always wins over an id.
* The id is looked up with ``huggingface_hub``'s own cache API (``snapshot_download(local_files_only=True)``:
  ``HF_HUB_CACHE``, else ``HF_HOME/hub``, else ``~/.cache/huggingface/hub``; ``refs/main`` names the snapshot).
  A bare name (``gpt2``) that is not cached as such is also found as the one cached ``ORG/gpt2``.
* A snapshot that is a gpt_local model directory (``model_type: gpt_local``) is used as it is; a Hugging Face
  GPT-2 / Llama / NeoX snapshot is converted once, by ``gptlocal convert hf2ms``'s own code
  (``hf_models.hf_to_ms``), into ``$XDG_CACHE_HOME/mindformers_gptlocal/hub/<org>--<name>/<commit>`` (written
  whole or not at all), and that folder is used from then on.
* An id absent from the cache: one line naming the id, the cache folder searched and how to fill it.
"""
import json
import os
import re
import sys

from ..errors import CheckpointError, ConfigError

ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def hub_cache():
    """The Hugging Face cache folder ``huggingface_hub`` searches (its own constant)."""
    from huggingface_hub import constants
    return constants.HF_HUB_CACHE


def _snapshot(repo_id):
    """The cached snapshot folder of ``repo_id`` (models), or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError
    try:
        return snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        return None


def _bare_name_match(name):
    """The one cached model ``ORG/name`` for a bare ``name`` (``gpt2`` -> ``openai-community/gpt2``), or None."""
    from huggingface_hub import scan_cache_dir
    try:
        repos = scan_cache_dir(hub_cache()).repos
    except Exception:  # noqa: BLE001  (no cache folder, or an unreadable one: nothing cached)
        return None
    found = sorted(r.repo_id for r in repos if r.repo_type == "model" and r.repo_id.split("/")[-1] == name)
    return found[0] if len(found) == 1 else None


def find_snapshot(value, flag):
    """(repo id, snapshot folder) of ``value`` in the local Hugging Face cache; one ConfigError when absent."""
    try:
        import huggingface_hub  # noqa: F401  (tokenizers and transformers install it)
    except ImportError as err:
        raise ConfigError(f"{flag} {value} is not a folder, and looking it up as a Hugging Face model id needs "
                          f"huggingface_hub ({err}); pip install huggingface_hub, or give a model directory.") from err
    repo_id, folder = value, _snapshot(value)
    if folder is None and "/" not in value:
        match = _bare_name_match(value)
        if match is not None:
            repo_id, folder = match, _snapshot(match)
    if folder is None or not os.path.isfile(os.path.join(folder, "config.json")):
        raise ConfigError(
            f"{flag} {value} is not a folder, and the model id {value!r} is not in the local Hugging Face cache "
            f"({hub_cache()}); on a machine with network run `huggingface-cli download {value}` and copy that cache "
            f"here, or set HF_HUB_CACHE to a cache that holds it (no download happens at run time), or give a "
            f"model directory.")
    return repo_id, folder


def looks_like_id(value):
    return isinstance(value, str) and not os.path.exists(value) and bool(ID.match(value))


def resolve_hf_dir(value, flag="--hf-dir"):
    """``convert hf2ms --hf-dir``: a folder as is, else the cached snapshot folder of the id ``value``."""
    if not looks_like_id(value):
        return value
    return find_snapshot(value, flag)[1]


def converted_dir(repo_id, snapshot):
    """Where the gpt_local conversion of ``snapshot`` (a commit of ``repo_id``) lives."""
    from ..kernels.abi.build import user_cache
    return os.path.join(user_cache("hub"), repo_id.replace("/", "--"), os.path.basename(os.path.normpath(snapshot)))


def resolve_model(value, flag="--model", log=sys.stderr):
    """A gpt_local model directory for ``--model value``: an existing path as is (checked later by the loader);
    else the Hugging Face id's cached snapshot, used as is when it is a gpt_local directory, else converted once
    (module docstring). Returns the folder."""
    if not looks_like_id(value):
        return value
    repo_id, snapshot = find_snapshot(value, flag)
    with open(os.path.join(snapshot, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    if config.get("model_type") == "gpt_local":
        return snapshot
    out = converted_dir(repo_id, snapshot)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from ..staging import write_folder
    from . import hf_models
    if log is not None:
        log.write(f"[gptlocal] {flag} {value}: converting the Hugging Face snapshot {snapshot} into {out} (once; "
                  f"as `gptlocal convert hf2ms --hf-dir {value} --out DIR` does)\n")
        log.flush()
    try:
        write_folder(out, lambda folder: hf_models.hf_to_ms(snapshot, folder), CheckpointError)
    except CheckpointError as err:
        raise CheckpointError(f"{flag} {value}: the cached snapshot {snapshot} cannot be converted: {err}") from err
    return out
