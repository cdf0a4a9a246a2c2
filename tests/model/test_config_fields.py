"""model/fields.py: every model_config key declared once, and what reads that table agrees with it: GPTLocalConfig's
keys, defaults, other names, signature and config.json order; Arch's fields and defaults; the rules each key keeps."""
import dataclasses
import inspect
import json

import pytest

from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal.model import fields
from mindformers_gptlocal.model.arch import Arch
from mindformers_gptlocal.model.config import GPTLocalConfig, known_keys
from conftest import TINY

# what a default becomes once read (None: derived from other keys; GPT-2 small's values)
RESOLVED = {"intermediate_size": 4 * 768, "num_query_groups": 12, "add_qkv_bias": True, "embedding_dropout": 0.1}


def test_the_config_takes_every_key_with_its_default_in_the_tables_order():
    config = GPTLocalConfig()
    values = config.to_dict()
    for key in fields.FIELDS:
        assert values[key.name] == RESOLVED.get(key.name, key.default), key.name
    own = [name for name in vars(config) if name in fields.BY_NAME]
    assert own[:len(own) - 5] == [key.name for key in fields.FIELDS if not key.base]  # config.json's order
    params = inspect.signature(GPTLocalConfig.__init__).parameters
    assert [p for p in params if p not in ("self", "kwargs")] == [key.name for key in fields.FIELDS]
    assert all(params[key.name].default == key.default for key in fields.FIELDS)
    assert {key.name for key in fields.FIELDS} | set(fields.ALIASES) <= known_keys()


def test_arch_is_the_architecture_keys():
    names = [f.name for f in dataclasses.fields(Arch) if f.init]
    assert names == [key.name for key in fields.ARCH_FIELDS]
    assert [getattr(Arch, name) for name in names] == [key.default for key in fields.ARCH_FIELDS]
    config = GPTLocalConfig(**TINY)
    assert all(getattr(config, key.name) == getattr(config.arch, key.name) for key in fields.ARCH_FIELDS)


@pytest.mark.parametrize("alias,name", sorted(fields.ALIASES.items()))
def test_every_other_name_sets_our_key(alias, name):
    value = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 48,
             "max_position_embeddings": 64, "layernorm_epsilon": 1e-6, "hidden_act": "relu", "hidden_dropout": 0.05,
             "attention_dropout": 0.04, "embedding_dropout": 0.03, "params_dtype": "float16"}[name]
    values = dict(TINY, **{alias: value})
    values.pop(name, None)
    config = GPTLocalConfig(**values)
    assert getattr(config, name) == value and alias not in config.to_dict()
    with pytest.raises(ConfigError, match=f"sets {name} twice"):
        GPTLocalConfig(**dict(values, **{name: value * 2 if name != "hidden_act" else "gelu"}))


BAD = [("hidden_size", 0, "positive integer"), ("vocab_size", "9", "positive integer"),
       ("num_query_groups", 0, r"positive integer \(or unset"), ("hidden_act", "tanh", "is not supported"),
       ("position_embedding_type", "alibi", "is not supported"), ("normalization", "ScaleNorm", "is not supported"),
       ("layernorm_epsilon", "x", "must be a number"), ("hidden_dropout", 1.0, r"in \[0, 1\)"),
       ("embedding_dropout", -0.1, r"in \[0, 1\)"), ("layerdrop", 1.5, r"in \[0, 1\)"),
       ("dropout_seed", -1, "whole number >= 0"), ("attention_block_size", -2, "whole number >= 0"),
       ("max_batch_size", True, "positive integer"), ("compute_dtype", "float64", "is not a dtype"),
       ("params_dtype", "int8", "is not a dtype"), ("scale_attn_weights", False, "is not supported"),
       ("reorder_and_upcast_attn", True, "is not supported"), ("rotary_base", "abc", "must be a number")]


@pytest.mark.parametrize("key,value,message", BAD)
def test_each_keys_rule_is_one_error_naming_it(key, value, message):
    with pytest.raises(ConfigError, match=f"model_config.{key}.*{message}") as raised:
        GPTLocalConfig(**dict(TINY, **{key: value}))
    assert "\n" not in str(raised.value)


def test_read_values_round_trip_through_config_json(tmp_path):
    config = GPTLocalConfig(**dict(TINY, layernorm_epsilon="1e-6", hidden_dropout="0.2", use_flash_attention=1,
                                   tie_word_embeddings=False, cpu_kernels={"linear": "plain"}))
    assert (config.layernorm_epsilon, config.hidden_dropout, config.embedding_dropout) == (1e-6, 0.2, 0.2)
    assert config.use_flash_attention is True and config.untie_embeddings_and_output_weights is True
    assert config.tie_word_embeddings is False and config.cpu_kernels == {"linear": "plain"}
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    assert GPTLocalConfig.from_model_dir(str(tmp_path)) == config
