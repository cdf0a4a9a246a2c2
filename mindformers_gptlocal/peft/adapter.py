"""Houlsby bottleneck adapters (``pet_type: adapter``): their settings from ``model_config.pet_config``, checked
once, their parameter shapes, freeze lists and tensor-parallel layout, in pure Python; their Cells are
``adapter_cells.py``.

Houlsby et al. 2019: after the attention and after the MLP of a layer, x + up(act(down(x))). MindFormers 1.8
names the type (PetType.ADAPTER) but defines no keys for it; the keys are mindpet's AdapterDense
(``bottleneck_size``, ``non_linearity``) and adapter-transformers' (``reduction_factor``, ``mh_adapter``,
``output_adapter``), ``layers_to_transform`` is PEFT's. The keys and defaults are documented in docs/finetune.md.
"""
from collections import namedtuple

from ..errors import ConfigError
from ..parallel.sharding import DP, MP, OpRule, column_rules, row_rules
from .base import Method, PetSpec, get as _get, str_list as _str_list

ADAPTER_SITES = ("attention_adapter", "mlp_adapter")  # block attributes: after attention, after the MLP
NON_LINEARITIES = ("relu", "gelu", "gelu_new", "quick_gelu", "silu", "swish")
ADAPTER_KEYS = ("pet_type", "bottleneck_size", "reduction_factor", "non_linearity", "mh_adapter", "output_adapter",
                "layers_to_transform", "freeze_include", "freeze_exclude")



class AdapterSpec(namedtuple("AdapterSpec", "bottleneck_size reduction_factor non_linearity sites layers "
                                            "freeze_include freeze_exclude"), PetSpec):
    """pet_type: adapter, read by ``read``."""
    __slots__ = ()
    pet_type = "adapter"
    cells = "adapter_cells"

    def layer_rules(self, index, act, arch):
        return [rule for site in self.sites if index in self.layers for rule in adapter_rules(site, act)]

    def param_shapes(self, d, base):
        width = bottleneck_width(self, d["hidden"])
        return {f"{path}.{name}": shape for path in adapter_paths(self, d["layers"])
                for name, shape in adapter_shapes(d["hidden"], width).items()}

    def trainable_hint(self):
        return "'*.attention_adapter.*' and '*.mlp_adapter.*'", "*adapter*"

    def summary(self, model, trainable, total):
        paths = adapter_paths(self, len(model.model.layers))
        return (f"[gptlocal] adapters: {trainable:,} trainable parameters ({100.0 * trainable / total:.2g}% of "
                f"{total:,}), bottleneck {bottleneck_width(self, model.config.hidden_size)}, {self.non_linearity}, "
                f"{len(paths)} adapters in {len(self.layers)} layers")


def read(pet_config, num_layers, max_positions=None):  # pylint: disable=unused-argument
    """pet_type: adapter -> AdapterSpec; one ConfigError naming the key for every bad value."""
    keys = pet_config.keys() if hasattr(pet_config, "keys") else vars(pet_config).keys()
    unknown = [k for k in keys if k not in ADAPTER_KEYS and _get(pet_config, k) is not None]
    if unknown:
        raise ConfigError(f"model_config.pet_config.{unknown[0]} is not a key of pet_type: adapter; its keys are "
                          f"{', '.join(ADAPTER_KEYS[1:])}. Remove it.")
    size, factor = _get(pet_config, "bottleneck_size"), _get(pet_config, "reduction_factor")
    if size is not None and factor is not None:
        raise ConfigError("model_config.pet_config sets both bottleneck_size and reduction_factor; keep one "
                          "(bottleneck_size = hidden_size / reduction_factor).")
    key, value = ("reduction_factor", factor) if factor is not None else ("bottleneck_size",
                                                                           64 if size is None else size)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"model_config.pet_config.{key} must be a positive integer (the adapter's bottleneck "
                          f"width{' is hidden_size / reduction_factor' if factor is not None else ''}), got "
                          f"{value!r}; e.g. {key}: {16 if factor is not None else 64}.")
    act = str(_get(pet_config, "non_linearity", "gelu")).lower()
    if act not in NON_LINEARITIES:
        raise ConfigError(f"model_config.pet_config.non_linearity {act!r} is not one gpt_local has; use one of "
                          f"{', '.join(NON_LINEARITIES)}.")
    sites = []
    for flag, site in (("mh_adapter", ADAPTER_SITES[0]), ("output_adapter", ADAPTER_SITES[1])):
        value = _get(pet_config, flag, True)
        if not isinstance(value, bool):
            raise ConfigError(f"model_config.pet_config.{flag} must be true or false, got {value!r}.")
        if value:
            sites.append(site)
    if not sites:
        raise ConfigError("model_config.pet_config.mh_adapter and output_adapter are both false, so no adapter "
                          "would be inserted; set one of them true.")
    layers = _get(pet_config, "layers_to_transform")
    if layers is None:
        layers = list(range(num_layers))
    elif isinstance(layers, int) and not isinstance(layers, bool):
        layers = [layers]
    if not isinstance(layers, (list, tuple)) or not layers or not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < num_layers for i in layers):
        raise ConfigError(f"model_config.pet_config.layers_to_transform must be a non-empty list of layer indices "
                          f"in [0, {num_layers}) (num_hidden_layers {num_layers}), got {layers!r}.")
    include, keep = _str_list(pet_config, "freeze_include"), _str_list(pet_config, "freeze_exclude")
    return AdapterSpec(size if factor is None else None, factor, act, tuple(sites), tuple(sorted(set(layers))),
                       include or ["*"], keep or ["*adapter*"])


def bottleneck_width(spec, hidden_size):
    """The adapter's bottleneck width: bottleneck_size, or hidden_size // reduction_factor (refused when 0)."""
    if spec.reduction_factor is None:
        return spec.bottleneck_size
    width = hidden_size // spec.reduction_factor
    if width < 1:
        raise ConfigError(f"model_config.pet_config.reduction_factor ({spec.reduction_factor}) is larger than "
                          f"hidden_size ({hidden_size}), so the adapter size would be 0; use a reduction_factor "
                          f"<= {hidden_size} or bottleneck_size.")
    return width


def adapter_paths(spec, num_layers):
    """Full paths of the adapter Cells (``model.layers.0.attention_adapter``), layer by layer."""
    return [f"model.layers.{i}.{site}" for i in range(num_layers) if i in spec.layers for site in spec.sites]


def adapter_shapes(hidden_size, width):
    """One adapter's parameters, names relative to it: down [m, H] + bias, up [H, m] + bias."""
    return {"linear_down.weight": (width, hidden_size), "linear_down.bias": (width,),
            "linear_up.weight": (hidden_size, width), "linear_up.bias": (hidden_size,)}


def is_adapter_name(name):
    """A parameter of a bottleneck adapter (``model.layers.0.mlp_adapter.linear_up.weight``)."""
    return any(f".{site}." in name for site in ADAPTER_SITES)


def adapter_rules(adapter, act):
    """A bottleneck adapter's sharding rules (``adapter_cells.BottleneckAdapter``): y + up(act(down(y))), laid out
    like the MLP: down [m, H] column-parallel (the bottleneck split over mp), the activation on each rank's columns,
    up [H, m] row-parallel (partial sums all-reduced, the bias added after), the residual add like the block's.
    Needs mp | bottleneck width (``parallel/rules.py``)."""
    return [*column_rules(f"{adapter}.linear_down"),
            OpRule(f"{adapter}.activation.gelu", ((DP, 1, MP),)),
            OpRule(f"{adapter}.activation.relu", ((DP, 1, MP),)),
            OpRule(f"{adapter}.activation.fast_gelu", ((DP, 1, MP),), optional=True),  # non_linearity quick_gelu
            OpRule(f"{adapter}.activation.sigmoid", ((DP, 1, MP),), optional=True),  # silu / swish
            OpRule(f"{adapter}.activation.mul", ((DP, 1, MP), (DP, 1, MP)), optional=True),
            *row_rules(f"{adapter}.linear_up"),
            OpRule(f"{adapter}.add", (act, act))]


METHOD = Method(
    ("adapter",), read, is_adapter_name,
    lambda name: (f"checkpoint holds bottleneck adapters (e.g. '{name}', pet_type: adapter) but the model has none, "
                  f"so they would be ignored; build the model with the run's pet_config (a model directory's "
                  f"config.json has it). Adapters cannot be folded into the base weights."),
    lambda name: (f"bottleneck adapters (pet_type: adapter, e.g. '{name}'), which cannot be folded into the base "
                  f"weights (a non-linearity sits between their two projections) nor exported as a PEFT LoRA adapter; "
                  f"use the run's model directory as it is (it loads with its adapters)."))
