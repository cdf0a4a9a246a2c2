"""The layer spec: which Cell each replaceable part of a decoder layer is built with, chosen before the layer is
built (Megatron-core's layer specs, ``gpt_layer_specs.py``), so PEFT stays outside the base classes and nothing is
swapped in afterwards.

A layer spec is a callable ``spec(layer_index) -> {path in the block: factory}``. The paths are a block's Linears
(``attention.linear_qkv``, ``attention.linear_proj``, ``mlp.linear_fc1``, ``mlp.linear_gate``, ``mlp.linear_fc2``:
the factory takes ``Linear``'s arguments, e.g. ``LoRALinear`` with its spec bound) and its adapter sites
(``attention_adapter``, ``mlp_adapter``: the factory takes none). A path the spec leaves out is built the base way
(``Linear``; no adapter). The base Cells (``gpt.py``, ``attention.py``) only read the dict;
``pet_layer_spec`` builds it from ``model_config.pet_config``; ``serve --lora`` gives its own
(``lora.MultiLoRASpec``) to ``GPTLocalForCausalLM(config, layer_spec=...)``.
"""
import functools

from .lora_config import is_adapter_spec


def pet_layer_spec(config):
    """The layer spec of ``config``'s pet_config (``config.lora_spec()``): LoRALinears on the targeted Linears
    (``lora.lora_layer_spec``), bottleneck adapters on the chosen sites (``adapter.adapter_layer_spec``), or None
    (no pet_config, or prefix tuning, which adds no Cell to a layer)."""
    spec = config.lora_spec()
    if spec is None:
        return None
    if is_adapter_spec(spec):
        from .adapter import adapter_layer_spec
        return functools.partial(adapter_layer_spec, spec, config)
    from .lora import lora_layer_spec
    return functools.partial(lora_layer_spec, spec, dropout_seed=config.dropout_seed)


def freeze_pet(model):
    """The pet_config's freeze lists after the build (LoRA, adapters), or prefix tuning's frozen base; logs the
    trainable count. Nothing without a pet_config."""
    spec = model.config.lora_spec()
    if spec is not None:
        if is_adapter_spec(spec):
            from .adapter import freeze_adapters
            freeze_adapters(model, spec)
        else:
            from .lora import freeze_lora
            freeze_lora(model, spec)
    elif model.model.prefix_encoder is not None:  # prefix tuning: only the prefix trains
        from .prefix import freeze_base
        freeze_base(model)
