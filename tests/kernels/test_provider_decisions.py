"""The provider decides each op's implementation, eligibility included (issue 50): the questions a layer, the train step
or the runner asks it once at build (kernels/provider.py ``decode_layer_for``, ``fused_attention``, ``bias_gelu`` /
``gemm_epilogue``, ``epilogue_residual``, ``flash_attention``, ``lora_dropout``, ``adamw_update``, ``grad_clip``,
``fresh_prefill``, ``plain_matmul``; and the runtime's ``runner_kind`` and ``greedy_steps`` over it), each answer
against the rule it states, one fact changed at a time. The values of the Cells they give: the kernels' own tests."""
import warnings

import mindspore as ms
from mindspore import ops

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.kernels import provider
from mindformers_gptlocal.kernels.cells.decode_layer import CPUDecodeLayer, CPUDecodeLayerInt8
from mindformers_gptlocal.kernels.cells.linear import BF16MatMul
from mindformers_gptlocal.kernels.provider import DecodeLayerFacts, KernelProvider
from mindformers_gptlocal.model.dropout import CounterDropout
from mindformers_gptlocal.runtime.buckets import greedy_steps
from mindformers_gptlocal.runtime.runner import runner_kind
from conftest import TINY

CPU = dict(device_target="CPU")


def _gpt2_facts(**changes):
    """The facts of a tiny GPT-2 layer built for the decode kernel (float32 Linears and LayerNorms)."""
    facts = DecodeLayerFacts(epsilon=1e-5, scale=0.25, form="tanh", compute_dtype=ms.float32,
                             arch=GPTLocalConfig(**TINY).arch, linears="float32", norm="LayerNorm",
                             norm_weights=ms.float32, norm_dtype=ms.float32, softmax_dtype=ms.float32, prefix=False,
                             adapters=False, layerdrop=False)
    return facts._replace(**changes)


def test_the_decode_layer_only_for_the_layer_it_computes(library):  # pylint: disable=unused-argument
    kernels = KernelProvider(**CPU)
    assert type(kernels.decode_layer_for(_gpt2_facts())) is CPUDecodeLayer  # noqa: E721
    assert type(kernels.decode_layer_for(_gpt2_facts(linears="int8"))) is CPUDecodeLayerInt8  # noqa: E721
    rope = GPTLocalConfig(**dict(TINY, position_embedding_type="rope")).arch
    neox = GPTLocalConfig(**dict(TINY, use_parallel_residual=True)).arch
    llama = GPTLocalConfig(**dict(TINY, normalization="RMSNorm", hidden_act="swiglu", add_bias_linear=False)).arch
    unbiased = GPTLocalConfig(**dict(TINY, add_bias_linear=False)).arch
    for change in (dict(arch=rope), dict(arch=neox), dict(arch=llama, form="swiglu", norm="RMSNorm"),
                   dict(arch=unbiased, form="relu"), dict(form="erf"), dict(form="quick")):  # every layout
        assert type(kernels.decode_layer_for(_gpt2_facts(**change))) is CPUDecodeLayer, change  # noqa: E721
    for change in (dict(form=None), dict(form="mish"), dict(linears=None), dict(linears="float16"), dict(norm=None),
                   dict(norm_weights=None), dict(norm_dtype=ms.float16), dict(softmax_dtype=ms.float16),
                   dict(prefix=True), dict(adapters=True), dict(layerdrop=True)):
        assert kernels.decode_layer_for(_gpt2_facts(**change)) is None, change
    # bf16 weights only where the provider holds them so (an inference build of a bf16 model); a float32 layer of
    # such a build does not fit either
    bf16 = KernelProvider(compute_dtype="bfloat16", inference=True, **CPU)
    assert bf16.decode_layer_for(_gpt2_facts(linears="bfloat16")) is not None
    assert bf16.decode_layer_for(_gpt2_facts(linears="float32")) is None
    assert kernels.decode_layer_for(_gpt2_facts(linears="bfloat16")) is None
    assert KernelProvider({"decode_layer": "plain"}, **CPU).decode_layer_for(_gpt2_facts()) is None


def test_fused_attention_rules(library):  # pylint: disable=unused-argument
    kernels = KernelProvider(**CPU)
    assert kernels.fused_attention(0.25, ms.float32, ms.float32) is not None
    dropout = CounterDropout(0.1, 1)
    assert kernels.fused_attention(0.25, ms.float32, ms.float32, 0.1, dropout, counter_dropout=True) is not None
    assert kernels.fused_attention(0.25, ms.float32, ms.float32, 0.1, None, counter_dropout=False) is None
    assert kernels.fused_attention(0.25, ms.float32, ms.float32, 1.0, dropout) is None
    assert KernelProvider({"attention": "plain"}, **CPU).fused_attention(0.25, ms.float32, ms.float32) is None
    assert KernelProvider(parallel=True, **CPU).fused_attention(0.25, ms.float32, ms.float32) is None
    provider._TOLD.discard(next((m for m in provider._TOLD if "prefix tuning" in m), None))  # said once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.fused_attention(0.25, ms.float32, ms.float32, prefix=True) is None
        assert kernels.fused_attention(0.25, ms.float32, ms.float32, prefix=True) is None
    assert len([w for w in caught if "prefix tuning uses the plain" in str(w.message)]) == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert KernelProvider("plain", **CPU).fused_attention(0.25, ms.float32, ms.float32, prefix=True) is None
    assert not caught  # no kernel chosen: nothing to say


def test_mlp_kernels_by_bias_form_and_linear_class(library):  # pylint: disable=unused-argument
    kernels = KernelProvider({"gemm_epilogue": "kernel"}, **CPU)
    assert kernels.bias_gelu("tanh", ms.float32) is not None
    assert kernels.bias_gelu("tanh", ms.float32, bias=False) is None
    assert kernels.bias_gelu(None, ms.float32) is None  # the erf GeLU, ReLU: no kernel form
    assert kernels.gemm_epilogue("quick", ms.float32) is not None
    for change in (dict(bias=False), dict(plain_linears=False)):
        assert kernels.gemm_epilogue("quick", ms.float32, **change) is None, change
    assert kernels.gemm_epilogue(None, ms.float32) is None
    assert KernelProvider(**CPU).gemm_epilogue("tanh", ms.float32) is None  # auto: off


def test_the_residual_goes_into_the_epilogue_only_with_nothing_between():
    kernels = KernelProvider(**CPU)
    epilogue = object()
    assert kernels.epilogue_residual(epilogue)
    assert not kernels.epilogue_residual(None)
    for change in (dict(hidden_dropout=0.1), dict(adapter=True), dict(layerdrop=True), dict(parallel_residual=True)):
        assert not kernels.epilogue_residual(epilogue, **change), change


def test_flash_attention_on_ascend_when_asked_without_a_prefix():
    ascend = KernelProvider(device_target="Ascend")
    assert ascend.flash_attention(True)
    assert not ascend.flash_attention(False) and not ascend.flash_attention(True, prefix=True)
    assert not KernelProvider(**CPU).flash_attention(True)


def test_lora_dropout_kernel_not_in_a_parallel_build(library):  # pylint: disable=unused-argument
    plain = CounterDropout(0.1, 5000)
    assert KernelProvider(**CPU).lora_dropout(plain, ms.float32) is not None
    assert KernelProvider(parallel=True, **CPU).lora_dropout(plain, ms.float32) is None
    assert KernelProvider({"lora_dropout": "plain"}, **CPU).lora_dropout(plain, ms.float32) is None


def test_train_step_choices(library):  # pylint: disable=unused-argument
    kernels = KernelProvider(**CPU)
    assert not isinstance(kernels.adamw_update([ms.float32]), ops.AdamWeightDecay)  # the kernel
    assert isinstance(kernels.adamw_update([ms.float32, ms.float16]), ops.AdamWeightDecay)
    assert isinstance(KernelProvider("plain", **CPU).adamw_update([ms.float32]), ops.AdamWeightDecay)
    assert kernels.grad_clip(None)  # the composed two-stage norm
    assert KernelProvider({"composed_ops": "plain"}, **CPU).grad_clip(object())  # the square-sum kernel
    assert not KernelProvider("plain", **CPU).grad_clip(None)  # MindFormers' ClipGradNorm


def test_runner_graphs():
    kernels = KernelProvider(**CPU)
    assert kernels.fresh_prefill(True) and not kernels.fresh_prefill(False)
    assert not kernels.fresh_prefill(True, prefix=True)
    assert [greedy_steps(layers) for layers in (0, 1, 4, 5, 12, 32, 33)] == [8, 8, 8, 6, 2, 1, 1]


def test_the_native_runner_where_the_cpp_layer_computes_every_layer(library):  # pylint: disable=unused-argument
    """``runtime/runner.py`` ``runner_kind`` over the provider: native on CPU, one rank, float32 compute, every layer
    one the C++ layer computes (LayerDrop too: an identity in inference), its Linears holding the weights the provider
    builds; compiled otherwise."""
    kernels = KernelProvider(**CPU)
    layers = (_gpt2_facts(), _gpt2_facts(layerdrop=True))
    assert runner_kind(kernels, layers) == "native" and runner_kind(kernels, (_gpt2_facts(linears="int8"),)) == "native"
    for change in (dict(linears=None), dict(prefix=True), dict(adapters=True), dict(norm=None),
                   dict(compute_dtype=ms.float16), dict(linears="bfloat16")):
        assert runner_kind(kernels, (_gpt2_facts(), _gpt2_facts(**change))) == "compiled", change
    assert runner_kind(kernels, ()) == "compiled"
    for other in (KernelProvider({"runner": "plain"}, **CPU), KernelProvider("plain", **CPU),
                  KernelProvider(parallel=True, **CPU), KernelProvider(device_target="GPU")):
        assert runner_kind(other, layers) == "compiled"
    bf16 = KernelProvider(compute_dtype="bfloat16", inference=True, **CPU)  # bf16 weights: those only
    assert runner_kind(bf16, (_gpt2_facts(linears="bfloat16"),)) == "native"
    assert runner_kind(bf16, (_gpt2_facts(),)) == "compiled"
    training = KernelProvider(compute_dtype="bfloat16", **CPU)  # float32 weights rounded at each GEMM
    assert runner_kind(training, (_gpt2_facts(compute_dtype=ms.bfloat16),)) == "native"


def test_the_plain_gemm():
    assert isinstance(KernelProvider(compute_dtype="bfloat16", **CPU).plain_matmul(), BF16MatMul)
    assert isinstance(KernelProvider(**CPU).plain_matmul(), ops.MatMul)
    assert isinstance(KernelProvider(compute_dtype="bfloat16", device_target="GPU").plain_matmul(), ops.MatMul)
