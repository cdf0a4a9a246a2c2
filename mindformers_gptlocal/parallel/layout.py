"""The parallel layout of a run, read once: ``Layout`` from ``parallel_config`` + ``recompute_config``.

Every part that needs the layout (the model build, the sharding rules, recompute, the planner, the
distributed checkpoint, the pre-flight) takes a ``Layout``; nothing else reads ``parallel_config``.
It accepts MindFormers' legacy names (``data_parallel``, ``model_parallel``, ``pipeline_stage``,
``use_seq_parallel``) and its mcore names (``data_parallel_size``, ``tensor_model_parallel_size``,
``pipeline_model_parallel_size``, ``sequence_parallel``). The pipeline ``offset`` is taken from
``model_config.offset``, else ``parallel_config.offset``, else 0 (``resolve_offset``). Per-layer
facts (stage, full recompute) come from ``stage_of_layers`` / ``recompute_layers`` below.

Pure Python over the YAML values, no MindSpore: ``gptlocal plan`` reads the same object the model
does. Reading never raises: bad values are kept as given and reported by ``parallel/rules.py``.
"""
from dataclasses import dataclass, field

from ..errors import ConfigError

# mcore name -> the name used here (MindFormers' legacy parallel_config names)
ALIASES = {"data_parallel_size": "data_parallel", "tensor_model_parallel_size": "model_parallel",
           "pipeline_model_parallel_size": "pipeline_stage", "sequence_parallel": "use_seq_parallel"}


def config_value(obj, key, default=None):
    """``key`` of a dict, a config object or MindFormers' parallel config (None: ``default``)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def plain(section):
    """A config section (dict, MindFormers config object or None) as a plain dict."""
    if section is None:
        return {}
    if isinstance(section, dict):
        return {k: plain(v) if isinstance(v, dict) else v for k, v in section.items()}
    if hasattr(section, "to_dict"):
        return plain(section.to_dict())
    # MindFormers' config objects keep values in ``_name`` attributes behind ``name`` properties
    names = {key.lstrip("_") for key in vars(section)}
    return plain({name: getattr(section, name) for name in names if hasattr(section, name)})


def _read(parallel, key, default):
    """``key`` or its mcore alias; a None value counts as absent."""
    value = parallel.get(key)
    if value is None:
        for alias, name in ALIASES.items():
            if name == key and parallel.get(alias) is not None:
                value = parallel[alias]
                break
    return default if value is None else value


def resolve_offset(model_config=None, parallel_config=None):
    """The pipeline offset: model_config.offset, else parallel_config.offset, else 0 (lists become tuples)."""
    offset = config_value(model_config, "offset", None)
    if offset is None:
        offset = config_value(parallel_config, "offset", None)
    if offset is None:
        return 0
    return tuple(offset) if isinstance(offset, (list, tuple)) else offset


@dataclass(frozen=True)
class Layout:
    """How a run is split: data (dp), tensor (mp) and pipeline (pp) parallel, and per-layer choices.

    ``recompute`` is the recompute section as a plain dict (``recompute``, ``select_recompute`` ...);
    ``offset`` an int or a per-stage tuple. Build it with ``Layout.read`` or one of the ``of_*``
    constructors; the fields are raw YAML values until ``parallel/rules.py`` has checked them.
    """

    dp: object = 1
    mp: object = 1
    pp: object = 1
    micro: object = 1
    seq_parallel: bool = False
    vocab_emb_dp: bool = True
    offset: object = 0
    recompute: dict = field(default_factory=dict, compare=False)

    @classmethod
    def read(cls, parallel_config=None, recompute_config=None, offset=None):
        """The one reader of a ``parallel_config`` section (dict or MindFormers object); ``offset`` given
        wins over ``parallel_config.offset``."""
        parallel = plain(parallel_config)
        if recompute_config is None:
            recompute_config = parallel.get("recompute")
        if isinstance(recompute_config, (bool, int, list, tuple)):  # the bare form of recompute_config.recompute
            recompute = {"recompute": recompute_config}
        else:
            recompute = plain(recompute_config)
        vocab_emb_dp = parallel.get("vocab_emb_dp")
        return cls(dp=_read(parallel, "data_parallel", 1), mp=_read(parallel, "model_parallel", 1),
                   pp=_read(parallel, "pipeline_stage", 1), micro=_read(parallel, "micro_batch_num", 1),
                   seq_parallel=bool(_read(parallel, "use_seq_parallel", False)),
                   vocab_emb_dp=True if vocab_emb_dp is None else bool(vocab_emb_dp),
                   offset=resolve_offset({"offset": offset}, parallel),
                   recompute=recompute)

    @classmethod
    def of_model_config(cls, config):
        """From a model config (GPTLocalConfig or dict): its ``parallel_config`` (MindFormers puts
        ``recompute_config`` there, as ``recompute``) and ``offset``."""
        parallel = config_value(config, "parallel_config", None)
        return cls.read(parallel, offset=resolve_offset(config, parallel))

    @classmethod
    def of_run_yaml(cls, config):
        """From a whole run YAML (dict or MindFormerConfig): top-level ``parallel_config`` and
        ``recompute_config``, ``model.model_config.offset``."""
        parallel = config_value(config, "parallel_config", None) or {}
        model_config = config_value(config_value(config, "model", {}) or {}, "model_config", {}) or {}
        recompute = config_value(config, "recompute_config", None)
        return cls.read(parallel, recompute if recompute is not None else {},
                        offset=resolve_offset(model_config, parallel))

    def summary(self):
        """The layout as ``gptlocal plan --json`` reports it."""
        return dict(dp=self.dp, mp=self.mp, pp=self.pp, micro=self.micro, seq_parallel=self.seq_parallel,
                    vocab_emb_dp=self.vocab_emb_dp)

    def layers_per_stage(self, num_layers):
        return layers_per_stage(num_layers, self.pp, self.offset)

    def stage_of_layers(self, num_layers):
        return stage_of_layers(num_layers, self.pp, self.offset)

    @property
    def selective_recompute(self):
        return bool(self.recompute.get("select_recompute", False))

    def recompute_modes(self, num_layers):
        """Per stage: 'none', 'selective', 'full' or a count of fully recomputed layers."""
        stage_ids = self.stage_of_layers(num_layers)
        full = recompute_layers(self.recompute.get("recompute", False), stage_ids)
        modes = []
        for stage in range(max(stage_ids) + 1):
            flags = [f for f, sid in zip(full, stage_ids) if sid == stage]
            if all(flags):
                modes.append("full")
            elif any(flags):
                modes.append(sum(flags))
            else:
                modes.append("selective" if self.selective_recompute else "none")
        return modes


def layers_per_stage(num_layers, stages, offset=0):
    """Layer count of every stage: num_layers // stages each, plus ``offset`` (int or per-stage list).

    With a zero offset, a remainder goes one layer each to the stages after the first.
    """
    if stages < 1:
        raise ConfigError(f"parallel_config.pipeline_stage must be >= 1, got {stages}.")
    if num_layers < stages:
        raise ConfigError(f"model_config.num_hidden_layers ({num_layers}) is smaller than "
                          f"parallel_config.pipeline_stage ({stages}); every stage needs a layer. "
                          f"Lower pipeline_stage to at most {num_layers}.")
    base, remainder = divmod(num_layers, stages)
    if offset in (None, 0) or (isinstance(offset, (list, tuple)) and list(offset) == [0] * stages):
        counts = [base] * stages
        order = list(range(1, stages)) + [0]
        for i in range(remainder):
            counts[order[i % stages]] += 1
        return counts
    offsets = [offset] * stages if isinstance(offset, int) else list(offset)
    if len(offsets) != stages:
        raise ConfigError(f"offset has {len(offsets)} entries but parallel_config.pipeline_stage is {stages}; "
                          f"give one entry per stage.")
    counts = [base + o for o in offsets]
    if sum(counts) != num_layers or min(counts) < 1:
        raise ConfigError(f"offset {list(offset) if isinstance(offset, tuple) else offset} gives stages {counts} "
                          f"layers, which sum to {sum(counts)}, not "
                          f"num_hidden_layers ({num_layers}), or leaves a stage empty. The offsets must sum "
                          f"to {remainder} (num_hidden_layers - pipeline_stage * {base}), e.g. "
                          f"{_example_offset(stages, remainder)}.")
    return counts


def _example_offset(stages, remainder):
    example = [0] * stages
    for i in range(remainder):
        example[1 + i % max(stages - 1, 1) if stages > 1 else 0] += 1
    return example


def stage_of_layers(num_layers, stages, offset=0):
    """Pipeline stage of each layer, in layer order."""
    stage_ids = []
    for stage, count in enumerate(layers_per_stage(num_layers, stages, offset)):
        stage_ids += [stage] * count
    return stage_ids


def recompute_layers(recompute, stage_ids):
    """Which layers recompute in full: ``recompute`` is bool, an int (first n layers of every stage)
    or a list of per-stage counts, as in MindFormers' ``recompute_config.recompute``."""
    if recompute in (None, False):
        return [False] * len(stage_ids)
    if recompute is True:
        return [True] * len(stage_ids)
    stages = max(stage_ids) + 1
    if isinstance(recompute, bool) is False and isinstance(recompute, int):
        per_stage = [recompute] * stages
    elif isinstance(recompute, (list, tuple)):
        per_stage = list(recompute)
        if len(per_stage) != stages:
            raise ConfigError(f"recompute_config.recompute lists {len(per_stage)} stages but there are "
                              f"{stages}; give one count per pipeline stage, or True/False.")
    else:
        raise ConfigError(f"recompute_config.recompute must be a bool, an int or a per-stage list, "
                          f"got {recompute!r}.")
    position = {}
    chosen = []
    for stage in stage_ids:
        index = position.get(stage, 0)
        position[stage] = index + 1
        chosen.append(index < per_stage[stage])
    return chosen
