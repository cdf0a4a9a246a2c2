"""The layer spec: which Cell each replaceable part of a decoder layer is built with, chosen before the layer is
built (Megatron-core's layer specs, ``gpt_layer_specs.py``), so PEFT stays outside the base classes and nothing is
swapped in afterwards.

A layer spec is a callable ``spec(layer_index) -> {path in the block: factory}``. The paths are a block's Linears
(``attention.linear_qkv``, ``attention.linear_proj``, ``mlp.linear_fc1``, ``mlp.linear_gate``, ``mlp.linear_fc2``:
the factory takes ``Linear``'s arguments, e.g. ``LoRALinear`` with its spec bound) and its adapter sites
(``attention_adapter``, ``mlp_adapter``: the factory takes only ``kernels=``). Every factory gets the model's
``KernelProvider`` as ``kernels``, never a provider of its own. A path the spec leaves out is built the base way
(``Linear``; no adapter). The base Cells (``gpt.py``, ``attention.py``) only read the dict;
``pet_layer_spec`` builds it from ``model_config.pet_config`` (its method's Cells module, ``model/<method>_cells.py``
``layer_spec``, named by its settings' ``PetSpec.cells``, ``peft/``); ``serve --lora``
gives its own (``model.lora_cells.MultiLoRASpec``) to ``GPTLocalForCausalLM(config, layer_spec=...)``.
"""
import importlib

from ..errors import ConfigError
from ..kernels.abi.layer_table import LINEARS
from .params import is_weight
from .quantization import read_quantization

# the paths of a block's Linears (the factories take Linear's arguments)
LINEAR_PATHS = tuple(part.cell for part in LINEARS)  # kernels/layer_table.py's Linears


def pet_layer_spec(config):
    """The layer spec of ``config``'s pet_config (``config.pet_spec()``): its method's Cells (LoRALinears on the
    targeted Linears, bottleneck adapters on the chosen sites), or None (no pet_config, or prefix tuning, which
    adds no Cell to a layer)."""
    cells = method_cells(config.pet_spec())
    return None if cells is None else cells.layer_spec(config.pet_spec(), config)


def method_cells(spec):
    """The module of this folder holding the layer Cells of ``spec``'s PEFT method (``PetSpec.cells``: the settings
    in ``peft/`` name it, the model imports it), or None (no pet_config, or a method that adds no Cell to a layer)."""
    if spec is None or spec.cells is None:
        return None
    return importlib.import_module(f".{spec.cells}", __package__)


def model_layer_spec(config, given=None):
    """The layer spec a model is built with: an int8 model's (``config.quantization``: ``QuantLinear`` on every
    Linear path, ``quant_cells.py``), else ``given`` (serve --lora's) or the pet_config's (``pet_layer_spec``).
    LoRA, adapters or prefix tuning on an int8 model are refused with one line (its Linears hold no float weight
    to add to)."""
    if read_quantization(config.quantization) is None:
        return pet_layer_spec(config) if given is None else given
    if given is not None or config.pet_spec() is not None:
        raise ConfigError("an int8 model (config.json quantization, `gptlocal quantize`) takes no pet_config and no "
                          "--lora adapters; use the float model directory it was quantized from.")
    from .quant_cells import QuantLinear  # pylint: disable=import-outside-toplevel
    spec = dict.fromkeys(LINEAR_PATHS, QuantLinear)
    return lambda index: spec


def freeze_pet(model, log=print):
    """The pet_config's freeze after the build (mindpet's freeze_modules lists for LoRA and adapters, the frozen
    base of prefix tuning: ``PetSpec.is_frozen``); logs the trainable count and returns (trainable, total)
    parameter counts, or None without a pet_config. Training state that is not a weight (the dropout counter
    ``dropout_step``) is left as it is and not counted."""
    spec = model.config.pet_spec()
    if spec is None:
        return None
    params = {name: param for name, param in model.parameters_and_names() if is_weight(name)}
    for name, param in params.items():
        param.requires_grad = not spec.is_frozen(name)
    total = sum(p.size for p in params.values())
    trainable = sum(p.size for p in params.values() if p.requires_grad)
    cells = method_cells(spec)
    if cells is not None:
        cells.check_built(spec, model)
    log(spec.summary(model, trainable, total))
    return trainable, total
