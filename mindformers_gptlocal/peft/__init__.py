"""PEFT methods (MindFormers' ``model_config.pet_config.pet_type``), each in one place, registered once here.

A method is a pure-Python module (``lora.py``, ``adapter.py``, ``prefix.py``: its ``pet_config`` keys read and checked,
its parameter shapes, freeze lists and sharding rules, as a settings object, a ``base.PetSpec``) and its MindSpore Cells
in ``model/`` (``model/lora_cells.py``, ``adapter_cells.py``, ``prefix_cells.py``: the settings name their module,
``PetSpec.cells``, and never import it), so ``gptlocal plan`` and ``convert`` run without MindSpore. ``METHODS`` lists
them; the generic code asks
the settings object (``GPTLocalConfig.pet_spec()``, ``read``) and never names a method: the layer spec
(``model/layer_spec.py``), the parameter table (``model/params.py``), the sharding rules (``parallel/sharding.py``),
freezing, the planner, the checkpoint checks (``model/weights.py``).

A new method: ``<name>.py`` (a ``PetSpec`` namedtuple, ``read``, ``METHOD``, ``cells``) and ``model/<name>_cells.py``
(its Cells, its ``layer_spec(spec, config)`` and ``check_built(spec, model)``), and its ``METHOD`` in ``METHODS``.
"""
from ..errors import ConfigError
from . import adapter, lora, prefix
from .base import check_trainable, get

METHODS = (lora.METHOD, adapter.METHOD, prefix.METHOD)
PET_TYPES = tuple(pet_type for method in METHODS for pet_type in method.pet_types)


def method_of(pet_type):
    """The registered Method answering ``pet_type``; one ConfigError naming the supported ones otherwise."""
    for method in METHODS:
        if pet_type in method.pet_types:
            return method
    raise ConfigError(f"model_config.pet_config.pet_type {pet_type!r} is not supported by gpt_local; use "
                      f"pet_type: {' or '.join(PET_TYPES)}.")


def read(pet_config, num_layers, max_positions=None):
    """``model_config.pet_config`` (a dict or MindFormers' config object) -> its method's settings (a PetSpec), or
    None without one; ``max_positions``: the model's max_position_embeddings, when known. Every bad key or value is
    one ConfigError naming it."""
    if not pet_config:
        return None
    return method_of(get(pet_config, "pet_type")).read(pet_config, num_layers, max_positions)


def is_pet_name(name):
    """A parameter of some PEFT method (LoRA's A/B, an adapter's, the prefix's)."""
    return any(method.owns(name) for method in METHODS)


__all__ = ["METHODS", "PET_TYPES", "method_of", "read", "is_pet_name", "check_trainable"]
