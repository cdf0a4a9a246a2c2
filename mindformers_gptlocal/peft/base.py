"""What every PEFT method shares, in pure Python: reading ``pet_config`` keys, mindpet's freeze lists, and the
two records a method fills in (``PetSpec``: what its settings answer; ``Method``: its registry entry)."""
from collections import namedtuple
from fnmatch import fnmatch

from ..errors import ConfigError

Method = namedtuple("Method", "pet_types read owns loaded_without not_foldable")
Method.__new__.__defaults__ = (None,)
Method.__doc__ = (
    "A PEFT method's registry entry (``peft/__init__.py`` METHODS). pet_types: the ``pet_config.pet_type`` values it "
    "answers; read(pet_config, num_layers, max_positions): its settings (a PetSpec), one ConfigError naming the key "
    "for a bad value; owns(parameter name): whether a tensor is one of its own; loaded_without(example name): the "
    "CheckpointError text when a checkpoint holds its tensors but the model has none; not_foldable(example name): "
    "what its tensors are and why ``gptlocal lora merge`` / the PEFT LoRA export cannot take them (None: LoRA).")


class PetSpec:
    """A method's settings, read once from ``pet_config`` (a namedtuple subclass with this mixin), and everything
    the generic code asks of a method. Defaults: a method that adds nothing of that kind."""
    __slots__ = ()
    plan_part = "adapters"  # its line in the planner's per-stage parameter counts
    adds_prefix = False  # prefix tuning: attention reads prefix rows (model/attention.py, model/prefix_cells.py)
    cells = None  # the module of model/ holding its layer Cells (``layer_spec``, ``check_built``); None: it adds none
    dropout_rate = 0.0  # a dropout of its own (counter-based when the build is: model/dropout.py)

    def layer_rules(self, index, act, arch):
        """Sharding rules (``parallel/sharding.py`` OpRule) of layer ``index``'s own ops, paths relative to the
        block; ``act``: the block's activation layout; ``arch``: its layer choices."""
        return []

    def model_rules(self):
        """Sharding rules of its ops outside the layers, paths relative to the model."""
        return []

    def param_shapes(self, d, base):
        """{full parameter name: shape} of its tensors for sizes ``d`` (``model/params.py`` dims); ``base``: the
        base model's names -> shapes. A name under ``model.layers.{i}.`` lives on layer i's stage, any other on
        every stage; a tensor no rule reads is replicated."""
        return {}

    def check_config(self, config):
        """Rules across the model config (a GPTLocalConfig), after the settings were read."""

    def is_frozen(self, name):
        """mindpet's freeze_modules on one parameter name: frozen when it matches freeze_include and not
        freeze_exclude; matched by both, it is left trainable (as it was built)."""
        include = any(fnmatch(name, p) for p in self.freeze_include or [])
        keep = any(fnmatch(name, p) for p in self.freeze_exclude or [])
        return include and not keep

    def trainable_hint(self):
        """(how its tensors are named, the freeze_exclude that keeps them) for the "nothing trains" error."""
        return "its tensors", "*"

    def summary(self, model, trainable, total):
        """The log line after freezing a built ``model``."""
        return f"[gptlocal] {self.pet_type}: {trainable:,} trainable parameters of {total:,}"


def get(pet_config, key, default=None):
    """``pet_config[key]`` (a dict or MindFormers' config object); ``default`` when absent or None."""
    value = pet_config.get(key, default) if hasattr(pet_config, "get") else getattr(pet_config, key, default)
    return default if value is None else value


def items(pet_config):
    return pet_config.items() if hasattr(pet_config, "items") else vars(pet_config).items()


def str_list(pet_config, key):
    """A list-of-strings key (a single string is a list of one), or None when absent."""
    value = get(pet_config, key)
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    value = list(value)
    if not value or not all(isinstance(item, str) for item in value):
        raise ConfigError(f"model_config.pet_config.{key} must be a non-empty list of strings, got {value!r}.")
    return value


def check_trainable(spec, names):
    """The trainable names under ``spec``'s freeze; one ConfigError when none is left."""
    trainable = [n for n in names if not spec.is_frozen(n)]
    if not trainable:
        named, keep = spec.trainable_hint()
        raise ConfigError(f"model_config.pet_config freeze_include {spec.freeze_include} / freeze_exclude "
                          f"{spec.freeze_exclude} freeze every parameter, so nothing would train; the adapters are "
                          f"named {named}: use freeze_include: ['*'], freeze_exclude: ['{keep}'].")
    return trainable
