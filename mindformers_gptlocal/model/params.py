"""The one table of gpt_local's parameters: name -> shape, layout over ``mp``, pipeline stages.

Everything that names or sizes a weight reads it from here: HF conversion (``checkpoint/hf_gpt2.py``),
the checkpoint check before a load (``model/weights.py``), per-rank split/merge
(``checkpoint/distributed.py``) and the memory estimate (``plan/memory.py``). The names are the
attribute paths of the Cells in ``gpt.py``; ``tests/model/test_params.py`` checks the table against a
built model's ``parameters_and_names()``. Layouts come from the sharding rules
(``parallel/sharding.py``), stages from the ``Layout``.

Pure Python (no MindSpore): ``gptlocal plan`` and ``gptlocal convert`` use it without importing it.
"""
from collections import namedtuple

from ..parallel.layout import Layout, config_value
from ..parallel.sharding import layout_of, model_rules, param_layouts, split_axis
from .arch import (ACTIVATIONS, ARCH_DEFAULTS, GPT2_ALIASES, NORMALIZATIONS, POSITION_TYPES,  # noqa: F401
                   SIZE_DEFAULTS, Arch, model_value, rotary_dim)
from .lora_config import (PREFIX_NAME, adapter_paths, adapter_shapes, bottleneck_width, is_adapter_spec, lora_shapes,
                          prefix_shapes, read_pet_config, read_prefix_config, targeted_paths)


def architecture(config):
    """The block's layer choices of a model config (object or dict), defaults filled in: its ``Arch``."""
    return Arch.of(config)


WORD_EMBEDDINGS = "model.embedding.word_embeddings"
OUTPUT_LAYER = "output_layer.weight"  # the untied head (untie_embeddings_and_output_weights)
POSITION_EMBEDDINGS = "model.embedding.position_embeddings"
LAYER_PREFIX = "model.layers."
# training state held as a Parameter but not a weight (saved in training checkpoints, never in model files):
# the forward counter of counter-based dropout (model/dropout.py)
DROPOUT_STEP = "dropout_step"


def is_weight(name):
    """True for the parameters of the table; False for training state such as ``dropout_step``."""
    return name != DROPOUT_STEP


class ParamSpec(namedtuple("ParamSpec", "shape layout stages")):
    """shape: full shape; layout: per axis 'dp'/'mp'/1 (sharding rules); stages: pipeline stages that
    hold it (the tied token table: the first and the last)."""

    @property
    def split_axis(self):
        return split_axis(self.layout)

    def rank_size(self, mp):
        """Elements one tensor-parallel rank holds."""
        size = 1
        for length in self.shape:
            size *= length
        return size // mp if self.split_axis is not None else size


def dims(config):
    """The sizes the table needs: vocab, hidden, layers, heads, inter, positions, and ``arch`` (the model's
    ``Arch``, which holds them all; the dict is the planner's working form)."""
    arch = Arch.of(config)
    return dict(vocab=arch.vocab_size, hidden=arch.hidden_size, layers=arch.num_hidden_layers,
                heads=arch.num_attention_heads, inter=arch.inter, positions=arch.max_position_embeddings, arch=arch)


def qkv_width(d):
    """Rows of the fused QKV weight: heads query heads + 2 * num_query_groups key/value heads."""
    arch = d.get("arch") or Arch()
    groups = arch.groups or d["heads"]
    return (d["heads"] + 2 * groups) * (d["hidden"] // d["heads"])


def layer_shapes(d):
    """One block's parameters, names relative to the block, in the block's attribute order."""
    h, i = d["hidden"], d["inter"]
    arch = d.get("arch") or Arch()
    qkv = qkv_width(d)
    shapes = {}

    def norm(name):
        shapes[f"{name}.weight"] = (h,)
        if not arch.rmsnorm:
            shapes[f"{name}.bias"] = (h,)

    def linear(name, out, inp, bias):
        shapes[f"{name}.weight"] = (out, inp)
        if bias:
            shapes[f"{name}.bias"] = (out,)
    norm("input_layernorm")
    linear("attention.linear_qkv", qkv, h, arch.qkv_bias)
    linear("attention.linear_proj", h, h, arch.bias)
    norm("post_attention_layernorm")
    linear("mlp.linear_fc1", i, h, arch.bias)
    if arch.gated:
        linear("mlp.linear_gate", i, h, arch.bias)
    linear("mlp.linear_fc2", h, i, arch.bias)
    return shapes


def table_of_dims(d, layout=None, lora=None, prefix=None):
    """name -> ParamSpec for sizes ``d`` (see ``dims``) under ``layout`` (default: one device); ``lora``: a
    LoraSpec or AdapterSpec (``model/lora_config.py``) whose adapters are in the table too; ``prefix``: a
    PrefixSpec whose prefix tensors are (replicated, on every stage: each layer reads its rows)."""
    layout = layout or Layout()
    arch = d.get("arch") or Arch()
    adapter = lora if is_adapter_spec(lora) else None  # pet_type: adapter (model/adapter.py)
    lora = None if adapter else lora
    lora_paths = targeted_paths(lora, d["layers"], arch.gated) if lora else []
    bottlenecks = adapter_paths(adapter, d["layers"]) if adapter else []
    layouts = param_layouts(model_rules(layout, d["layers"], lora_paths, arch, bottlenecks))
    stage_ids = layout.stage_of_layers(d["layers"])
    last = max(stage_ids)
    shapes = {WORD_EMBEDDINGS: ((d["vocab"], d["hidden"]), [0] if arch.untied else sorted({0, last}))}
    if not arch.rope:
        shapes[POSITION_EMBEDDINGS] = ((d["positions"], d["hidden"]), [0])
    for index in range(d["layers"]):
        for name, shape in layer_shapes(d).items():
            shapes[f"{LAYER_PREFIX}{index}.{name}"] = (shape, [stage_ids[index]])
    for path in lora_paths:
        weight = shapes[path + ".weight"]
        for name, shape in lora_shapes(weight[0][1], weight[0][0], lora.rank).items():
            shapes[f"{path}.{name}"] = (shape, weight[1])
    for path in bottlenecks:
        stage = [stage_ids[layer_of(path)]]
        for name, shape in adapter_shapes(d["hidden"], bottleneck_width(adapter, d["hidden"])).items():
            shapes[f"{path}.{name}"] = (shape, stage)
    if prefix is not None:
        kv_width = (arch.groups or d["heads"]) * (d["hidden"] // d["heads"])
        for name, shape in prefix_shapes(prefix, d["layers"], kv_width).items():
            shapes[f"model.{PREFIX_NAME}.{name}"] = (shape, sorted(set(stage_ids)))
            layouts[f"model.{PREFIX_NAME}.{name}"] = (1,) * len(shape)
    shapes["model.final_layernorm.weight"] = ((d["hidden"],), [last])
    if not arch.rmsnorm:
        shapes["model.final_layernorm.bias"] = ((d["hidden"],), [last])
    if arch.untied:
        shapes[OUTPUT_LAYER] = ((d["vocab"], d["hidden"]), [last])
    return {name: ParamSpec(shape, layouts[name], stages) for name, (shape, stages) in shapes.items()}


def parameter_table(config, layout=None):
    """name -> ParamSpec of the model ``config`` describes (GPTLocalConfig or model_config dict);
    ``layout`` defaults to the config's own (``config.layout``, or ``Layout.of_model_config``). A
    GPTLocalConfig's PEFT specs are its own (read once); a dict's pet_config is read here."""
    d = dims(config)
    if hasattr(config, "lora_spec"):
        lora, prefix = config.lora_spec(), config.prefix_spec()
    else:
        pet = config_value(config, "pet_config", None)
        lora, prefix = read_pet_config(pet, d["layers"]), read_prefix_config(pet)
    return table_of_dims(d, layout_of(config) if layout is None else layout, lora, prefix)


def layer_of(name):
    """The layer index of a parameter name, or None for the embedding and final norm."""
    if not name.startswith(LAYER_PREFIX):
        return None
    return int(name[len(LAYER_PREFIX):].split(".", 1)[0])
