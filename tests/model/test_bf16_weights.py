"""A bf16 model built for inference on CPU (``KernelProvider.bf16_weights``: ``from_pretrained(..., inference=True)``,
what ``model/loader.py`` ``load_model`` builds for generate, chat, serve and eval) holds its Linears', its head's and
its token table's weights as bfloat16 once, and the GEMM kernel takes them so (``cpu_linear.cc``
``gptlocal_linear_bf16w_fwd``; the lookup ``kernels/cells/embedding.py``).

Checked by value against today's bf16 path (float32 weights rounded at every GEMM, precision 1 and 2): the kernel
alone on odd shapes (T 1, 7, 33; N, K not multiples of 16), with and without the bias; a tiny bf16 model directory
(tied: the head on the bf16 token table; untied; widths not multiples of 16) and a float32 one
with compute_dtype bfloat16 converted at load: the
same logits at T 1 and 7 and the same greedy tokens (today's token table rounded to bfloat16: the inference build holds
it so, its lookup reads the rounded rows); the Linears' weight bytes halved; ``cpu_kernels: plain`` on
the bf16 weights; the provider's rule (inference builds with bf16 GEMMs only; training keeps float32 weights)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn

from mindformers_gptlocal.kernels.cells import linear
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
from mindformers_gptlocal.model.layers import Linear
from mindformers_gptlocal.quantize import quantize_model
from mindformers_gptlocal.model.loader import load_model
from mindformers_gptlocal.safetensors_io import read_safetensors
from conftest import save_tiny_base

ODD = dict(hidden_size=72, intermediate_size=200)  # qkv 216, fc1 200, fc2 / proj 72: no multiple of 16


class _Sides(nn.Cell):
    """The float32 GEMM, today's bf16 kernels (precision 1 and 2) on the float32 weight and the bf16-weight kernels
    on the weight held as a bf16 Parameter, as a Linear holds it: one graph (one compile) for the five."""

    def __init__(self, library, weight):
        super().__init__()
        self.full = linear.CPULinearGEMM(library, threads=2)
        self.today = nn.CellList([linear.CPULinearGEMM(library, threads=2, precision="bfloat16", emulate=emulate)
                                  for emulate in (False, True)])
        self.held = nn.CellList([linear.CPULinearGEMM(library, threads=2, precision="bfloat16", emulate=emulate,
                                                      bf16_weights=True) for emulate in (False, True)])
        self.weight = Parameter(Tensor(weight, ms.bfloat16), name="weight", requires_grad=False)

    def construct(self, x, w, bias=None):
        return (self.full(x, w, bias), self.today[0](x, w, bias), self.today[1](x, w, bias),
                self.held[0](x, self.weight, bias), self.held[1](x, self.weight, bias))


@pytest.mark.parametrize("shape", [(1, 77, 109), (7, 77, 109), (33, 130, 70)])
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_weight_kernel_equals_precision_1_and_2(library, graph_mode, shape, bias):
    """y of the kernel on the weight held as bf16 equals today's kernel on the float32 weight (precision 1: oneDNN's
    bf16 GEMM; 2: its emulation) exactly, and differs from the float32 GEMM (the rounding happens)."""
    rows, k, n = shape
    rng = np.random.default_rng(rows + k)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((rows, k), (n, k), (n,)))
    full, *outs = (out.asnumpy() for out in _Sides(library, w)(Tensor(x), Tensor(w), *((Tensor(b),) if bias else ())))
    for emulate, want, got in ((False, outs[0], outs[2]), (True, outs[1], outs[3])):
        np.testing.assert_array_equal(got, want, err_msg=f"emulate={emulate}")
        assert np.abs(got - full).max() > 0
    with pytest.raises(ValueError, match="bf16_weights"):
        linear.CPULinearGEMM(library, bf16_weights=True)  # float32 precision: no bf16 weight form


def test_provider_bf16_weights_only_for_inference_builds_of_bf16_gemms():
    assert KernelProvider(compute_dtype="bfloat16", device_target="CPU", inference=True).bf16_weights
    assert not KernelProvider(compute_dtype="bfloat16", device_target="CPU").bf16_weights  # training
    assert not KernelProvider(compute_dtype="float32", device_target="CPU", inference=True).bf16_weights
    assert not KernelProvider(compute_dtype="bfloat16", device_target="CPU", parallel=True,
                              inference=True).bf16_weights  # float32 GEMMs there
    assert not KernelProvider(compute_dtype="bfloat16", device_target="GPU", inference=True).bf16_weights
    assert not KernelProvider({"linear": "plain"}, compute_dtype="bfloat16", device_target="CPU",
                              inference=True).bf16_weights  # no kernel to take them


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bf16w")
    out = {}
    for name, changes in (("tied", ODD), ("untied", dict(ODD, untie_embeddings_and_output_weights=True))):
        base = save_tiny_base(root / f"{name}_fp32", None, 5, **changes)
        quantize_model(base, str(root / name), "bfloat16", log=lambda line: None)
        out[name], out[name + "_fp32"] = str(root / name), base
    return out


def _linear_weights(model):
    return [cell.weight for _, cell in model.cells_and_names() if isinstance(cell, Linear)]


def _logits(model, seq):
    ids = np.random.default_rng(seq).integers(1, 512, (2, seq)).astype(np.int32)
    return model(Tensor(ids)).asnumpy()


def _greedy(model):
    return np.asarray(model.generate([[3, 14, 15, 92, 65]], max_new_tokens=10, do_sample=False))[0, 5:]


def _pair(model_dir, **overrides):
    """(today's bf16 path: float32 Parameters, the inference build). The inference build holds the token table as
    bfloat16 too (its lookup reads the rounded rows): today's table is rounded the same way here, so the two compute
    the same numbers."""
    today = GPTLocalForCausalLM.from_pretrained(model_dir, **overrides)
    held = GPTLocalForCausalLM.from_pretrained(model_dir, inference=True, **overrides)
    table = today.model.embedding.word_embeddings
    table.set_data(Tensor(table.asnumpy()).astype(ms.bfloat16).astype(ms.float32))
    for model in (today, held):
        model.set_train(False)
    return today, held


@pytest.mark.parametrize("case", ["tied", "untied", "fp32_converted_at_load"])
def test_bf16_weights_model_equals_todays_bf16_path(dirs, graph_mode, case, tmp_path):
    """The inference build's logits (T 1 and 7) and greedy tokens (tied) equal today's bf16 path's (float32 Parameters),
    its Linears (and an untied head) hold bf16 weights that do not train: half the bytes; save_pretrained writes them
    widened to float32."""
    if case == "fp32_converted_at_load":  # a float32 directory, compute_dtype bfloat16 asked for: rounded once
        today, held = _pair(dirs["tied_fp32"], compute_dtype="bfloat16")
    else:
        today, held = _pair(dirs[case])
    weights, before = _linear_weights(held), _linear_weights(today)
    assert len(weights) == 8 and all(w.dtype == ms.bfloat16 and not w.requires_grad for w in weights)
    assert all(w.dtype == ms.float32 for w in before)
    held_bytes, today_bytes = (sum(w.asnumpy().nbytes for w in group) for group in (weights, before))
    assert held_bytes * 2 == today_bytes
    if case == "untied":
        assert held.output_layer.weight.dtype == ms.bfloat16 and today.output_layer.weight.dtype == ms.float32
    else:  # the tied table is the head's and the token lookup's: held once, bfloat16 (rounded, nearest even)
        assert not hasattr(held, "head_table")
    table = held.model.embedding.word_embeddings
    assert table.dtype == ms.bfloat16 and not table.requires_grad
    np.testing.assert_array_equal(table.asnumpy().astype(np.float32),
                                  today.model.embedding.word_embeddings.asnumpy())
    if case != "fp32_converted_at_load":
        held.save_pretrained(str(tmp_path))  # bf16 Parameters widened to float32, exactly; no head_table
        saved = read_safetensors(str(tmp_path / "model.safetensors"))
        assert sorted(saved) == sorted(p.name for p in today.get_parameters())
        for param in today.get_parameters():
            np.testing.assert_array_equal(saved[param.name], param.asnumpy(), err_msg=param.name)
    name = "model.layers.1.mlp.linear_fc1.weight"
    held_w, today_w = (dict((p.name, p) for p in m.get_parameters())[name] for m in (held, today))
    np.testing.assert_array_equal(held_w.asnumpy().astype(np.float32), ms.Tensor(today_w.asnumpy()).astype(
        ms.bfloat16).astype(ms.float32).asnumpy())  # the rounded weight, nearest even
    for seq in (1, 7) if case != "fp32_converted_at_load" else (7,):  # (the test's time: one graph there)
        np.testing.assert_array_equal(_logits(held, seq), _logits(today, seq), err_msg=f"T={seq}")
    if case == "tied":  # the runtime's prefill and unrolled greedy decode graphs
        np.testing.assert_array_equal(_greedy(held), _greedy(today))


def test_plain_path_keeps_float32_weights_and_the_runtime_loader(dirs, graph_mode):
    """``cpu_kernels: plain`` on the bf16 directory keeps today's float32 Parameters (no
    kernel to take bf16 weights; MindSpore 2.9's CPU TensorMove has no bfloat16) and greedy-decodes the same tokens
    as the bf16-weight kernel path; ``load_model`` (generate, chat, serve, eval) builds the bf16 weights."""
    loaded = load_model(dirs["untied"])
    assert loaded.model.kernels.bf16_weights and _linear_weights(loaded)[0].dtype == ms.bfloat16
    plain = load_model(dirs["untied"], cpu_kernels="plain")
    assert not plain.model.kernels.bf16_weights and plain.model.layers[0].attention.linear_qkv.gemm is None
    assert all(w.dtype == ms.float32 for w in _linear_weights(plain)) and plain.output_layer.weight.dtype == ms.float32
    np.testing.assert_array_equal(_greedy(plain), _greedy(loaded))
