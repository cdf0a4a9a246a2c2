"""The decode step's layer kernel (``kernels/cells/decode_layer.py``, ``cpu_decode_layer.cc``; ``GPTLocalBlock`` runs it in
its one-token KV-cache graphs of the compiled runner, ``cpu_kernels: {runner: plain}`` here) against the plain decode
graph of the same weights (``cpu_kernels: {decode_layer: plain}``): the logits of every step of a greedy generation of
24 tokens within 1e-5, one-token steps (``ModelRunner.decode``), then the kernel's unrolled greedy graph
(``decode_greedy``, generate's greedy path; ``GREEDY_UNROLLED`` steps unrolled, generate's own count on the tiny
shape) against the plain one-token steps, batch 3 with ragged prompts (right padding) on every model and batch 1 on
GPT-2's, the caches equal afterwards (and, on the tiny shape, ``generate`` and a
row subset of the cache's slots: serve's smaller batch buckets). The layouts: GPT-2's tiny shape, Llama-style (RMSNorm,
SwiGLU, rope, GQA, no biases, untied head), NeoX-style (parallel residual, partial rotary, erf GeLU); the precisions: an
int8 Qwen2-style model (QKV biases only; ``gptlocal quantize``'s scheme: the int8 decode kernel, exact in int32, against
the plain int8 decode graph), a Llama-style bf16 model built for inference (bfloat16 weights, the bf16-weight decode
kernel against the plain bf16 decode graph, whose Linears run the same bf16 GEMM kernel) and GPT-2's with the emulated
bf16 GEMM. Also: the decode graph really calls the kernel, every layout gets it, and the layers it cannot compute keep
the plain graph."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.abi import precision, table
from mindformers_gptlocal.kernels.cells.decode_layer import CPUDecodeLayer, CPUDecodeLayerBF16, CPUDecodeLayerInt8
from mindformers_gptlocal.model.quantization import QUANTIZATION
from conftest import TINY
from one_step import generate_one_step, unrolled
from references import set_float_weights

LLAMA = dict(normalization="RMSNorm", hidden_act="swiglu", add_bias_linear=False, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True)
SHAPES = {"tiny": {},
          # Llama-style: RMSNorm, SwiGLU, rope, 6 heads over 2 key/value groups, no biases, an untied head
          "llama": dict(LLAMA, hidden_size=48, num_attention_heads=6, num_query_groups=2, intermediate_size=100),
          # NeoX-style: the parallel residual, rope on half of each head's 8 channels, the erf GeLU
          "neox": dict(use_parallel_residual=True, position_embedding_type="rope", rotary_percent=0.5,
                       hidden_act="gelu", hidden_size=40, num_attention_heads=5, intermediate_size=72),
          # Qwen2-style int8: biases on QKV only, 6 heads over 3 groups
          "qwen2-int8": dict(LLAMA, add_qkv_bias=True, hidden_size=48, num_attention_heads=6, num_query_groups=3,
                             intermediate_size=88, quantization=dict(QUANTIZATION),
                             cpu_kernels={"int8_linear": "plain"}),
          # a Llama-style bf16 model for inference (bf16 weights); odd widths
          "bf16": dict(LLAMA, compute_dtype="bfloat16", hidden_size=72, num_attention_heads=3, num_query_groups=1,
                       intermediate_size=200),
          # GPT-2's layout, the emulated bf16 GEMM where this CPU has one
          "bf16-emulated": dict(compute_dtype="bfloat16", cpu_kernels={"linear": "kernel"})}
BF16 = ("bf16", "bf16-emulated")
STEPS = 24
# steps the kernel's greedy graph unrolls in steps_equal (its compile costs about one one-token graph a step): the
# third reads cache rows the two before it wrote in the same graph; generate's own count (8 at 2 layers) runs in
# test_generate_and_a_row_subset_of_the_slots, the plain greedy graph's in test_generation.py
GREEDY_UNROLLED = 3


def pair(changes, inference=False):
    """(model with the kernel, the same weights without it), in inference mode. An int8 model's weights: a float
    model's quantized as ``gptlocal quantize`` does (int8 rows and their scales); ``inference``: built as generate
    builds (a bf16 model's weights then bfloat16)."""
    ms.set_seed(3)
    source = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **dict(changes, quantization=None))))
    weights = {name: param.asnumpy() for name, param in source.parameters_and_names()}
    kernels = changes.get("cpu_kernels", {})
    models = [GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **dict(changes, cpu_kernels=dict(
        kernels, decode_layer=mode, runner="plain")))), inference=inference) for mode in ("kernel", "plain")]
    for model in models:
        set_float_weights(model, weights)
    fast, plain = models
    fast.set_train(False)
    plain.set_train(False)
    return fast, plain


def built(shape):
    """``pair`` of ``SHAPES[shape]``, checked to hold the decode kernel it names (GRAPH mode from here on)."""
    ms.set_context(mode=ms.GRAPH_MODE)
    with pytest.MonkeyPatch.context() as patch:
        if shape == "bf16-emulated":  # every bf16 GEMM of both models (chosen at build) emulated
            patch.setattr(precision, "bf16_native", lambda path: False)
        fast, plain = pair(SHAPES[shape], inference=shape in BF16)
    kind = CPUDecodeLayerBF16 if shape in BF16 else CPUDecodeLayerInt8 if "int8" in shape else CPUDecodeLayer
    assert all(type(layer.decode_kernel) is kind for layer in fast.model.layers)  # noqa: E721
    assert all(layer.decode_kernel is None for layer in plain.model.layers)
    return fast, plain


# "bf16-emulated" changes one thing from "bf16", its GEMMs' precision code (2: emulated) in the same decode kernel:
# test_emulated_bf16_steps checks it at batch 1 (steps and the unrolled greedy graph); the rest runs on the others.
# GPT-2's int8 and an odd shape not here: the node calls the layer code the native runner's tests check for
# every layout and precision (tests/generation/test_native_runner.py); here what the block binds for it (qwen2-int8:
# an int8 model's weights, scales and biases; llama: RMSNorm, rope, the gate; tiny: LayerNorm's and the biases)
@pytest.fixture(scope="module", params=sorted(set(SHAPES) - {"bf16-emulated"}))
def models(request):
    yield built(request.param)
    ms.set_context(mode=ms.PYNATIVE_MODE)


def caches(runner):
    return [c.asnumpy() for c in (*runner.key_caches, *runner.value_caches)]


def close(a, b, what, tolerance=1e-5):
    np.testing.assert_allclose(a, b, rtol=tolerance, atol=tolerance, err_msg=what)


# Rounded GEMM inputs: the kernel's few-row bf16 GEMM (cpu_decoder.cc) sums in another order than the plain graph's
# (oneDNN's or its emulation), its attention than the plain ops, and an activation whose last bit differs can round
# to the neighbouring bfloat16 (2^-8 of that element) before the next bf16 GEMM or quantize one step apart (1/127 of
# its row's largest) before an int8 one: the logits then differ by ~1e-3, the rounding those GEMMs differ by
BF16_TOLERANCE = 3e-3
INT8_TOLERANCE = 5e-3


def tolerance(model):
    if str(model.config.compute_dtype) == "bfloat16":
        return BF16_TOLERANCE
    return INT8_TOLERANCE if model.model.embedding.int8 else 1e-5


BATCH1 = [[5, 17, 42, 7, 99, 3, 11]]
RAGGED = [[5, 17, 42], [8], list(range(100, 121))]  # batch 3, right-padded prompts


def test_every_step_equals_the_plain_decode_graph(models):
    steps_equal(*models, RAGGED)


# batch 1 on GPT-2's float32 layout (every layout at batch 1: the native runner's tests, the same layer code); the
# int8 and bf16 kernels differ only in their GEMMs' weights, whose kernels take any row count (checked above at 3
# rows; bf16-emulated at batch 1 below)
@pytest.mark.parametrize("models", ["tiny"], indirect=True, scope="module")
def test_every_step_at_batch1_equals_the_plain_decode_graph(models):
    steps_equal(*models, BATCH1)


def test_emulated_bf16_steps_equal_the_plain_decode_graph():
    try:
        steps_equal(*built("bf16-emulated"), BATCH1)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def steps_equal(fast, plain, prompts):
    """The kernel's and the plain model's logits at each of STEPS one-token steps and through the unrolled greedy
    graph after them, and their caches, within 1e-5."""
    runners = [m.kv_cache(len(prompts), max(len(p) for p in prompts) + STEPS + 1) for m in (fast, plain)]
    logits = [r.prefill(prompts) for r in runners]
    tol = tolerance(fast)
    close(*logits, "prefill", tol)
    positions = np.array([len(p) for p in prompts])
    for step in range(STEPS):  # one-token steps, both fed the plain path's greedy tokens
        tokens = logits[1].argmax(-1)
        logits = [r.decode(tokens, positions + step) for r in runners]
        assert np.abs(logits[1]).max() > 0.1
        close(*logits, f"decode step {step}", tol)
    for index, (a, b) in enumerate(zip(caches(runners[0]), caches(runners[1]))):
        close(a, b, f"cache tensor {index} after the steps", tol)
    # the kernel's unrolled greedy graph from here on: the tokens and logits of the plain model's one-token steps
    # fed its own picks (the plain greedy graph gives those too, to 1e-5: test_generation.py's
    # test_greedy_steps_on_the_device_have_the_tokens_and_logits_of_one_step_decode_and_transformers[compiled-*];
    # so the plain model compiles no greedy graph here)
    start = positions + STEPS
    tokens = logits[1].argmax(-1)
    with unrolled(runners[0], GREEDY_UNROLLED):
        picked_fast, seen_fast = runners[0].decode_greedy(tokens, start, with_logits=True)
    assert picked_fast.shape == (len(prompts), GREEDY_UNROLLED)
    picked_plain, seen_plain = [], []
    for step in range(GREEDY_UNROLLED):
        seen_plain.append(runners[1].decode(tokens, start + step))
        tokens = seen_plain[-1].argmax(-1)
        picked_plain.append(tokens)
    np.testing.assert_array_equal(picked_fast, np.stack(picked_plain, 1))
    close(seen_fast, np.stack(seen_plain, 1), "greedy graph logits", tol)
    for index, (a, b) in enumerate(zip(caches(runners[0]), caches(runners[1]))):
        close(a, b, f"cache tensor {index} after the greedy graph", tol)


@pytest.mark.parametrize("models", ["tiny"], indirect=True, scope="module")
def test_generate_and_a_row_subset_of_the_slots(models):
    """``generate`` (its greedy graph, generate's own step count) gives the plain tokens (the plain one-token steps:
    ``generate_one_step``); a step over 2 of 3 slots (serve's smaller batch bucket: rows name their slots) writes and
    reads only those slots. On the tiny shape: the way from ``generate`` and the slots to the kernel is the same for
    every weight layout, which the step tests check by value."""
    fast, plain = models
    # 3 rows, the longest prompt 18 (width bucket 32) and a 64-row cache: the runners and the prefill and one-token
    # graphs of test_every_step_equals_the_plain_decode_graph[tiny] (RAGGED), compiled once
    prompts = [[7, 3, 9, 1], list(range(40, 58)), [2, 5]]
    assert fast.kv_cache(3, 38).decode_steps > GREEDY_UNROLLED  # generate unrolls its own count
    assert fast.generate(prompts, max_new_tokens=20, do_sample=False) == \
        generate_one_step(plain, prompts, max_new_tokens=20, do_sample=False)
    runners = [m.kv_cache(3, 40) for m in (fast, plain)]
    # the same stale rows in both (generate's: the kernel's greedy graph also writes the rows of the steps it
    # discards, the plain one-token steps do not), then the subset calls over them
    for stale, cache in zip(caches(runners[0]), (*runners[1].key_caches, *runners[1].value_caches)):
        cache.set_data(Tensor(stale))
    for r in runners:
        r.prefill([[4, 5, 6], [9] * 17, [2, 8]])
    slots, positions = np.array([2, 0]), np.array([[2], [3]])
    for step in range(3):
        got = [r.step([[11 + step], [13 + step]], positions + step, [0, 0], slots) for r in runners]
        close(*got, f"subset step {step}")
    for index, (a, b) in enumerate(zip(caches(runners[0]), caches(runners[1]))):
        close(a, b, f"cache tensor {index} after the subset steps")


def test_the_decode_graph_calls_the_kernel(graph_mode):
    """An argument vector of the wrong length fails the kernel's call: the decode graph fails, the prefill graph
    and a multi-token step over the cache (serve's prefill chunks), which do not run the kernel, do not."""
    fast = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, cpu_kernels={"decode_layer": "kernel", "runner": "plain"})))
    fast.set_train(False)
    for layer in fast.model.layers:
        layer.decode_kernel.config = Tensor(np.ones(2, np.float32))
    runner = fast.kv_cache(1, 30)
    runner.step([[1, 2]], [[0, 1]], [1])
    logits = runner.prefill([[1, 2, 3]])
    with pytest.raises(RuntimeError):
        runner.decode(logits.argmax(-1), np.array([3]))


@pytest.mark.parametrize("changes", [
    dict(cpu_kernels="plain"),
    dict(cpu_kernels={"decode_layer": "plain"}),
    dict(pet_config=dict(pet_type="lora", lora_rank=2, lora_alpha=4, target_modules=".*linear_qkv",
                         freeze_include=["*"], freeze_exclude=["*lora*"])),
    dict(seq_length=48, pet_config=dict(pet_type="ptuning2", pre_seq_len=3, prefix_projection=False)),
    dict(layerdrop=0.1),
    dict(compute_dtype="bfloat16"),  # a training build's bf16 model: float32 weights, the plain graph
], ids=["plain", "decode-plain", "lora", "prefix", "layerdrop", "bf16"])
def test_layers_the_kernel_does_not_compute_keep_the_plain_graph(changes):
    changes = dict(changes, cpu_kernels=dict({"decode_layer": "kernel"}, **changes.get("cpu_kernels", {}))) \
        if changes.get("cpu_kernels") != "plain" else changes
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes)))
    assert all(layer.decode_kernel is None for layer in model.model.layers)


@pytest.mark.parametrize("changes", [
    dict(position_embedding_type="rope"),
    dict(normalization="RMSNorm", hidden_act="swiglu", add_bias_linear=False),
    dict(use_parallel_residual=True),
    dict(hidden_act="gelu"),
    dict(hidden_act="relu", add_bias_linear=False),
    dict(add_bias_linear=False, add_qkv_bias=True),
], ids=["rope", "llama", "parallel-residual", "erf-gelu", "relu-no-bias", "qkv-bias-only"])
def test_every_layout_gets_the_kernel(changes):
    """The layouts the model builds run the decode node (the values: test_every_step_equals_the_plain_decode_graph
    on the llama, neox and qwen2-int8 shapes)."""
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, cpu_kernels={"decode_layer": "kernel"}, **changes)))
    assert all(type(layer.decode_kernel) is CPUDecodeLayer for layer in model.model.layers)  # noqa: E721


SCALES = {f"{name}_scale" for name in ("qkv", "proj", "fc1", "gate", "fc2")}


@pytest.mark.parametrize("changes,absent", [
    ({}, SCALES | {"gate", "gate_bias"}),
    (dict(normalization="RMSNorm", hidden_act="swiglu", add_bias_linear=False),
     SCALES | {"norm1_bias", "norm2_bias", "qkv_bias", "proj_bias", "fc1_bias", "gate_bias", "fc2_bias"}),
    (dict(quantization=dict(QUANTIZATION), add_bias_linear=False, add_qkv_bias=True),
     {"gate", "gate_scale", "gate_bias", "proj_bias", "fc1_bias", "fc2_bias"}),
], ids=["gpt2", "llama", "int8-qkv-bias-only"])
def test_the_node_is_told_which_parameters_are_placeholders(changes, absent):
    """The decode node's ``absent`` option names exactly the DecoderLayer fields the block hands a placeholder (the
    kernel nulls them: cores.h drop_absent), read from the layer table, not from one option per part."""
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, cpu_kernels={"decode_layer": "kernel"}, **changes)),
                                inference=True)
    words = table.DecodeLayerOptions.fields.index(("absent", "int"))
    for layer in model.model.layers:
        assert int(layer.decode_kernel.config.asnumpy()[words]) == table.DecoderLayer.pointer_mask(absent)


@pytest.mark.parametrize("kind", ["float32", "int8", "bf16"])
def test_auto_runs_the_kernel_for_float32_int8_and_bf16_models(kind):
    """cpu_kernels decode_layer: auto (the default) gives float32, int8 and bf16 models (built for inference: bf16
    weights) the kernel (kernels/provider.py DECODE_LAYER_AUTO); plain keeps the plain graph."""
    changes = {"float32": {}, "int8": dict(quantization=dict(QUANTIZATION)), "bf16": dict(compute_dtype="bfloat16")}
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes[kind])), inference=True)
    assert all(layer.decode_kernel is not None for layer in model.model.layers)
    plain = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, cpu_kernels={"decode_layer": "plain"}, **changes[kind])),
                                inference=True)
    assert all(layer.decode_kernel is None for layer in plain.model.layers)
