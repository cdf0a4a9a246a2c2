"""The converter framework: a ``Family`` is one foreign architecture (Hugging Face GPT-2, Llama/Qwen2,
GPT-NeoX; MindFormers' 1.x GPT-2) as a config translation each way, refusing what would change the maths, and
ONE weight map, a list of (gpt_local name, foreign names, kind) that both directions read: litgpt's
``convert_hf_checkpoint.py`` design. ``"{}"`` in a name is the layer index; entries whose gpt_local name is not
in the model's parameter table (biases it lacks, the untied head of a tied model) are skipped.

Kinds, each a pure permutation (hf -> ms -> hf is bit-exact):

- ``copy``: the same tensor.
- ``transpose``: [in, out] <-> [out, in] (HF GPT-2's Conv1D, MindFormers' ``transpose_b=False`` Linears).
- ``groups``: separate q [N*D, ...], k, v [G*D, ...] <-> gpt_local's group-major fused QKV,
  [(G, N/G q + k + v, D), ...] (``model/attention.py``); with G = N it is the head-major [(head, qkv, D)].
- ``qkv_weight`` / ``qkv_bias``: HF GPT-2's fused ``c_attn``, [in, q|k|v] / [q|k|v]: split, then ``groups``.

``hf_to_ms`` / ``ms_to_hf`` are the two directions for any HF family (streamed tensor by tensor, written
all at once, a failure leaves nothing); ``hf_models`` picks the family from config.json or the model.
Pure numpy: no MindSpore, no torch (except to read a weights-only ``.bin``).
"""
import json
import os

import numpy as np

from ..errors import CheckpointError
from ..model.arch import Arch, rotary_dim
from ..model.params import parameter_table
from ..parallel.layout import Layout
from ..safetensors_io import SafetensorsReader, resolve_weights_file, write_safetensors_streamed
from ..staging import write_folder
from .weights_io import TensorSource, copy_tokenizer, read_json, read_ms_config, write_ms_dir

KINDS = ("copy", "transpose", "groups", "qkv_weight", "qkv_bias")


def expected_shapes(local):
    """gpt_local tensor name -> shape, from a gpt_local config dict (the parameter table's shapes)."""
    return {name: spec.shape for name, spec in parameter_table(local, Layout()).items()}


# ---------------------------------------------------------------------------------------------
# tensor layouts, by kind
def _group_dims(local):
    heads = local["num_attention_heads"]
    groups = Arch.of(local).groups
    return groups, heads // groups, local["hidden_size"] // heads


def _qkv_rows(local):
    """The q, k, v widths (rows of the fused QKV): N*D, G*D, G*D."""
    groups, per_group, dim = _group_dims(local)
    return groups * per_group * dim, groups * dim, groups * dim


def foreign_shapes(kind, shape, local):
    """The foreign tensors' shapes for a gpt_local tensor of ``shape``."""
    shape = tuple(shape)
    if kind == "copy":
        return [shape]
    if kind == "transpose":
        return [tuple(reversed(shape))]
    rest = shape[1:]
    if kind == "groups":
        return [(rows,) + rest for rows in _qkv_rows(local)]
    if kind == "qkv_weight":  # [in, q|k|v]
        return [tuple(reversed(shape))]
    return [shape]  # qkv_bias: [q|k|v]


def _fuse(arrays, local):
    groups, per_group, dim = _group_dims(local)
    q, k, v = arrays
    rest = q.shape[1:]
    parts = [q.reshape((groups, per_group, dim) + rest), k.reshape((groups, 1, dim) + rest),
             v.reshape((groups, 1, dim) + rest)]
    return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape((-1,) + rest))


def _unfuse(array, local):
    groups, per_group, dim = _group_dims(local)
    rest = array.shape[1:]
    fused = array.reshape((groups, per_group + 2, dim) + rest)
    return [np.ascontiguousarray(fused[:, :per_group].reshape((-1,) + rest)),
            np.ascontiguousarray(fused[:, per_group].reshape((-1,) + rest)),
            np.ascontiguousarray(fused[:, per_group + 1].reshape((-1,) + rest))]


def _split_rows(array, local):
    q, k, _ = _qkv_rows(local)
    return np.split(array, [q, q + k], axis=0)


def to_local(kind, arrays, local):
    """The foreign tensors of one map entry (in the map's order) -> the gpt_local tensor."""
    if kind == "copy":
        return arrays[0]
    if kind == "transpose":
        return np.ascontiguousarray(arrays[0].T)
    if kind == "groups":
        return _fuse(arrays, local)
    if kind == "qkv_weight":
        return _fuse(_split_rows(arrays[0].T, local), local)
    if kind == "qkv_bias":
        return _fuse(_split_rows(arrays[0], local), local)
    raise ValueError(f"unknown weight-map kind {kind!r}; one of {KINDS}")


def to_foreign(kind, array, local):
    """The gpt_local tensor -> the foreign tensors of its map entry, the exact inverse of ``to_local``."""
    if kind == "copy":
        return [array]
    if kind == "transpose":
        return [np.ascontiguousarray(array.T)]
    if kind == "groups":
        return _unfuse(array, local)
    if kind == "qkv_weight":
        return [np.ascontiguousarray(np.concatenate(_unfuse(array, local), axis=0).T)]
    if kind == "qkv_bias":
        return [np.ascontiguousarray(np.concatenate(_unfuse(array, local), axis=0))]
    raise ValueError(f"unknown weight-map kind {kind!r}; one of {KINDS}")


# ---------------------------------------------------------------------------------------------
class Family:
    """One foreign architecture family: its config translations, weight map, the foreign names to drop
    (buffers), the tied-head name, and ``optional_prefix``: a prefix of the map's foreign names that files
    may lack (HF GPT-2: ``transformer.``, absent from the original OpenAI checkpoints)."""

    def __init__(self, name, hf_types, to_local, to_hf, weight_map, drop=(), tied_head=None, title=None,
                 optional_prefix="", untie_hint="fix the config (tie_word_embeddings false) to keep the head"):
        self.name, self.hf_types, self.to_local, self.to_hf = name, tuple(hf_types), to_local, to_hf
        self.weight_map, self.drop, self.tied_head = weight_map, tuple(drop), tied_head
        self.title, self.optional_prefix, self.untie_hint = title or name, optional_prefix, untie_hint
        for _, _, kind in weight_map:
            if kind not in KINDS:
                raise ValueError(f"{name} weight map: unknown kind {kind!r}; one of {KINDS}")

    def entries(self, local):
        """[(gpt_local name, [foreign names], kind)] for every tensor of the model ``local`` describes."""
        table = expected_shapes(local)
        out = []
        for ours, theirs, kind in self.weight_map:
            if "{}" not in ours:
                if ours in table:
                    out.append((ours, list(theirs), kind))
                continue
            for layer in range(local["num_hidden_layers"]):
                name = ours.format(layer)
                if name in table:
                    out.append((name, [t.format(layer) for t in theirs], kind))
        missing = sorted(set(table) - {name for name, _, _ in out})
        if missing:  # a parameter without a foreign name: the map is incomplete for this combination of options
            raise CheckpointError(f"the {self.name} weight map has no Hugging Face name for '{missing[0]}'.")
        return out

    def names(self):
        """{gpt_local name pattern: (foreign name patterns, kind)}, the map as a lookup."""
        return {ours: (theirs, kind) for ours, theirs, kind in self.weight_map}

    def find(self, source_names, foreign):
        """The name ``foreign`` has in a file of ``source_names`` (with or without ``optional_prefix``), or None."""
        if foreign in source_names:
            return foreign
        prefix = self.optional_prefix
        if prefix and foreign.startswith(prefix) and foreign[len(prefix):] in source_names:
            return foreign[len(prefix):]
        return None


# ---------------------------------------------------------------------------------------------
# the two directions, for any HF family
def hf_to_ms(family, hf_dir, out, allow_pickle=False, hf=None):
    """Convert a Hugging Face directory of ``family`` into a gpt_local model directory. Returns a summary."""
    if not os.path.isdir(hf_dir):
        raise CheckpointError(f"--hf-dir {hf_dir} does not exist or is not a folder.")
    if hf is None:
        hf = read_json(os.path.join(hf_dir, "config.json"), "--hf-dir")
    local = family.to_local(hf)
    _check_builds(local)
    source = TensorSource(hf_dir, allow_pickle)
    expected = expected_shapes(local)
    entries = family.entries(local)
    found = {}  # map name -> the name in the file
    for _, foreign, _ in entries:
        for name in foreign:
            actual = family.find(source.files, name)
            if actual is not None:
                found[name] = actual
    _check_leftovers(source, set(found.values()), family, local, hf_dir, entries)
    plan = []
    for name, foreign, kind in entries:
        for hf_name, shape in zip(foreign, foreign_shapes(kind, expected[name], local)):
            if hf_name not in found:
                raise CheckpointError(f"{hf_dir} lacks '{hf_name}' (gpt_local '{name}'), which config.json implies; "
                                      f"the config does not match these weights.")
            if source.shape(found[hf_name]) != shape:
                raise CheckpointError(f"tensor '{found[hf_name]}' has shape {source.shape(found[hf_name])}, "
                                      f"config.json implies {shape}; the config does not match these weights.")
        plan.append((name, expected[name], np.float32,
                     lambda n=[found[f] for f in foreign], k=kind:
                     to_local(k, [source.get(x).astype(np.float32) for x in n], local)))
    return write_ms_dir(out, plan, local, hf_dir, family=family.name)


def _check_builds(local):
    """The translated config passes GPTLocalConfig's own checks (pure Python ones: rotary_percent ...)."""
    head_dim = local["hidden_size"] // local["num_attention_heads"]
    rot = rotary_dim(head_dim, local.get("rotary_percent", 1.0))
    if local.get("position_embedding_type") == "rope" and (rot % 2 or rot == 0):
        raise CheckpointError(f"config.json: rotary dimensions {rot} (head_dim {head_dim} x rotary_pct) must be a "
                              f"positive even number.")
    groups = local.get("num_query_groups") or local["num_attention_heads"]
    if local["num_attention_heads"] % groups:
        raise CheckpointError(f"config.json: num_attention_heads ({local['num_attention_heads']}) is not divisible "
                              f"by num_key_value_heads ({groups}).")


def _check_leftovers(source, used, family, local, hf_dir, entries):
    """Every HF tensor is converted, a dropped buffer, or a tied head equal to the token table."""
    for name in source.names():
        if name in used or name.endswith(family.drop):
            continue
        if name == family.tied_head and not Arch.of(local).untied:
            embedding = family.find(source.files, entries[0][1][0])
            if not np.array_equal(source.get(name), source.get(embedding)):
                raise CheckpointError(f"{hf_dir}: {name} differs from the token embedding but gpt_local ties the "
                                      f"head to it here (config.json: tie_word_embeddings true); {family.untie_hint}.")
            continue
        raise CheckpointError(f"tensor '{name}' of {hf_dir} is not part of a {family.title} model of this "
                              f"config.json ({local['num_hidden_layers']} layers); the config does not match "
                              f"these weights, or this is not a {family.title} checkpoint.")


def prepare_local(local):
    """A gpt_local config.json as the exporters read it: the LoRA settings taken out (the base weights only;
    adapters: ``--lora-only`` or ``gptlocal lora merge``), GPTLocalConfig's defaults for the sizes it may omit."""
    lora = local.pop("pet_config", None)
    local.setdefault("intermediate_size", 4 * local["hidden_size"])
    local.setdefault("max_position_embeddings", 1024)
    return local, lora


def ms_to_hf(family, ms_dir, out, local=None):
    """Convert a gpt_local model directory into a Hugging Face directory of ``family``. Returns a summary."""
    if local is None:
        local = read_ms_config(ms_dir)
    local, lora = prepare_local(local)
    reader = SafetensorsReader(resolve_weights_file(ms_dir))
    expected = expected_shapes(local)
    plan = []
    for name, hf_names, kind in family.entries(local):
        if name not in reader.header:
            raise CheckpointError(f"{reader.path} lacks '{name}'; not a gpt_local model of this config.")
        if reader.shape(name) != expected[name]:
            raise CheckpointError(f"tensor '{name}' has shape {reader.shape(name)}; config.json implies "
                                  f"{expected[name]}.")
        for index, (hf_name, shape) in enumerate(zip(hf_names, foreign_shapes(kind, expected[name], local))):
            plan.append((hf_name, shape, np.float32,
                         lambda n=name, k=kind, i=index: to_foreign(k, reader.get(n).astype(np.float32), local)[i]))
    plan.sort(key=lambda item: item[0])

    def build(staging):
        write_safetensors_streamed(os.path.join(staging, "model.safetensors"), plan, {"format": "pt"})
        with open(os.path.join(staging, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(family.to_hf(local), handle, indent=2)
        copy_tokenizer(ms_dir, staging, local["max_position_embeddings"])
        return {"tensors": len(plan), "lora_left_out": bool(lora), "family": family.name}
    return write_folder(out, build, CheckpointError)
