"""``compute_dtype: bfloat16`` on CPU (``KernelProvider.gemm_dtype``, ``model/config.py`` ``graph_config``): the model
builds and runs with a float32 graph and bf16 GEMMs: logits near the float32 model's (bf16 error) and not equal,
the GEMM kernel's model equal to the plain path's (``BF16MatMul``) by value in compiled graphs, forward and every
gradient; MindFormers-style dtype keys (param_init_type float32 or bfloat16, norms and softmax float32 or bfloat16)
build, keep float32 Parameters and say what runs in float32; the config keeps the YAML's dtypes (config.json,
from_pretrained overrides); greedy generate; a LoRA model steps."""
import json

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, GPTLocalTrainOneStepCell
from mindformers_gptlocal.model import config as config_module
from mindformers_gptlocal.kernels.cells.linear import BF16MatMul
from conftest import TINY
from references import LossOf, assert_errors_of_one_size, copy_weights

BF16 = dict(TINY, compute_dtype="bfloat16")


def _ids(batch, seq, seed=0):
    return Tensor(np.random.default_rng(seed).integers(0, TINY["vocab_size"], (batch, seq)), ms.int32)


def _pair(reference_kw, other_kw, seed=0):
    ms.set_seed(seed)
    reference = GPTLocalForCausalLM(GPTLocalConfig(**reference_kw))
    other = GPTLocalForCausalLM(GPTLocalConfig(**other_kw))
    copy_weights(reference, other)
    return reference, other


def _sharpened(model):
    """Weights scaled up so the logits spread (the tiny random model's are ~0.02): rounding shows at bf16's size."""
    for name, param in model.parameters_and_names():
        if "norm" not in name:
            param.set_data(Tensor(param.asnumpy() * 8.0))


def test_bf16_logits_near_float32_not_equal(graph_mode):
    fp32, bf16 = _pair(TINY, BF16)
    for model in (fp32, bf16):
        _sharpened(model)
        model.set_train(False)
    layer = bf16.model.layers[0]
    assert layer.attention.linear_qkv.gemm_rule == bf16.head_gemm_rule == (0, 0)  # every graph: the bf16 kernel
    assert bf16.head_gemm.precision == "bfloat16" and fp32.head_gemm.precision == "float32"
    assert layer.mlp.linear_fc1.weight.dtype == ms.float32 and bf16.compute_dtype == ms.float32
    # the float32 graph keeps the other CPU kernels: fused attention, LayerNorm, bias + GeLU
    assert type(layer.attention.core).__name__ == "FusedCPUAttention"
    assert type(layer.input_layernorm).__name__ == "KernelLayerNorm"
    assert type(layer.mlp).__name__ == "BiasGeLUFeedForward"
    assert bf16.config.compute_dtype == "bfloat16"  # the model keeps the YAML's dtypes
    for seq in (1, 17):  # a one-row graph (decode-sized) and a prefill
        batch = _ids(2, seq)
        want, got = fp32(batch).asnumpy(), bf16(batch).asnumpy()
        scale = float(np.abs(want).max())
        difference = np.abs(got - want)
        assert scale > 1.0 and difference.max() > 1e-4 * scale, (seq, difference.max(), scale)
        assert difference.max() < 0.03 * scale, (seq, difference.max(), scale)


def test_kernel_equals_plain_bf16_path_forward_and_gradients(graph_mode):
    """The bf16 GEMM kernel's model and cpu_kernels {linear: plain}'s (BF16MatMul in every Linear and the head): the
    same training loss and gradients of every weight up to bf16's rounding, which both carry, measured against the
    float32 model of the same weights (its own error 2^-16 of theirs): the kernel's within twice the plain path's
    either way, in norm (``assert_errors_of_one_size``). Both round the same float32 GEMM inputs to bf16, but
    their float32 sums run in different orders (oneDNN's native bf16 GEMM from AVX-512 on, BF16MatMul's float32
    MatMul), and a last-bit difference that crosses a bf16 rounding boundary downstream becomes 2^-9 of the value:
    an elementwise bound on the difference would be bf16's own, or tuned on one CPU (1e-4 of the largest failed on
    AMX)."""
    kernel, plain = _pair(BF16, dict(BF16, cpu_kernels={"linear": "plain"}))
    assert plain.head_gemm is None and isinstance(plain.head_matmul, BF16MatMul)
    assert isinstance(plain.model.layers[1].mlp.linear_fc2.matmul, BF16MatMul)
    _sharpened(kernel)
    copy_weights(kernel, plain)
    fp32 = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    copy_weights(kernel, fp32)
    tokens = _ids(2, 18, seed=1)
    results = []
    for model in (kernel, plain, fp32):
        model.set_train(True)
        weights = model.trainable_params()
        loss, grads = ms.value_and_grad(LossOf(model), None, weights)(tokens)
        results.append((float(loss), {w.name: g.asnumpy() for w, g in zip(weights, grads)}))
    (loss_k, grads_k), (loss_p, grads_p), (_, grads_32) = results
    assert np.isfinite(loss_k) and abs(loss_k - loss_p) <= 1e-5 * abs(loss_p), (loss_k, loss_p)
    assert grads_k.keys() == grads_p.keys() == grads_32.keys()
    longest = max(TINY["vocab_size"], 4 * TINY["hidden_size"], 2 * 18)  # the longest float32 sum of the step
    bf16_errors = [assert_errors_of_one_size(grad, grads_p[name], grads_32[name], name, longest)
                   for name, grad in grads_k.items()]
    assert min(bf16_errors) > 0  # the plain path does round to bf16 (every gradient carries it)


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_mindformers_style_dtype_keys_build_on_cpu(graph_mode, capsys, monkeypatch, params_dtype):
    """MindFormers' YAML keys (param_init_type, compute_dtype, layernorm_compute_dtype, softmax_compute_dtype):
    float32 Parameters whatever param_init_type says, one line for each key that runs in float32 on CPU, the
    config as written."""
    monkeypatch.setattr(config_module, "_NOTED", set())
    for norms in ("float32", "bfloat16"):
        config = GPTLocalConfig(**TINY, compute_dtype="bfloat16", param_init_type=params_dtype,
                                layernorm_compute_dtype=norms, softmax_compute_dtype=norms)
        model = GPTLocalForCausalLM(config)
        model.set_train(False)
        assert {p.dtype for p in model.get_parameters()} == {ms.float32}
        assert (config.params_dtype, config.layernorm_compute_dtype) == (params_dtype, norms)
        logits = model(_ids(1, 5)).asnumpy()
        assert logits.dtype == np.float32 and np.isfinite(logits).all()
    err = capsys.readouterr().err
    assert err.count("params_dtype (param_init_type) bfloat16 on CPU") == (params_dtype == "bfloat16")
    assert err.count("layernorm_compute_dtype bfloat16 on CPU") == 1 and err.count("softmax_compute_dtype") == 1
    assert "Unsupported data type" not in err


def test_model_directory_keeps_bf16_and_overrides(tmp_path, graph_mode):
    """save_pretrained writes the config's compute_dtype (bfloat16) and float32 weights; from_pretrained reads it
    back, and compute_dtype="bfloat16" turns a float32 directory's model into the bf16 one."""
    ms.set_seed(0)
    GPTLocalForCausalLM(GPTLocalConfig(**BF16)).save_pretrained(str(tmp_path / "bf16"))
    with open(tmp_path / "bf16" / "config.json", encoding="utf-8") as handle:
        assert json.load(handle)["compute_dtype"] == "bfloat16"
    loaded = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "bf16"))
    assert loaded.head_gemm.precision == "bfloat16"
    loaded.save_pretrained(str(tmp_path / "fp32"))
    fp32 = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "fp32"), compute_dtype="float32")
    assert fp32.head_gemm.precision == "float32"
    again = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "fp32"), compute_dtype="bfloat16")
    assert again.head_gemm.precision == "bfloat16"
    for model in (loaded, again):
        model.set_train(False)
    np.testing.assert_array_equal(loaded(_ids(1, 7)).asnumpy(), again(_ids(1, 7)).asnumpy())


def test_greedy_generate_bf16(graph_mode):
    """Greedy generate on a bf16 model runs its compiled prefill / decode graphs: each new token is the argmax of
    the bf16 model's own logits over the sequence so far (not the float32 model's)."""
    ms.set_seed(3)
    model = GPTLocalForCausalLM(GPTLocalConfig(**BF16))
    _sharpened(model)
    model.set_train(False)
    prompt = [5, 17, 301, 2, 9]
    out = model.generate([prompt], max_new_tokens=6, do_sample=False)[0]
    assert out[:5] == prompt and len(out) == 11
    # one causal forward of the first 10 tokens: its logits at position end - 1 are those over out[:end]
    logits = model(Tensor(np.array([out[:10]], np.int32))).asnumpy()[0]
    for end in range(5, 11):
        assert out[end] == int(np.argmax(logits[end - 1])), end


def test_lora_bf16_builds_and_steps(mcore_context):
    """A LoRA model with compute_dtype bfloat16: its base Linears run the bf16 GEMM, only the adapters train, and
    steps lower the loss."""
    config = GPTLocalConfig(**BF16, pet_config={"pet_type": "lora", "lora_rank": 4, "lora_alpha": 8,
                                                "target_modules": ".*linear_qkv|.*linear_fc1",
                                                "freeze_include": ["*"], "freeze_exclude": ["*lora*"]})
    ms.set_seed(0)
    model = GPTLocalForCausalLM(config)
    qkv = model.model.layers[0].attention.linear_qkv
    assert type(qkv).__name__ == "LoRALinear" and qkv.gemm.precision == "bfloat16"
    trainable = [p.name for p in model.trainable_params()]
    assert trainable and all("lora" in name for name in trainable), trainable
    cell = GPTLocalTrainOneStepCell(model, nn.AdamWeightDecay(model.trainable_params(), learning_rate=1e-2),
                                    scale_sense=1.0)
    cell.set_train(True)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 512, (2, 33)).astype(np.int32)
    batch = (Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((2, 32), np.int32)),
             Tensor(np.tile(np.arange(32, dtype=np.int32), (2, 1))))
    losses = [float(cell(*batch)[0]) for _ in range(6)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.parametrize("pet", [
    dict(pet_type="adapter", bottleneck_size=16, non_linearity="gelu", freeze_include=["*"],
         freeze_exclude=["*adapter*"]),
    dict(pet_type="prefixtuning", prefix_token_num=4, freeze_include=["*"], freeze_exclude=["*prefix*"])])
def test_adapters_and_prefix_build_with_bf16(graph_mode, pet):
    """Bottleneck adapters and prefix tuning on a bf16 model build on the float32 graph (their Cells from the
    graph's dtypes) and give finite logits; the base Linears keep the bf16 GEMM."""
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(BF16, seq_length=32), pet_config=pet))
    model.set_train(False)
    assert model.model.layers[0].mlp.linear_fc1.gemm.precision == "bfloat16"
    logits = model(_ids(1, 8)).asnumpy()
    assert logits.shape == (1, 8, TINY["vocab_size"]) and np.isfinite(logits).all()


@pytest.mark.parametrize("params_dtype", ["float32", "bfloat16"])
def test_mindformers_yaml_builds_mindformers_class(tmp_path, graph_mode, params_dtype):
    """A MindFormers-style YAML model_config (param_init_type, compute_dtype bfloat16, layernorm and softmax
    float32), read as MindFormers reads it (MindFormerConfig) into the classes on MindFormers' bases
    (``mf/model.py``): builds on CPU with float32 Parameters and the bf16 GEMM kernel, finite logits; its
    config keeps the YAML's dtypes."""
    from mindformers.tools.register import MindFormerConfig
    from mindformers_gptlocal import yaml_io
    from mindformers_gptlocal.mf import model as mf_model
    from mindformers_gptlocal.preflight.checks import model_config_of
    keys = dict(TINY, type="GPTLocalConfig", param_init_type=params_dtype, compute_dtype="bfloat16",
                layernorm_compute_dtype="float32", softmax_compute_dtype="float32")
    path = yaml_io.dump_yaml({"model": {"model_config": keys}}, str(tmp_path / "model.yaml"))
    values = model_config_of(MindFormerConfig(path)).to_dict()
    config = mf_model.GPTLocalConfig(**{k: v for k, v in values.items() if k in keys or k.endswith("dtype")})
    assert (config.params_dtype, config.compute_dtype) == (params_dtype, "bfloat16")
    model = mf_model.GPTLocalForCausalLM(config)
    model.set_train(False)
    assert {p.dtype for p in model.get_parameters()} == {ms.float32}
    assert model.head_gemm.precision == "bfloat16" and model.config.compute_dtype == "bfloat16"
    logits = model(_ids(1, 6)).asnumpy()
    assert np.isfinite(logits).all()
