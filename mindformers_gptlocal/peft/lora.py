"""LoRA (``pet_type: lora``): its settings from MindFormers' ``model_config.pet_config``, checked once, its parameter
shapes, freeze lists and tensor-parallel layout, in pure Python; its Cells are ``lora_cells.py``.

A MindFormers user's YAML works unchanged::

    pet_config:
      pet_type: lora
      lora_rank: 8
      lora_alpha: 16
      lora_dropout: 0.05
      target_modules: '.*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2'
      freeze_include: ['*']
      freeze_exclude: ['*lora*']

The keys and their meaning are MindFormers' ``LoraConfig`` (mindformers/pet/pet_config.py):
``target_modules`` is matched with ``re.match`` against a Linear's attribute name (``linear_qkv``)
as MindFormers' ``recursive_replace_dense_cell`` does; we also accept a full match on its path
(``model.layers.0.attention.linear_qkv``), as PEFT does, so one layer can be chosen.
``exclude_layers`` (re.match on any attribute name along the path) skips a sub-tree;
``freeze_include``/``freeze_exclude`` are mindpet's ``freeze_modules`` fnmatch lists (a parameter
matched by both is left as it is, i.e. trainable). Everything here runs without MindSpore, so the
pre-flight (through ``GPTLocalConfig.validate``), ``gptlocal plan`` and ``convert`` use it.
"""
import re
from collections import namedtuple

from ..errors import ConfigError
from ..parallel.sharding import DP, LINEAR_SPLITS, MP, OpRule
from .base import Method, PetSpec, get as _get, str_list as _str_list

# Our Linear Cells by path inside a block -> how tensor parallel splits their weight (column / row)
LINEARS = LINEAR_SPLITS
LORA_A, LORA_B = "lora_a", "lora_b"  # parameter names under the Linear; '*lora*' freeze patterns match them
INITS = ("normal", "zeros", "zero", "ones", "heuniform", "he_uniform", "xavier_uniform", "truncatednormal")


class LoraSpec(namedtuple("LoraSpec", "rank alpha dropout target_modules exclude_layers freeze_include freeze_exclude "
                                      "a_init b_init"), PetSpec):
    """pet_type: lora, read by ``read``."""
    __slots__ = ()
    pet_type = "lora"
    cells = "lora_cells"

    @property
    def dropout_rate(self):
        return self.dropout

    def layer_rules(self, index, act, arch):
        return [rule for linear, split in LINEAR_SPLITS.items()
                if (arch.gated or linear != "mlp.linear_gate") and is_target(self, f"model.layers.{index}.{linear}")
                for rule in lora_rules(linear, split)]

    def param_shapes(self, d, base):
        shapes = {}
        for path in targeted_paths(self, d["layers"], gated=True):
            if path + ".weight" in base:  # mlp.linear_gate only in a gated MLP
                out_features, in_features = base[path + ".weight"]
                shapes.update({f"{path}.{name}": shape
                               for name, shape in lora_shapes(in_features, out_features, self.rank).items()})
        return shapes

    def trainable_hint(self):
        return f"'*.{LORA_A}' and '*.{LORA_B}'", "*lora*"

    def summary(self, model, trainable, total):
        paths = targeted_paths(self, len(model.model.layers), model.config.arch.gated)
        return (f"[gptlocal] LoRA: {trainable:,} trainable parameters ({100.0 * trainable / total:.2g}% of "
                f"{_short(total)}), rank {self.rank}, alpha {self.alpha:g}, in {len(paths)} Linears")


def _short(count):
    return f"{count / 1e6:.0f}M" if count >= 1e7 else f"{count / 1e6:.2f}M" if count >= 1e5 else f"{count:,}"


def read(pet_config, num_layers, max_positions=None):  # pylint: disable=unused-argument
    """``model_config.pet_config`` of pet_type lora (dict or MindFormers' LoraConfig) -> LoraSpec. Every bad value
    is one ConfigError naming the key and the fix."""
    rank = _get(pet_config, "lora_rank", 8)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"model_config.pet_config.lora_rank must be a positive integer, got {rank!r}.")
    alpha = _get(pet_config, "lora_alpha", 16)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha == 0:
        raise ConfigError(f"model_config.pet_config.lora_alpha must be a non-zero number, got {alpha!r}.")
    dropout = _get(pet_config, "lora_dropout", 0.01)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"model_config.pet_config.lora_dropout must be in [0, 1), got {dropout!r}.")
    target = _get(pet_config, "target_modules")
    if not isinstance(target, str) or not target:
        raise ConfigError("model_config.pet_config.target_modules is missing; name the Linears to adapt, e.g. "
                          "'.*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2'.")
    try:
        re.compile(target)
    except re.error as err:
        raise ConfigError(f"model_config.pet_config.target_modules {target!r} is not a regular expression "
                          f"({err}).") from None
    exclude = _str_list(pet_config, "exclude_layers")
    include, keep = _str_list(pet_config, "freeze_include"), _str_list(pet_config, "freeze_exclude")
    if include is None and keep is None:
        raise ConfigError("model_config.pet_config needs freeze_include/freeze_exclude (MindFormers freezes the "
                          "base model by them); add freeze_include: ['*'] and freeze_exclude: ['*lora*'].")
    inits = []
    for key, default in (("lora_a_init", "heuniform"), ("lora_b_init", "zeros")):
        value = str(_get(pet_config, key, default)).lower()
        if value not in INITS:
            raise ConfigError(f"model_config.pet_config.{key} {value!r} is not an initializer gpt_local knows; "
                              f"use one of {', '.join(INITS)}.")
        inits.append(value)
    spec = LoraSpec(rank, float(alpha), float(dropout), target, exclude, include, keep, *inits)
    if not targeted_paths(spec, num_layers, gated=True):
        raise ConfigError(f"model_config.pet_config.target_modules {target!r} matches none of gpt_local's Linears "
                          f"({', '.join(n.split('.')[-1] for n in LINEARS)}; full paths like "
                          f"model.layers.0.attention.linear_qkv); e.g. use '.*linear_qkv|.*linear_proj'.")
    return spec


def is_target(spec, path):
    """Whether the Linear at ``path`` (``model.layers.3.mlp.linear_fc1``) gets an adapter."""
    parts = path.split(".")
    if spec.exclude_layers and any(re.match(p, part) for part in parts for p in spec.exclude_layers):
        return False
    return bool(re.match(spec.target_modules, parts[-1]) or re.fullmatch(spec.target_modules, path))


def targeted_paths(spec, num_layers, gated=False):
    """Full paths of the Linears that get an adapter, layer by layer (``model.layers.0.attention.linear_qkv``);
    ``mlp.linear_gate`` exists only in a gated (SwiGLU) MLP."""
    linears = [linear for linear in LINEARS if gated or linear != "mlp.linear_gate"]
    return [f"model.layers.{i}.{linear}" for i in range(num_layers) for linear in linears
            if is_target(spec, f"model.layers.{i}.{linear}")]


def lora_shapes(in_features, out_features, rank):
    """{lora_a: [rank, in], lora_b: [out, rank]}: PEFT's lora_A / lora_B weights."""
    return {LORA_A: (rank, in_features), LORA_B: (out_features, rank)}


def is_lora_name(name):
    return name.endswith((f".{LORA_A}", f".{LORA_B}"))


def is_multi_lora_name(name):
    """A Parameter of ``serve --lora``'s MultiLoRALinear (stacks, index): built from the adapters, never in a
    checkpoint."""
    return name.rsplit(".", 1)[-1] in ("multi_lora_a", "multi_lora_b", "adapter_index")




def lora_rules(linear, split):
    """The sharding rules of a LoRA adapter on a Linear (``lora_cells.LoRALinear``): y += scale * B(A(dropout(x))),
    A [r, in], B [out, r]. Column-parallel (W split over out): A whole on every rank, B split over out like W, so
    the update comes out (dp, mp) like the matmul. Row-parallel (W split over in): A split over in like W, the
    rank's partial x_r A_r^T is summed over ranks (the all-reduce), B whole, the update (dp, 1)."""
    if split == "column":
        return [OpRule(f"{linear}.lora_dropout.dropout", ((DP, 1),)),
                OpRule(f"{linear}.lora_a_matmul", ((DP, 1), (1, 1)), {1: f"{linear}.{LORA_A}"}),
                OpRule(f"{linear}.lora_b_matmul", ((DP, 1), (MP, 1)), {1: f"{linear}.{LORA_B}"}),
                OpRule(f"{linear}.lora_mul", ((DP, MP), ())),
                OpRule(f"{linear}.lora_add", ((DP, MP), (DP, MP)))]
    return [OpRule(f"{linear}.lora_dropout.dropout", ((DP, MP),)),
            OpRule(f"{linear}.lora_a_matmul", ((DP, MP), (1, MP)), {1: f"{linear}.{LORA_A}"}),
            OpRule(f"{linear}.lora_b_matmul", ((DP, 1), (1, 1)), {1: f"{linear}.{LORA_B}"}),
            OpRule(f"{linear}.lora_mul", ((DP, 1), ())),
            OpRule(f"{linear}.lora_add", ((DP, 1), (DP, 1)))]


METHOD = Method(
    ("lora",), read, is_lora_name,
    lambda name: (f"checkpoint holds LoRA adapters (e.g. '{name}') but the model has none, so they would be ignored; "
                  f"fold them in first (`gptlocal lora merge --base BASE_DIR --adapter THIS --out MERGED`) or build "
                  f"the model with the run's pet_config."))
