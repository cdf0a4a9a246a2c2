"""The native runner (``runtime/native.py``: the forward over the KV cache as one ``kernels/csrc/cpu_decoder.cc`` call a
step) against the compiled plain runner of the same weights (``cpu_kernels: plain``: MindSpore's ops in compiled
graphs, the reference), by value, for every layout the model builds and each precision:

- layouts: GPT-2 (LayerNorm, biases, learned positions, tied head), an odd one (hidden 40, 5 heads, one key/value
  group, quick GeLU), Llama-style (RMSNorm, SwiGLU, rope, 6 heads over 2 groups, no biases, untied head), NeoX-style
  (parallel residual, rope on half of each head, erf GeLU, untied), Qwen2-style (biases on QKV only, 6 heads over 3
  groups), ReLU without biases;
- precisions: float32 (every layout), int8 (``gptlocal quantize``'s scheme: GPT-2's and Llama's layout; the plain
  int8 scheme in MindSpore ops is the reference, exact in int32 both) and bf16 weights (an inference build:
  GPT-2's and Llama's layout; the reference the plain bf16 GEMMs, ``BF16MatMul``, on the float32 weights): within the
  rounding those GEMMs differ by (``BF16_TOLERANCE``, ``INT8_TOLERANCE``);

each: a ragged prefill (prompts of 3, 1 and 21 tokens), then 33 one-token steps fed the reference's greedy tokens
with the logits of every step within 1e-5, the caches equal, and the runner's greedy steps
(the argmax in the library) from the same prefill picking the reference's 33 tokens. Then the server's calls on GPT-2
and Llama layouts (a batch bucket's rows naming their slots, prefill chunks attending to the rows before them,
refills whose columns clamp at the cache's last row, pad rows repeating a row), a prefill longer than one call's rows
(run as column chunks), ``generate`` (greedy and seeded sampling), and which runner the provider picks."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
from mindformers_gptlocal.model.quantization import QUANTIZATION
from mindformers_gptlocal.runtime.native import NativeRunner
from mindformers_gptlocal.runtime.runner import ModelRunner
from conftest import TINY
from one_step import generate_one_step
from references import set_float_weights

LLAMA = dict(normalization="RMSNorm", hidden_act="swiglu", add_bias_linear=False, position_embedding_type="rope",
             untie_embeddings_and_output_weights=True)
LAYOUTS = {
    "gpt2": {},
    "odd": dict(hidden_size=40, num_attention_heads=5, num_query_groups=1, hidden_act="quick_gelu",
                intermediate_size=72),
    "llama": dict(LLAMA, hidden_size=48, num_attention_heads=6, num_query_groups=2, intermediate_size=100),
    "neox": dict(use_parallel_residual=True, position_embedding_type="rope", rotary_percent=0.5, hidden_act="gelu",
                 hidden_size=40, num_attention_heads=5, intermediate_size=72, untie_embeddings_and_output_weights=True),
    "qwen2": dict(LLAMA, add_qkv_bias=True, hidden_size=48, num_attention_heads=6, num_query_groups=3,
                  intermediate_size=88),
    "relu": dict(hidden_act="relu", add_bias_linear=False, intermediate_size=72),
}
PRECISIONS = {"float32": {}, "int8": dict(quantization=dict(QUANTIZATION)), "bf16": dict(compute_dtype="bfloat16")}
CASES = [(layout, "float32") for layout in LAYOUTS] + [(layout, precision) for precision in ("int8", "bf16")
                                                       for layout in ("gpt2", "llama")]
STEPS = 33
RAGGED = [[5, 17, 42], [8], list(range(100, 121))]
# Rounded GEMM inputs: an activation whose last bit differs between two summation orders (the native loops against
# MindSpore's ops) can round to the neighbouring bfloat16 (2^-8 of that element) before a bf16 GEMM, or quantize one
# step apart (1/127 of its row's largest) before an int8 one: the logits then differ by ~1e-3, the rounding those
# GEMMs already differ by. Everything else within 1e-5.
BF16_TOLERANCE = 3e-3
INT8_TOLERANCE = 5e-3


BUILT = {}  # (layout name, precision) -> models(): built once per process, shared by the tests of one layout


def models(layout, precision="float32", seed=3):
    """(the native-runner model, the compiled plain one) on the same weights, in inference mode (``layout``: a name of
    ``LAYOUTS`` or the config changes themselves): a float model's made
    from ``seed``, quantized as ``gptlocal quantize`` does for int8, the native one built for inference (bf16: its
    weights then bfloat16). A named layout's pair is built once (``BUILT``) and shared by every test of it: each
    test's runners are its own (each a batch size and cache length of the models' runner pools, or its own
    ``NativeRunner``), only the weights and the plain model's compiled graphs of a shape are shared."""
    key = (layout, precision, seed) if isinstance(layout, str) else None
    if key is not None and key in BUILT:
        return BUILT[key]
    built = _build(layout, precision, seed)
    if key is not None:
        BUILT[key] = built
    return built


def _build(layout, precision, seed):
    changes = dict(TINY, **(LAYOUTS[layout] if isinstance(layout, str) else layout))
    ms.set_seed(seed)
    source = GPTLocalForCausalLM(GPTLocalConfig(**changes))
    weights = {name: param.asnumpy() for name, param in source.parameters_and_names()}
    changes.update(PRECISIONS[precision])
    built = [GPTLocalForCausalLM(GPTLocalConfig(**changes), inference=True),
             GPTLocalForCausalLM(GPTLocalConfig(**dict(changes, cpu_kernels="plain")), inference=True)]
    for model in built:
        set_float_weights(model, weights)
        model.set_train(False)
    if precision == "bf16":  # the native build holds the token table as bfloat16 (its lookup reads rounded rows)
        table = built[1].model.embedding.word_embeddings
        table.set_data(Tensor(table.asnumpy()).astype(ms.bfloat16).astype(ms.float32))
    return built


def tolerance(precision):
    return {"bf16": BF16_TOLERANCE, "int8": INT8_TOLERANCE}.get(precision, 1e-5)


def close(a, b, what, tol=1e-5):
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol, err_msg=what)


@pytest.fixture(scope="module", params=[f"{layout}-{precision}" for layout, precision in CASES])
def pair(request):
    """(native, plain, precision) of one case, GRAPH mode while the case's tests run (the reference compiled)."""
    before = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    layout, precision = request.param.rsplit("-", 1)
    native, plain = models(layout, precision)
    yield native, plain, precision
    ms.set_context(mode=before)


def test_every_step_equals_the_compiled_plain_runner(pair):
    native, plain, precision = pair
    tol = tolerance(precision)
    length = max(len(p) for p in RAGGED) + STEPS + 1
    runners = [m.kv_cache(len(RAGGED), length) for m in (native, plain)]
    assert type(runners[0]) is NativeRunner and type(runners[1]) is ModelRunner  # noqa: E721
    logits = [r.prefill(RAGGED) for r in runners]
    close(*logits, "prefill", tol)
    first = logits[1].argmax(-1)
    positions = np.array([len(p) for p in RAGGED])
    chain = []  # the reference's greedy tokens after each step
    for step in range(STEPS):
        tokens = logits[1].argmax(-1) if step else first
        logits = [r.decode(tokens, positions + step) for r in runners]
        assert np.abs(logits[1]).max() > 0.1
        close(*logits, f"decode step {step}", tol)
        chain.append(logits[1].argmax(-1))
    keys = runners[0].keys
    for layer, cache in enumerate(runners[1].key_caches):
        close(keys[layer], cache.asnumpy(), f"key cache {layer}", tol)
    for layer, cache in enumerate(runners[1].value_caches):
        close(runners[0].values[layer], cache.asnumpy(), f"value cache {layer}", tol)
    # greedy steps in the library (argmax there, no logits) from the same prefill: the reference's tokens
    runners[0].prefill(RAGGED)
    tokens, picked = first, []
    for start in range(0, STEPS, runners[0].decode_steps):
        picks = runners[0].decode_greedy(tokens, positions + start)
        picked.append(picks)
        tokens = picks[:, -1]
    np.testing.assert_array_equal(np.concatenate(picked, 1)[:, :STEPS], np.stack(chain, 1))


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_one_sequence_steps_equal_the_compiled_plain_runner(precision, graph_mode):  # pylint: disable=unused-argument
    """Batch 1, where each decode step's GEMMs are GEMVs (four weight rows at a time, cpu_decoder.cc gemv_tile4), on
    sizes that leave every remainder: hidden 36 and intermediate 75 (K not a multiple of 8), vocab 509 and
    intermediate 75 (N not a multiple of 4); float32 and bf16 weights; every step's logits."""
    native, plain = models(dict(hidden_size=36, num_attention_heads=4, intermediate_size=75, vocab_size=509),
                           precision)
    runners = [m.kv_cache(1, 32) for m in (native, plain)]
    assert type(runners[0]) is NativeRunner  # noqa: E721
    logits = [r.prefill([[5, 17, 42, 8, 300, 11, 2, 508, 77, 1, 64]]) for r in runners]
    close(*logits, "prefill", tolerance(precision))
    for step in range(12):
        tokens = logits[1].argmax(-1)
        logits = [r.decode(tokens, np.array([11 + step])) for r in runners]
        close(*logits, f"decode step {step}", tolerance(precision))


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_the_servers_calls(layout, graph_mode):  # pylint: disable=unused-argument
    """``step`` as the server drives it (serve/scheduler.py), the same calls on both runners of 4 slots: prefill
    chunks of 2 slots (rows naming their slots, a pad row repeating the first) writing a 37-token prompt in chunks of
    16 columns that attend to the rows written before them, a refill whose busy row repeats its token from its
    position on (columns clamped at the cache's last row), decode steps over 2 of the 4 slots and over all 4."""
    native, plain = models(layout)
    runners = [m.kv_cache(4, 64) for m in (native, plain)]
    rng = np.random.default_rng(1)
    prompt = rng.integers(1, TINY["vocab_size"], 37).tolist()
    other = rng.integers(1, TINY["vocab_size"], 9).tolist()
    calls = []
    for start in range(0, 37, 16):  # slot 2's prompt in chunks, slot 0's with the first; pad row = row 0 again
        part = prompt[start:start + 16]
        ids = np.zeros((2, 16), np.int32)
        ids[0, :len(part)] = part
        if start == 0:
            ids[1, :9] = other
        else:
            ids[1] = ids[0]
        slots = [2, 0] if start == 0 else [2, 2]
        positions = np.tile(np.arange(start, start + 16), (2, 1))
        if start == 0:
            positions[1] = np.arange(16)
        calls.append((ids, positions, [len(part) - 1, 8 if start == 0 else len(part) - 1], slots))
    cursor = {2: 37, 0: 9}
    for step in range(3):  # decode steps over slots 2 and 0, as a 2-row bucket
        calls.append(([[11 + step], [13 + step]], [[cursor[2] + step], [cursor[0] + step]], [0, 0], [2, 0]))
    # a refill over every slot: slot 1 a new prompt; slot 2's token repeated from its position, past the last row
    ids = np.zeros((4, 32), np.int32)
    ids[1, :5] = [3, 4, 5, 6, 7]
    ids[2] = 21
    positions = np.zeros((4, 32), np.int32)
    positions[1] = np.arange(32)
    positions[2] = np.minimum(40 + np.arange(32), 63)
    calls.append((ids, positions, [0, 4, 0, 0], None))
    for step in range(2):
        calls.append((np.full((4, 1), 5 + step), [[step + 1], [5 + step], [41 + step], [2 + step]], [0] * 4, None))
    for index, (ids, positions, last, slots) in enumerate(calls):
        got = [r.step(ids, positions, last, slots) for r in runners]
        close(*got, f"call {index}")
    for layer, cache in enumerate(runners[1].key_caches):
        close(runners[0].keys[layer], cache.asnumpy(), f"key cache {layer}")


def test_a_call_longer_than_its_rows_runs_as_column_chunks(graph_mode):  # pylint: disable=unused-argument
    native, _ = models("llama")
    whole, chunked = native.kv_cache(2, 64), NativeRunner(native._kv_caches.description, 2, 64)
    chunked.rows = 6  # 3 columns of 2 rows a call
    prompts = [list(range(3, 20)), list(range(40, 51))]
    close(chunked.prefill(prompts), whole.prefill(prompts), "prefill in chunks")
    close(chunked.keys, whole.keys, "keys")


def test_generate_gives_the_compiled_runners_tokens(graph_mode):  # pylint: disable=unused-argument
    native, plain = models("llama")
    # 3 rows, the longest prompt 18 (width bucket 32), a 64-row cache: the compiled runner and its prefill and
    # one-token graphs of test_every_step_equals_the_compiled_plain_runner[llama-float32] (the same models); the
    # compiled runner's greedy tokens from those one-token steps (generate_one_step: its greedy graph's tokens)
    prompts = [[7, 3, 9, 1], list(range(40, 58)), [2, 5]]
    assert native.generate(prompts, max_new_tokens=20, do_sample=False) == \
        generate_one_step(plain, prompts, max_new_tokens=20, do_sample=False)
    options = dict(do_sample=True, temperature=1.3, top_k=40, seed=5)
    assert native.generate(prompts, max_new_tokens=20, **options) == \
        plain.generate(prompts, max_new_tokens=20, **options)
    assert type(native.kv_cache(3, 38)) is NativeRunner  # noqa: E721


@pytest.mark.parametrize("changes,kind", [
    ({}, "native"),
    (dict(LLAMA, num_query_groups=2), "native"),
    (dict(quantization=dict(QUANTIZATION)), "native"),
    (dict(compute_dtype="bfloat16"), "native"),
    (dict(layerdrop=0.1), "native"),  # an identity in inference
    (dict(cpu_kernels={"runner": "plain"}), "compiled"),
    (dict(cpu_kernels="plain"), "compiled"),
    (dict(compute_dtype="float16"), "compiled"),
    (dict(pet_config=dict(pet_type="lora", lora_rank=2, lora_alpha=4, target_modules=".*linear_qkv",
                          freeze_include=["*"], freeze_exclude=["*lora*"])), "compiled"),
    (dict(seq_length=48, pet_config=dict(pet_type="ptuning2", pre_seq_len=3, prefix_projection=False)), "compiled"),
    (dict(pet_config=dict(pet_type="adapter", bottleneck_size=4, non_linearity="gelu")), "compiled"),
], ids=["gpt2", "llama", "int8", "bf16", "layerdrop", "runner-plain", "plain", "fp16", "lora", "prefix", "adapter"])
def test_which_runner(changes, kind):
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes)), inference=True)
    assert model.kv_cache(1, 16) is not None and model._kv_caches.kind == kind
