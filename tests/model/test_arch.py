"""model/arch.py: the architecture read once (aliases, defaults, derived values, one message per rule), and
GPTLocalConfig's derived objects (Arch, Layout, LoRA spec) built once per config, not per access."""
import pytest
from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.errors import ConfigError
from mindformers_gptlocal import peft
from mindformers_gptlocal.model import arch as arch_module
from mindformers_gptlocal.model.arch import Arch
from mindformers_gptlocal.model.params import dims, parameter_table
from mindformers_gptlocal.parallel.rules import check_parallel_layout
from conftest import TINY

PET = dict(pet_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=".*linear_qkv",
           freeze_include=["*"], freeze_exclude=["*lora*"])


def test_derived_values_match_hugging_face_configs():
    """head_dim, key/value groups and rotary channels as Hugging Face's configs and models define them."""
    llama = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96)
    arch = Arch.of(dict(hidden_size=64, num_attention_heads=8, num_query_groups=2, intermediate_size=96,
                        position_embedding_type="rope", hidden_act="swiglu", add_bias_linear=False))
    assert (arch.head_dim, arch.groups, arch.group_size) == (
        llama.hidden_size // llama.num_attention_heads, llama.num_key_value_heads,
        llama.num_attention_heads // llama.num_key_value_heads)
    assert arch.gated and arch.rope and not arch.learned_positions and not arch.bias and not arch.qkv_bias
    neox = GPTNeoXConfig(hidden_size=64, num_attention_heads=4, rotary_pct=0.25)
    rotary = Arch.of(dict(hidden_size=64, num_attention_heads=4, position_embedding_type="rope",
                          rotary_percent=neox.rotary_pct))
    # transformers' GPTNeoXAttention: rotary_ndims = int(head_size * rotary_pct)
    assert rotary.rotary_dim == int(neox.hidden_size // neox.num_attention_heads * neox.rotary_pct) == 4
    gpt2 = GPT2Config(n_embd=48, n_head=6, n_layer=3, n_positions=32, vocab_size=99)
    hf_names = Arch.of(dict(n_embd=gpt2.n_embd, n_head=gpt2.n_head, n_layer=gpt2.n_layer,
                            n_positions=gpt2.n_positions, vocab_size=gpt2.vocab_size, seq_length=32))
    assert (hf_names.hidden_size, hf_names.num_attention_heads, hf_names.num_hidden_layers,
            hf_names.max_position_embeddings, hf_names.inter) == (48, 6, 3, 32, 4 * 48)
    assert hf_names.qkv_bias and hf_names.learned_positions and hf_names.rotary_dim == 0
    assert Arch.of(dict(tie_word_embeddings=False)).untied and not Arch.of({}).untied


def test_one_arch_for_the_config_the_dict_and_the_table():
    """A config's Arch equals the Arch of its own dict; the table's dims read that Arch."""
    values = dict(TINY, position_embedding_type="rope", num_query_groups=2, hidden_act="swiglu",
                  normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True)
    config = GPTLocalConfig(**values)
    assert config.arch == Arch.of(values) == Arch.of(config.to_dict())
    assert config.arch is config.arch and Arch.of(config) is config.arch
    assert dims(config)["arch"] is config.arch and dims(values)["inter"] == 4 * TINY["hidden_size"]
    # GPTLocalConfig stores the resolved values (config.json keeps them)
    assert (config.num_query_groups, config.add_qkv_bias, config.gated_linear_unit) == (2, False, True)


def test_layout_and_lora_are_read_once_per_config(monkeypatch):
    config = GPTLocalConfig(**TINY, pet_config=PET, parallel_config={"data_parallel": 1, "model_parallel": 2})
    assert config.layout is config.layout and config.layout.mp == 2
    calls = []
    original = peft.read
    monkeypatch.setattr("mindformers_gptlocal.model.config.read_pet_config",
                        lambda *a: calls.append(1) or original(*a))
    fresh = GPTLocalConfig(**TINY, pet_config=PET)
    spec = fresh.pet_spec()
    assert fresh.pet_spec() is spec and len(calls) == 1  # validate() read it; later calls reuse it
    assert any(name.endswith("lora_a") for name in parameter_table(fresh)) and len(calls) == 1
    fresh.num_hidden_layers = 3  # setting a field drops what was derived from it
    assert fresh.arch.num_hidden_layers == 3 and fresh.pet_spec() is not spec and len(calls) == 2
    assert "_derived" not in fresh.to_dict() and GPTLocalConfig(**TINY) == GPTLocalConfig(**TINY)


@pytest.mark.parametrize("rope", [False, True])
def test_seq_length_rule_has_one_message_for_both_position_kinds(rope):
    values = dict(TINY, seq_length=2 * TINY["max_position_embeddings"],
                  position_embedding_type="rope" if rope else "learned_absolute")
    with pytest.raises(ConfigError) as raised:
        GPTLocalConfig(**values)
    (problem,) = [p for p in check_parallel_layout(values, {}) if "seq_length" in p]
    assert str(raised.value) == problem
    assert ("learned position" in problem) is not rope and ("rotary" in problem) is rope


def test_arch_check_names_the_key():
    with pytest.raises(ConfigError, match=r"num_attention_heads \(4\) is not divisible by .*num_query_groups \(3\)"):
        Arch.of(dict(TINY, num_query_groups=3)).check()
    with pytest.raises(ConfigError, match="num_query_groups must be a positive integer"):
        GPTLocalConfig(**TINY, num_query_groups=0)
    assert Arch.of({}).check() == Arch()  # GPT-2 small's defaults pass
    assert arch_module.DEFAULTS["hidden_size"] == GPTLocalConfig().hidden_size
