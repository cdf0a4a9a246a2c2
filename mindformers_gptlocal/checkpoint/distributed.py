"""Split a full gpt_local safetensors checkpoint into per-rank shards for a (dp, mp, pp) strategy, and merge back.

``DIR/rank_{i}/gpt_local.safetensors`` holds rank i's slice of every tensor its pipeline stage
reads, as the parameter table (``model/params.py``: shape, layout from the same rules that set the
``shard`` strategies, stages) says;
``DIR/strategy.json`` records the strategy and, per tensor, its full shape, split axis and stages.
Ranks are numbered as MindSpore numbers them under semi-auto parallel:
``rank = stage * dp * mp + dp_index * mp + mp_index`` (pipeline stages in blocks of dp*mp ranks,
mp innermost in the [dp, mp] device matrix of the strategies). The tied token table goes to
stage 0 and to the last stage; merge reads it from stage 0, the owner MindSpore updates.
Optimizer state named ``<prefix>.<parameter>`` (adam_m.model..., adam_v.model...) follows its
parameter; any other tensor (step counters, loss scale) is copied to every rank.

MindSpore's own ``ms.parallel.transform_checkpoints`` / ``load_distributed_checkpoint`` need the
strategy files that a parallel compile writes (``strategy_ckpt_config``); semi-auto parallel cannot
compile on CPU, so these shards come with strategy.json, our metadata, not a MindSpore strategy
file. Merge is exact: the round trip is bit-identical.
"""
import json
import os

import numpy as np

from .. import yaml_io
from ..errors import CheckpointError, ConfigError
from ..model.params import parameter_table
from ..parallel.sharding import check_divisible, merge_slices, rank_slice
from ..safetensors_io import read_safetensors, write_safetensors
from ..staging import write_folder

SHARD_NAME = "gpt_local.safetensors"
STRATEGY_NAME = "strategy.json"
FORMAT = "gpt_local-dist-1"


def config_from_yaml(path):
    """GPTLocalConfig from a run YAML, with its top-level parallel_config (and model_config.offset)."""
    from ..model.config import GPTLocalConfig  # MindFormers' PretrainedConfig: loaded only for a split
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path} does not exist; give the run YAML (model.model_config + parallel_config).")
    data = yaml_io.load_yaml(path)
    values = dict(((data.get("model") or {}).get("model_config")) or {})
    if not values:
        raise ConfigError(f"{path} has no model.model_config section; give a gpt_local run YAML.")
    for key in ("model_type", "architectures", "auto_register"):
        values.pop(key, None)
    values["parallel_config"] = dict(data.get("parallel_config") or {})  # offset: model_config's, else this one's
    return GPTLocalConfig(**values)


class Plan:
    """Which slice of which tensor each rank holds, for a config's layout (dp, mp, pp, offset, vocab_emb_dp)."""

    def __init__(self, config):
        layout = config.layout
        self.dp, self.mp, self.vocab_emb_dp = layout.dp, layout.mp, layout.vocab_emb_dp
        check_divisible(config, self.mp)
        self.stage_ids = layout.stage_of_layers(config.num_hidden_layers)
        self.pp = max(self.stage_ids) + 1
        self.table = parameter_table(config, layout)
        self.ranks = self.pp * self.dp * self.mp

    def rank_of(self, stage, dp_index, mp_index):
        return stage * self.dp * self.mp + dp_index * self.mp + mp_index

    def parameter_of(self, name):
        """The model parameter a tensor belongs to (itself, or the parameter its optimizer state tracks)."""
        if name in self.table:
            return name
        for param in self.table:
            if name.endswith("." + param):
                return param
        return None

    def entry(self, name, shape):
        param = self.parameter_of(name)
        if param is None:  # step counters, loss scale: copied to every rank
            return {"shape": list(shape), "layout": [1] * len(shape), "split_axis": None,
                    "stages": list(range(self.pp))}
        spec = self.table[param]
        return {"shape": list(shape), "layout": list(spec.layout), "split_axis": spec.split_axis,
                "stages": list(spec.stages)}

    def metadata(self, entries):
        return {"format": FORMAT, "data_parallel": self.dp, "model_parallel": self.mp, "pipeline_stage": self.pp,
                "vocab_emb_dp": self.vocab_emb_dp, "stage_of_layer": self.stage_ids, "rank_size": self.ranks,
                "rank_order": "rank = stage * data_parallel * model_parallel + dp_index * model_parallel + mp_index",
                "tensors": entries}


def _read(path):
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist; give a gpt_local .safetensors file.")
    return read_safetensors(path)


def split_arrays(tensors, plan):
    """{rank: {name: slice}} and the strategy.json entries."""
    entries = {name: plan.entry(name, array.shape) for name, array in tensors.items()}
    shards = {rank: {} for rank in range(plan.ranks)}
    for name, array in tensors.items():
        entry = entries[name]
        if entry["split_axis"] is not None and array.shape[entry["split_axis"]] % plan.mp:
            raise CheckpointError(f"tensor '{name}' has {array.shape[entry['split_axis']]} rows/columns on its split "
                                  f"axis, not divisible by model_parallel {plan.mp}; choose another model_parallel.")
        for stage in entry["stages"]:
            for dp_index in range(plan.dp):
                for mp_index in range(plan.mp):
                    piece = rank_slice(array, entry["layout"], mp_index, plan.mp)
                    shards[plan.rank_of(stage, dp_index, mp_index)][name] = np.ascontiguousarray(piece)
    return shards, entries


def split_checkpoint(ckpt, config, out, overwrite=False):
    """Write ``out/rank_*/`` shards and ``out/strategy.json`` (staged: all or nothing). Returns a summary."""
    plan = Plan(config)
    tensors = _read(ckpt)
    missing = [name for name in plan.table if name not in tensors]
    if missing:
        raise CheckpointError(f"{ckpt} lacks '{missing[0]}' (and {len(missing) - 1} more) of the model this config "
                              f"describes; the checkpoint and --config are of different models. Use the run YAML the "
                              f"checkpoint was trained with.")
    shards, entries = split_arrays(tensors, plan)

    def build(staging):
        for rank, shard in shards.items():
            folder = os.path.join(staging, f"rank_{rank}")
            os.makedirs(folder)
            write_safetensors(os.path.join(folder, SHARD_NAME), shard, {"format": FORMAT, "rank": str(rank)})
        with open(os.path.join(staging, STRATEGY_NAME), "w", encoding="utf-8") as handle:
            json.dump(plan.metadata(entries), handle, indent=1)
        return {"ranks": plan.ranks, "tensors": len(tensors), "out": os.path.abspath(out)}
    return write_folder(out, build, CheckpointError, overwrite=overwrite, overwrite_flag="--overwrite")


def read_strategy(directory):
    path = os.path.join(directory, STRATEGY_NAME)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist; --dir must be a folder written by `gptlocal ckpt split`.")
    with open(path, encoding="utf-8") as handle:
        meta = json.load(handle)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a {FORMAT} strategy file (format {meta.get('format')!r}).")
    return meta


def merge_arrays(directory, meta):
    """The full tensors from a split folder; refuses a missing rank or tensor, naming it."""
    dp, mp, ranks = meta["data_parallel"], meta["model_parallel"], meta["rank_size"]
    files = {}
    for rank in range(ranks):
        path = os.path.join(directory, f"rank_{rank}", SHARD_NAME)
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing: the folder was split for {ranks} ranks "
                                  f"(dp {dp} x mp {mp} x pp {meta['pipeline_stage']}). Copy rank_{rank} back "
                                  f"or split the full checkpoint again.")
        files[rank] = path
    loaded = {}

    def shard(rank):
        if rank not in loaded:
            loaded[rank] = _read(files[rank])
        return loaded[rank]
    merged = {}
    for name, entry in meta["tensors"].items():
        stage = entry["stages"][0]  # the owner: the lowest stage that reads it
        pieces = []
        for mp_index in range(mp if entry["split_axis"] is not None else 1):
            rank = stage * dp * mp + mp_index
            tensors = shard(rank)
            if name not in tensors:
                raise CheckpointError(f"{files[rank]} lacks tensor '{name}', which strategy.json places on rank "
                                      f"{rank}; the shard was written by another split. Split again.")
            pieces.append(tensors[name])
        array = merge_slices(pieces, entry["layout"])
        if list(array.shape) != entry["shape"]:
            raise CheckpointError(f"tensor '{name}' merges to shape {list(array.shape)}, strategy.json says "
                                  f"{entry['shape']}; a rank file was replaced. Split again.")
        merged[name] = np.ascontiguousarray(array)
    return merged


def merge_checkpoint(directory, out):
    """One full safetensors file from ``directory``'s shards, written atomically. Returns a summary."""
    meta = read_strategy(directory)
    merged = merge_arrays(directory, meta)
    if os.path.isdir(out):
        raise CheckpointError(f"--out {out} is a folder; give a .safetensors file name.")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    write_safetensors(out, merged, {"format": "gpt_local"})
    return {"tensors": len(merged), "ranks": meta["rank_size"], "out": os.path.abspath(out)}
