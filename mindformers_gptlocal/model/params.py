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
from .lora_config import lora_shapes, read_pet_config, targeted_paths

# GPT-2 (Hugging Face) names -> ours; GPTLocalConfig accepts both.
GPT2_ALIASES = {
    "n_layer": "num_hidden_layers", "num_layers": "num_hidden_layers",
    "n_head": "num_attention_heads", "num_heads": "num_attention_heads",
    "n_embd": "hidden_size", "n_inner": "intermediate_size", "ffn_hidden_size": "intermediate_size",
    "n_positions": "max_position_embeddings", "layer_norm_epsilon": "layernorm_epsilon",
    "activation_function": "hidden_act", "resid_pdrop": "hidden_dropout", "attn_pdrop": "attention_dropout",
    "embd_pdrop": "embedding_dropout", "param_init_type": "params_dtype",
}

ACTIVATIONS = ("gelu_new", "gelu", "relu", "gelu_pytorch_tanh", "gelu_fast")  # hidden_act values

# GPTLocalConfig's defaults for the sizes (a test checks they agree with GPTLocalConfig()).
SIZE_DEFAULTS = {"vocab_size": 50257, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12,
                 "intermediate_size": None, "max_position_embeddings": 1024}

WORD_EMBEDDINGS = "model.embedding.word_embeddings"
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
    """The sizes the table needs: vocab, hidden, layers, heads, inter, positions."""
    hidden = size_value(config, "hidden_size")
    return dict(vocab=size_value(config, "vocab_size"), hidden=hidden, layers=size_value(config, "num_hidden_layers"),
                heads=size_value(config, "num_attention_heads"),
                inter=size_value(config, "intermediate_size") or 4 * hidden,
                positions=size_value(config, "max_position_embeddings"))


def layer_shapes(d):
    """One block's parameters, names relative to the block, in the block's attribute order."""
    h, i = d["hidden"], d["inter"]
    return {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
            "attention.linear_qkv.weight": (3 * h, h), "attention.linear_qkv.bias": (3 * h,),
            "attention.linear_proj.weight": (h, h), "attention.linear_proj.bias": (h,),
            "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
            "mlp.linear_fc1.weight": (i, h), "mlp.linear_fc1.bias": (i,),
            "mlp.linear_fc2.weight": (h, i), "mlp.linear_fc2.bias": (h,)}


def table_of_dims(d, layout=None, lora=None):
    """name -> ParamSpec for sizes ``d`` (see ``dims``) under ``layout`` (default: one device); ``lora``: a
    LoraSpec (``model/lora_config.py``) whose adapters are in the table too."""
    layout = layout or Layout()
    lora_paths = targeted_paths(lora, d["layers"]) if lora else []
    layouts = param_layouts(model_rules(layout, d["layers"], lora_paths))
    stage_ids = layout.stage_of_layers(d["layers"])
    last = max(stage_ids)
    shapes = {WORD_EMBEDDINGS: ((d["vocab"], d["hidden"]), sorted({0, last})),
              POSITION_EMBEDDINGS: ((d["positions"], d["hidden"]), [0])}
    for index in range(d["layers"]):
        for name, shape in layer_shapes(d).items():
            shapes[f"{LAYER_PREFIX}{index}.{name}"] = (shape, [stage_ids[index]])
    for path in lora_paths:
        weight = shapes[path + ".weight"]
        for name, shape in lora_shapes(weight[0][1], weight[0][0], lora.rank).items():
            shapes[f"{path}.{name}"] = (shape, weight[1])
    shapes["model.final_layernorm.weight"] = ((d["hidden"],), [last])
    shapes["model.final_layernorm.bias"] = ((d["hidden"],), [last])
    return {name: ParamSpec(shape, layouts[name], stages) for name, (shape, stages) in shapes.items()}


def parameter_table(config, layout=None):
    """name -> ParamSpec of the model ``config`` describes (GPTLocalConfig or model_config dict);
    ``layout`` defaults to the config's own (``Layout.of_model_config``)."""
    lora = read_pet_config(config_value(config, "pet_config", None), dims(config)["layers"])
    return table_of_dims(dims(config), layout_of(config) if layout is None else layout, lora)


def layer_of(name):
    """The layer index of a parameter name, or None for the embedding and final norm."""
    if not name.startswith(LAYER_PREFIX):
        return None
    return int(name[len(LAYER_PREFIX):].split(".", 1)[0])
