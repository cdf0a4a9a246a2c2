"""Llama-family (Llama, Qwen2) and GPT-NeoX weights in and out: logits and greedy generation equal to
transformers (fp32, CPU), round trips bit-exact, refusals clear. One random tiny model per config, built once
(module fixture) and shared by the tests; the configs cover GQA ratios 1, 3, 4 and 8, an odd head count,
qkv biases, rotary_percent 0.25 and 0.5, parallel and sequential residuals, tied and untied heads."""
import json

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, \
    Qwen2ForCausalLM

import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms, ms_to_hf
from mindformers_gptlocal.errors import CheckpointError, ConfigError

BASE = dict(vocab_size=300, max_position_embeddings=64, num_hidden_layers=2, initializer_range=0.1,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)
CONFIGS = {
    # Llama, 8 heads over 2 key/value groups (ratio 4), untied head, a non-default rope_theta
    "llama-gqa4-untied": (LlamaConfig, LlamaForCausalLM,
                          dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                               tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5)),
    # TinyLlama/SmolLM-like: one key/value head for 8 query heads (ratio 8), tied head
    "llama-gqa8-tied": (LlamaConfig, LlamaForCausalLM,
                        dict(hidden_size=64, num_attention_heads=8, num_key_value_heads=1, intermediate_size=80,
                             tie_word_embeddings=True)),
    # plain multi-head (ratio 1) with biases everywhere (attention_bias + mlp_bias)
    "llama-mha-bias": (LlamaConfig, LlamaForCausalLM,
                       dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
                            attention_bias=True, mlp_bias=True)),
    # Qwen2: q/k/v biases only, an odd head count (3 heads, 1 group: ratio 3)
    "qwen2-odd-heads": (Qwen2Config, Qwen2ForCausalLM,
                        dict(hidden_size=48, num_attention_heads=3, num_key_value_heads=1, intermediate_size=72,
                             tie_word_embeddings=True)),
    # Pythia-like: rotary on a quarter of each head, parallel residual, untied
    "neox-pct0.25-parallel": (GPTNeoXConfig, GPTNeoXForCausalLM,
                              dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, rotary_pct=0.25,
                                   use_parallel_residual=True, tie_word_embeddings=False)),
    # NeoX with 5 heads, half rotary, sequential residual, tied head, tanh gelu
    "neox-odd-sequential-tied": (GPTNeoXConfig, GPTNeoXForCausalLM,
                                 dict(hidden_size=80, num_attention_heads=5, intermediate_size=160, rotary_pct=0.5,
                                      use_parallel_residual=False, tie_word_embeddings=True,
                                      hidden_act="gelu_new")),
}
PROMPTS = [[5, 17, 42, 7, 99, 3, 11], [8, 1], [250, 1, 2, 3, 4]]


def make_hf(path, name, seed=0):
    """A random HF model of CONFIGS[name], with norms and biases moved off their init so layout slips show."""
    config_class, model_class, values = CONFIGS[name]
    torch.manual_seed(seed)
    model = model_class(config_class(**BASE, **values)).eval()
    with torch.no_grad():
        for key, param in model.named_parameters():
            if "norm" in key or key.endswith("bias"):
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def converted(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf(path / "hf", request.param)
    hf_to_ms(str(path / "hf"), str(path / "ms"))
    ms.set_context(mode=ms.GRAPH_MODE)
    ours = GPTLocalForCausalLM.from_pretrained(str(path / "ms"))
    ours.set_train(False)
    yield request.param, hf, ours, path
    ms.set_context(mode=ms.PYNATIVE_MODE)


def test_logits_and_loss_match_transformers(converted):
    name, hf, ours, _ = converted
    ids = np.random.default_rng(1).integers(0, BASE["vocab_size"], (2, 24))
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids))
    logits = ours(Tensor(ids, ms.int32)).asnumpy()
    diff = np.abs(logits - out.logits.numpy()).max()
    print(f"{name}: max |logit diff| = {diff:.3e}, logit std {out.logits.numpy().std():.3f}")
    assert diff <= 1e-4
    ours.set_train(True)
    try:
        loss = float(ours(Tensor(ids[:, :-1], ms.int32), Tensor(ids[:, 1:], ms.int32))[0])
    finally:
        ours.set_train(False)
    assert abs(loss - float(out.loss)) <= 1e-5 * float(out.loss)


def _until_eos(tokens, prompt, eos):
    new = tokens[len(prompt):]
    return tokens[:len(prompt) + new.index(eos) + 1] if eos in new else tokens


def test_ragged_greedy_batch_equals_transformers_one_by_one(converted):
    """Our ragged batch (each row its own rotary offsets in the cache) against transformers per prompt."""
    _, hf, ours, _ = converted
    batch = ours.generate(PROMPTS, max_new_tokens=10, do_sample=False)
    eos = BASE["eos_token_id"]
    for prompt, mine in zip(PROMPTS, batch):
        with torch.no_grad():
            reference = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long))[0].tolist()
        assert _until_eos(mine, prompt, eos) == _until_eos(reference, prompt, eos)


def test_round_trip_is_bit_exact_and_loads_in_transformers(converted):
    name, hf, _, path = converted
    ms_to_hf(str(path / "ms"), str(path / "back"))
    original = load_file(str(path / "hf" / "model.safetensors"))
    back = load_file(str(path / "back" / "model.safetensors"))
    if hf.config.tie_word_embeddings:  # the tied head is written once, as the embedding
        original = {k: v for k, v in original.items() if k not in ("lm_head.weight", "embed_out.weight")}
    assert set(back) == set(original)
    for key, value in original.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key
    model_class = CONFIGS[name][1]
    reloaded = model_class.from_pretrained(str(path / "back")).eval()
    ids = torch.from_numpy(np.random.default_rng(2).integers(0, BASE["vocab_size"], (1, 16)))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)


def test_kv_cache_stores_the_query_groups():
    """The decode cache holds num_query_groups heads: GQA shrinks it by heads / groups."""
    config = GPTLocalConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                            num_query_groups=2, max_position_embeddings=64, seq_length=64,
                            position_embedding_type="rope", hidden_act="swiglu", normalization="RMSNorm",
                            add_bias_linear=False)
    cache = GPTLocalForCausalLM(config).kv_cache(2, 64)
    assert tuple(cache.key_caches[0].shape) == (2, 2, 64, 8)  # [batch, groups, length, head_dim]


def _rss_mb():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024


def test_a_long_context_holds_no_square_mask():
    """max_position_embeddings 32,768 (Qwen2's): the causal mask is built per call at the sequence's
    length, so the model holds no [32768, 32768] constant (4 GiB as float32) and its logits equal those
    of the same weights with a 64-position context."""
    values = dict(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, num_query_groups=2,
                  seq_length=16, position_embedding_type="rope", hidden_act="swiglu", normalization="RMSNorm",
                  add_bias_linear=False)
    short = GPTLocalForCausalLM(GPTLocalConfig(max_position_embeddings=64, **values))
    before = _rss_mb()
    long = GPTLocalForCausalLM(GPTLocalConfig(max_position_embeddings=32768, **values))
    ms.load_param_into_net(long, {p.name: ms.Parameter(p.data.copy(), p.name) for p in short.get_parameters()})
    ids = Tensor(np.arange(10, dtype=np.int32).reshape(1, 10) % 64)
    short_logits, long_logits = short(ids).asnumpy(), long(ids).asnumpy()
    assert _rss_mb() - before < 1024  # the square constants alone were 4 GiB + 1 GiB
    np.testing.assert_array_equal(long_logits, short_logits)


def _hf_config(tmp_path, **values):
    path = tmp_path / "hf"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(values))
    return str(path)


@pytest.mark.parametrize("values,pattern", [
    (dict(model_type="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling"),
    (dict(model_type="qwen2", use_sliding_window=True), "sliding-window"),
    (dict(model_type="mixtral"), "model_type 'mixtral'"),
    (dict(model_type="llama", num_local_experts=8), "mixture-of-experts"),
    (dict(model_type="llama", hidden_act="gelu"), "silu"),
    (dict(model_type="llama", head_dim=32), "head_dim"),
    (dict(model_type="llama", attention_bias=True, mlp_bias=False), "mlp_bias"),
    (dict(model_type="gpt_neox", attention_bias=False), "attention_bias"),
])
def test_unsupported_features_are_refused(tmp_path, values, pattern):
    hf = dict(vocab_size=32, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64)
    with pytest.raises(CheckpointError, match=pattern):
        hf_to_ms(_hf_config(tmp_path, **dict(hf, **values)), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("values,pattern", [
    (dict(num_query_groups=3), "not divisible by model_config.num_query_groups"),
    (dict(position_embedding_type="rope", rotary_percent=0.3), "rotary_percent"),
    (dict(position_embedding_type="alibi"), "position_embedding_type"),
    (dict(normalization="ScaleNorm"), "normalization"),
    (dict(gated_linear_unit=True), "gated_linear_unit"),
    (dict(hidden_act="silu"), "gated_linear_unit: True"),
    (dict(rotary_base=500000.0), "position_embedding_type: rope"),
])
def test_impossible_combinations_are_refused(values, pattern):
    tiny = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                max_position_embeddings=64, seq_length=64)
    with pytest.raises(ConfigError, match=pattern):
        GPTLocalConfig(**tiny, **values)


def test_llama_style_yaml_trains_on_cpu_and_exports_to_transformers(corpus, tmp_path):
    """model_configs/pretrain_llama_style_tiny_cpu.yaml (shrunk to the tiny sizes, GQA/SwiGLU/RMSNorm/rope/untied
    kept) trains through `gptlocal run`; its model directory exports with `convert ms2hf` to a LlamaForCausalLM
    whose logits equal ours."""
    from conftest import run_launcher, step_losses, tiny_yaml
    from mindformers_gptlocal import yaml_io
    steps = 12
    yaml_path = tiny_yaml(tmp_path, "pretrain_llama_style_tiny_cpu.yaml", corpus=corpus,
                          train_dataset__data_loader__num_samples=steps * 4, lr_schedule__learning_rate=3e-3)
    config = yaml_io.load_yaml(yaml_path)
    for callback in config["callbacks"]:
        if callback["type"] == "GPTLocalThroughputMonitor":
            callback["per_print_times"] = 1
    yaml_io.dump_yaml(config, yaml_path)
    code, out = run_launcher(["--config", yaml_path], cwd=str(tmp_path))
    assert code == 0, out[-3000:]
    losses = step_losses(out)
    assert len(losses) == steps and sum(losses[-3:]) / 3 < losses[0] - 0.3, losses
    model_dir = tmp_path / "output" / "model"
    saved = json.loads((model_dir / "config.json").read_text())
    assert (saved["num_query_groups"], saved["normalization"], saved["position_embedding_type"]) == (2, "RMSNorm", "rope")
    ms_to_hf(str(model_dir), str(tmp_path / "hf"))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert (hf.config.num_key_value_heads, hf.config.tie_word_embeddings) == (2, False)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ours = GPTLocalForCausalLM.from_pretrained(str(model_dir))
    ours.set_train(False)
    ids = np.random.default_rng(3).integers(0, saved["vocab_size"], (2, 20))
    with torch.no_grad():
        reference = hf(torch.from_numpy(ids)).logits.numpy()
    assert np.abs(ours(Tensor(ids, ms.int32)).asnumpy() - reference).max() <= 1e-4


def test_cli_convert_picks_the_family(converted, capsys):
    """`gptlocal convert` reads the family from config.json (hf2ms) and from the layer options (ms2hf)."""
    from mindformers_gptlocal.cli.main import main
    name, hf, _, path = converted
    assert main(["convert", "hf2ms", "--hf-dir", str(path / "hf"), "--out", str(path / "cli_ms")]) == 0
    assert main(["convert", "ms2hf", "--ms-dir", str(path / "cli_ms"), "--out", str(path / "cli_hf")]) == 0
    assert (path / "cli_ms" / "model.safetensors").read_bytes() == (path / "ms" / "model.safetensors").read_bytes()
    exported = json.loads((path / "cli_hf" / "config.json").read_text())
    assert exported["architectures"] == [CONFIGS[name][1].__name__]
    assert "wrote" in capsys.readouterr().out


def test_transformer_config_reports_the_layer_options():
    from mindformers_gptlocal.mf.transformer_config import to_transformer_config
    config = GPTLocalConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=8,
                            num_query_groups=2, max_position_embeddings=64, seq_length=64,
                            position_embedding_type="rope", rotary_percent=0.5, rotary_base=500000.0,
                            hidden_act="swiglu", normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True,
                            untie_embeddings_and_output_weights=True)
    t = to_transformer_config(config)
    assert (t.position_embedding_type, t.partial_rotary_factor, t.rotary_base) == ("rope", 0.5, 500000.0)
    assert (t.num_query_groups, t.gated_linear_unit, t.hidden_act, t.normalization) == (2, True, "silu", "RMSNorm")
    assert (t.add_bias_linear, t.add_qkv_bias, t.untie_embeddings_and_output_weights) == (False, True, True)
