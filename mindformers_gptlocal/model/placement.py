"""Where each layer lives: pipeline stage from ``pipeline_stage`` + ``offset``, and recompute choices.

Pure Python over the YAML values, so the planner and the model share one rule.
"""
from ..errors import ConfigError


def config_value(obj, key, default=None):
    """``key`` of a dict, a config object or MindFormers' parallel config (None: ``default``)."""
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


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
    if offset in (None, 0) or offset == [0] * stages:
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
        raise ConfigError(f"offset {offset} gives stages {counts} layers, which sum to {sum(counts)}, not "
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


def placement_from_config(config):
    """(stage of each layer, full recompute per layer, selective recompute flag) from a GPTLocalConfig."""
    parallel = getattr(config, "parallel_config", None)
    stages = int(config_value(parallel, "pipeline_stage", 1) or 1)
    offset = getattr(config, "offset", None)
    if offset is None:
        offset = config_value(parallel, "offset", 0)
    stage_ids = stage_of_layers(config.num_hidden_layers, stages, offset)
    recompute_cfg = config_value(parallel, "recompute", None)
    full = recompute_layers(config_value(recompute_cfg, "recompute", False), stage_ids)
    selective = bool(config_value(recompute_cfg, "select_recompute", False))
    return stage_ids, full, selective
