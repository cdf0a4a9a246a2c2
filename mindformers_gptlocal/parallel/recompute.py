"""Recompute of one block from MindFormers' ``recompute_config`` keys (1.8.0 TransformerConfig names).

- ``recompute``: full per layer (bool, int or per-stage list; ``layout.recompute_layers`` picks the layers).
  A fully recomputed block also gets ``mp_comm_recompute`` (MindSpore default True),
  ``parallel_optimizer_comm_recompute`` and ``recompute_slice_activation`` (MindSpore's
  ``Cell.recompute`` keywords; MindFormers' mcore TransformerConfig refuses the last one, we pass
  it through to MindSpore).
- ``select_recompute``: True recomputes softmax, attention dropout and the MLP activation; a list
  names ops or Cells by dotted path inside a block (each segment a regex, as MindFormers'
  ``LayerSetting``), e.g. ``["attention.softmax", "mlp.activation"]``; a dict maps a path to
  True or to per-stage layer counts like ``recompute``.
- ``select_comm_recompute``: same forms (on layers not fully recomputed); marks primitives with ``recompute_comm_op`` so the
  communication MindSpore inserts next to them (the sequence-parallel all-gather before each
  LayerNorm by default) is recomputed instead of kept.
- ``select_recompute_exclude`` / ``select_comm_recompute_exclude`` are not supported (refused).
Decided once, at build time, never in ``construct``.
"""
import re

from mindspore import nn
from mindspore.ops import Primitive

from ..errors import ConfigError
from .layout import config_value, recompute_layers

DEFAULT_SELECT = ("attention.plain.softmax", "attention.plain.attention_dropout", "mlp.activation")
# the plain attention core's ops by their former paths (before model/attention.py's cores): the same ops
MOVED = {f"attention.{name}": f"attention.plain.{name}" for name in
         ("qk_matmul", "scale_mul", "add_mask", "softmax", "attention_dropout", "pv_matmul", "merge_heads")}
# the norms' output primitive: LayerNorm's layer_norm, or RMSNorm's weight_mul (normalization: RMSNorm)
DEFAULT_COMM = ("input_layernorm.layer_norm|weight_mul", "post_attention_layernorm.layer_norm|weight_mul")
CELL_KEYWORDS = ("mp_comm_recompute", "parallel_optimizer_comm_recompute", "recompute_slice_activation")


def _patterns_per_layer(value, defaults, stage_ids, key):
    """[(pattern, [bool per layer])] from a select_* value (bool, list of paths, or dict)."""
    if value in (None, False):
        return []
    if value is True:
        return [(p, [True] * len(stage_ids)) for p in defaults]
    if isinstance(value, (list, tuple)) and all(isinstance(p, str) for p in value):
        return [(p, [True] * len(stage_ids)) for p in value]
    if isinstance(value, dict):
        return [(p, recompute_layers(v, stage_ids)) for p, v in value.items()]
    raise ConfigError(f"recompute_config.{key} must be True/False, a list of op paths (e.g. "
                      f"['attention.softmax']) or a dict of path -> True/per-stage counts, got {value!r}.")


def _segments(pattern):
    """MindFormers' form ``mlp\\.activation`` (regex segments joined by an escaped dot) or a plain ``mlp.activation``;
    a former path of the attention's ops (``MOVED``) names the op at its path today."""
    segments = pattern.split(r"\.") if r"\." in pattern else pattern.split(".")
    moved = MOVED.get(".".join(segments))
    return moved.split(".") if moved else segments


def _matches(cell, segments):
    """(name, object) pairs at a path of regex segments inside ``cell``: child Cells and Primitives."""
    first, rest = segments[0], segments[1:]
    found = []
    children = dict(cell.name_cells())
    if rest:
        for name, child in children.items():
            if re.fullmatch(first, name):
                found += [(f"{name}.{n}", o) for n, o in _matches(child, rest)]
        return found
    for name, child in children.items():
        if re.fullmatch(first, name):
            found.append((name, child))
    for name, value in vars(cell).items():
        if isinstance(value, Primitive) and re.fullmatch(first, name):
            found.append((name, value))
    return found


def _select(block, pattern, comm, key):
    hits = _matches(block, _segments(pattern))
    if not hits:
        raise ConfigError(f"recompute_config.{key} names '{pattern}', which matches nothing in a GPTLocalBlock; "
                          f"use dotted paths such as {', '.join(DEFAULT_SELECT + DEFAULT_COMM)}.")
    for _, target in hits:
        if comm:
            if not isinstance(target, Primitive):
                raise ConfigError(f"recompute_config.{key} '{pattern}' is a Cell; communication recompute marks "
                                  f"primitives, e.g. {DEFAULT_COMM[0]}.")
            target.add_prim_attr("recompute_comm_op", True)
        elif isinstance(target, nn.Cell):
            target.recompute()
        else:
            target.recompute(True)


class RecomputePlan:
    """What every layer recomputes, from the ``Layout``'s recompute section and the layers' stages."""

    def __init__(self, layout, num_layers):
        section = layout.recompute
        stage_ids = layout.stage_of_layers(num_layers)
        for key in ("select_recompute_exclude", "select_comm_recompute_exclude"):
            if config_value(section, key, False):
                raise ConfigError(f"recompute_config.{key} is not supported by gpt_local; remove it and list the "
                                  f"ops to recompute in select_recompute instead.")
        self.full = recompute_layers(config_value(section, "recompute", False), stage_ids)
        self.select = _patterns_per_layer(config_value(section, "select_recompute", False), DEFAULT_SELECT, stage_ids,
                                          "select_recompute")
        self.comm = _patterns_per_layer(config_value(section, "select_comm_recompute", False), DEFAULT_COMM, stage_ids,
                                        "select_comm_recompute")
        self.cell_keywords = {k: bool(config_value(section, k)) for k in CELL_KEYWORDS
                              if config_value(section, k) is not None}

    def apply(self, block, index):
        """Set layer ``index``'s recompute on ``block``; returns 'full', 'selective' or 'none'."""
        if self.full[index]:  # as MindFormers' LayerSetting: select options apply only to other layers
            block.recompute(**self.cell_keywords)
            return "full"
        for pattern, layers in self.comm:
            if layers[index]:
                _select(block, pattern, True, "select_comm_recompute")
        chosen = [pattern for pattern, layers in self.select if layers[index]]
        for pattern in chosen:
            _select(block, pattern, False, "select_recompute")
        return "selective" if chosen else "none"
