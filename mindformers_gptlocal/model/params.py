"""The one table of gpt_local's parameters: name -> shape, layout over ``mp``, pipeline stages.

Everything that names or sizes a weight reads it from here: HF conversion (``checkpoint/hf_gpt2.py``),
the checkpoint check before a load (``model/weights.py``), per-rank split/merge
(``checkpoint/distributed.py``) and the memory estimate (``plan/memory.py``). The names are the
attribute paths of the Cells in ``gpt.py``; ``tests/test_params.py`` checks the table against a
built model's ``parameters_and_names()``. Layouts come from the sharding rules
(``parallel/sharding.py``), stages from the ``Layout``.

Pure Python (no MindSpore): ``gptlocal plan`` and ``gptlocal convert`` use it without importing it.
"""
from collections import namedtuple

from ..parallel.layout import Layout, config_value
from ..parallel.sharding import layout_of, model_rules, param_layouts, split_axis
from .lora_config import PREFIX_NAME, lora_shapes, prefix_shapes, read_pet_config, read_prefix_config, targeted_paths

# GPT-2 (Hugging Face) names -> ours; GPTLocalConfig accepts both.
GPT2_ALIASES = {
    "n_layer": "num_hidden_layers", "num_layers": "num_hidden_layers",
    "n_head": "num_attention_heads", "num_heads": "num_attention_heads",
    "n_embd": "hidden_size", "n_inner": "intermediate_size", "ffn_hidden_size": "intermediate_size",
    "n_positions": "max_position_embeddings", "layer_norm_epsilon": "layernorm_epsilon",
    "activation_function": "hidden_act", "resid_pdrop": "hidden_dropout", "attn_pdrop": "attention_dropout",
    "embd_pdrop": "embedding_dropout", "param_init_type": "params_dtype",
}

ACTIVATIONS = ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh", "gelu_fast", "quick_gelu", "silu", "swiglu")  # hidden_act values

# The layer choices of one GPTLocalBlock (issue: GPT-2, NeoX-style and Llama-style from one code path), with the
# GPT-2 values as defaults; MindFormers' TransformerConfig names. ``GPTLocalConfig`` validates them;
# ``architecture`` reads them from a config object or a model_config dict.
ARCH_DEFAULTS = {"position_embedding_type": "learned_absolute", "rotary_percent": 1.0, "rotary_base": 10000.0,
                 "num_query_groups": None, "gated_linear_unit": False, "normalization": "LayerNorm",
                 "add_bias_linear": True, "add_qkv_bias": None, "untie_embeddings_and_output_weights": False,
                 "use_parallel_residual": False}
POSITION_TYPES = ("learned_absolute", "rope")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")

Architecture = namedtuple("Architecture", "rope rotary_percent rotary_base groups gated rmsnorm bias qkv_bias "
                                          "untied parallel_residual")


def rotary_dim(head_dim, rotary_percent):
    """Channels of each head that rotary embeddings turn (the first ones, as NeoX's rotary_pct does)."""
    return int(round(head_dim * rotary_percent))


def architecture(config):
    """The block's layer choices of a model config (object or dict), defaults filled in (GPT-2)."""
    def get(key):
        value = config_value(config, key, None)
        return ARCH_DEFAULTS[key] if value is None else value
    heads = size_value(config, "num_attention_heads")
    bias = bool(get("add_bias_linear"))
    qkv_bias = get("add_qkv_bias")
    gated = bool(get("gated_linear_unit")) or config_value(config, "hidden_act", None) == "swiglu"
    untied = bool(get("untie_embeddings_and_output_weights")) or config_value(config, "tie_word_embeddings",
                                                                               True) is False
    return Architecture(rope=get("position_embedding_type") == "rope", rotary_percent=float(get("rotary_percent")),
                        rotary_base=float(get("rotary_base")), groups=get("num_query_groups") or heads,
                        gated=gated, rmsnorm=get("normalization") == "RMSNorm", bias=bias,
                        qkv_bias=bias if qkv_bias is None else bool(qkv_bias), untied=untied,
                        parallel_residual=bool(get("use_parallel_residual")))

# GPTLocalConfig's defaults for the sizes (a test checks they agree with GPTLocalConfig()).
SIZE_DEFAULTS = {"vocab_size": 50257, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "intermediate_size": None, "max_position_embeddings": 1024}

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


def size_value(config, key):
    """A size from a model config (object or dict, GPT-2 names accepted), with GPTLocalConfig's default."""
    value = config_value(config, key, None)
    if value is None:
        for alias, name in GPT2_ALIASES.items():
            if name == key and config_value(config, alias, None) is not None:
                return config_value(config, alias)
    return SIZE_DEFAULTS[key] if value is None else value


def dims(config):
    """The sizes the table needs: vocab, hidden, layers, heads, inter, positions, and ``arch`` (the
    block's layer choices, ``architecture``)."""
    hidden = size_value(config, "hidden_size")
    return dict(vocab=size_value(config, "vocab_size"), hidden=hidden, layers=size_value(config, "num_hidden_layers"),
                heads=size_value(config, "num_attention_heads"),
                inter=size_value(config, "intermediate_size") or 4 * hidden,
                positions=size_value(config, "max_position_embeddings"), arch=architecture(config))


def qkv_width(d):
    """Rows of the fused QKV weight: heads query heads + 2 * num_query_groups key/value heads."""
    arch = d.get("arch") or architecture({})
    groups = arch.groups or d["heads"]
    return (d["heads"] + 2 * groups) * (d["hidden"] // d["heads"])


def layer_shapes(d):
    """One block's parameters, names relative to the block, in the block's attribute order."""
    h, i = d["hidden"], d["inter"]
    arch = d.get("arch") or architecture({})
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
    LoraSpec (``model/lora_config.py``) whose adapters are in the table too; ``prefix``: a PrefixSpec whose
    prefix tensors are (replicated, on every stage: each layer reads its rows)."""
    layout = layout or Layout()
    arch = d.get("arch") or architecture({})
    lora_paths = targeted_paths(lora, d["layers"], arch.gated) if lora else []
    layouts = param_layouts(model_rules(layout, d["layers"], lora_paths, arch))
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
    ``layout`` defaults to the config's own (``Layout.of_model_config``)."""
    pet = config_value(config, "pet_config", None)
    lora = read_pet_config(pet, dims(config)["layers"])
    return table_of_dims(dims(config), layout_of(config) if layout is None else layout, lora,
                         read_prefix_config(pet))


def layer_of(name):
    """The layer index of a parameter name, or None for the embedding and final norm."""
    if not name.startswith(LAYER_PREFIX):
        return None
    return int(name[len(LAYER_PREFIX):].split(".", 1)[0])
