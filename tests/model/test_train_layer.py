"""The training layer as one kernel node each way (``cpu_kernels.train_layer``; ``kernels/csrc/cpu_train_layer.cc``,
``kernels/cells/train_layer.py`` ``CPUTrainLayer``, ``model/gpt.py`` ``GPTLocalBlock.train_kernel``): a compiled training
step's loss and every parameter's gradient against the plain graph (``cpu_kernels: plain``) and today's per-op kernel
path, on odd shapes (hidden 40 / 60, 5 or 6 heads of 8 or 10 channels, 2 or 3 key/value groups, intermediate 37,
13 tokens) with dropout on (the counter masks, attention and hidden), for every layout the model builds: GPT-2's,
Llama's (RMSNorm, rope, GQA, SwiGLU, no biases), NeoX's (parallel residual, partial rotary, QKV bias), Qwen2's
(QKV-only biases), the quick GeLU without biases; float32: each side's error against the float64 model of the same
weights and dropout masks (references.py) of the plain graph's size, bf16 GEMMs within bf16's rounding (no farther
from float32 than the plain bf16 graph). Then AdamW steps with an eval forward between them, the pairing of a
backward with its forward's saved activations (recompute's shared slot, two forwards of a layer before their
backwards: the same gradients, the forward run again where it must be, counted), the bytes saved per token (float32,
and bf16 GEMM operands at half), and which builds run the kernel."""
import gc

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.cells import train_layer
from references import LossOf, assert_error_of_plain_size, float64_weights, gpt_float64_grads, gpt_float64_steps

SEQ = 13
BASE = dict(vocab_size=97, hidden_size=40, num_hidden_layers=2, num_attention_heads=5, intermediate_size=37,
            max_position_embeddings=16, seq_length=SEQ, hidden_dropout=0.1, attention_dropout=0.1,
            bos_token_id=0, eos_token_id=0, pad_token_id=0)
ROPE = dict(hidden_size=60, num_attention_heads=6, position_embedding_type="rope")
LAYOUTS = {
    "gpt2": {},
    "llama": dict(ROPE, num_query_groups=3, normalization="RMSNorm", hidden_act="swiglu", add_bias_linear=False,
                  untie_embeddings_and_output_weights=True),
    "neox": dict(ROPE, rotary_percent=0.6, use_parallel_residual=True, add_qkv_bias=True),
    "qwen2": dict(ROPE, num_query_groups=2, normalization="RMSNorm", hidden_act="swiglu", add_bias_linear=False,
                  add_qkv_bias=True),
    "quick_no_bias": dict(hidden_act="quick_gelu", add_bias_linear=False, scale_attn_by_inverse_layer_idx=True),
}
FUSED = {"train_layer": "kernel"}


def models(layout, sides, **changes):
    """{side: model} of one layout with the same weights (every parameter moved off its initial value: LayerNorm's
    ones and zero biases would hide a mix-up); ``sides``: {name: cpu_kernels}."""
    built = {}
    for name, kernels in sides.items():
        ms.set_seed(0)
        built[name] = GPTLocalForCausalLM(GPTLocalConfig(**dict(BASE, **LAYOUTS[layout], **changes),
                                                         cpu_kernels=kernels))
    rng = np.random.default_rng(5)
    values = {name: Tensor(param.asnumpy() + (0.1 * rng.standard_normal(param.shape)).astype(np.float32))
              for name, param in next(iter(built.values())).parameters_and_names() if param.dtype == ms.float32}
    for model in built.values():
        for name, param in model.parameters_and_names():
            if name in values:
                param.set_data(Tensor(values[name].asnumpy()))
    return built


def batch(seed=0, rows=2):
    return Tensor(np.random.default_rng(seed).integers(1, BASE["vocab_size"], (rows, SEQ + 1)).astype(np.int32))


def loss_and_grads(model, *inputs, net=None):
    """One value_and_grad of the training loss, compiled in GRAPH mode: (loss, {parameter name: gradient})."""
    model.set_train(True)
    weights = model.trainable_params()
    step = ms.value_and_grad(net or LossOf(model), None, weights=weights)
    loss, grads = (ms.jit(step) if ms.get_context("mode") == ms.GRAPH_MODE else step)(*inputs)
    return float(loss.asnumpy()), {param.name: grad.asnumpy() for param, grad in zip(weights, grads)}


def worst(grads, reference):
    """The largest |difference| of any gradient relative to that gradient's largest |value|."""
    assert sorted(grads) == sorted(reference)
    return max(float(np.abs(grads[name] - reference[name]).max()) / max(float(np.abs(reference[name]).max()), 1e-30)
               for name in reference)


def of_plain_size(loss, grads, plain_loss, plain_grads, reference, name):
    """The loss and every gradient with errors against the float64 ``reference`` (loss, gradients) of the plain
    side's size: 8x its error + 4 u (``assert_error_of_plain_size``)."""
    assert sorted(grads) == sorted(plain_grads) == sorted(reference[1])
    for key in plain_grads:
        assert_error_of_plain_size(grads[key], plain_grads[key], reference[1][key], (name, key))
    assert_error_of_plain_size(loss, plain_loss, reference[0], (name, "loss"))


def float64_of(model, *terms):
    """``gpt_float64_grads`` of ``model``'s weights and trainable parameters: (loss, gradients)."""
    trainable = [param.name for param in model.trainable_params()]
    return gpt_float64_grads(float64_weights(model), model.config, terms, trainable)


def counts(library):
    return train_layer.stats(library)


def check_float32_step(library, built, step, reference):
    """The loss and every gradient of the fused side's first step (``step(name)``: (loss, gradients) of side
    ``name``, the fused side's called first) with errors against the float64 model's ``reference`` (same weights,
    same dropout masks; ``float64_of`` the plain side) within 8x the plain graph's + 4 u, and each other side's; each layer's backward paired with its forward
    (no forward run again)."""
    assert all(type(layer.train_kernel).__name__ == "CPUTrainLayer" for layer in built["fused"].model.layers)
    assert all(layer.train_kernel is None for name in built if name != "fused" for layer in built[name].model.layers)
    before = counts(library)
    loss, grads = step("fused")
    after = counts(library)
    assert (after["forwards"] - before["forwards"], after["backwards"] - before["backwards"]) == (2, 2)
    assert after["recomputed"] == before["recomputed"]
    for name in built:
        if name == "fused":
            continue
        other_loss, other_grads = step(name)
        of_plain_size(loss, grads, other_loss, other_grads, reference, name)
    assert any("linear_qkv.weight" in name and np.abs(grad).max() > 0 for name, grad in grads.items())


@pytest.fixture(scope="module")
def gpt2_plain_step():
    """GPT-2's plain graph, compiled, and its first training step on ``batch()`` (a fresh dropout counter), with the
    float64 model's of the same weights and masks: (model, (loss, gradients), float64 reference). Shared by the
    float32 step's test and the recomputed layers' (one compile of the plain graph for both)."""
    before = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        plain = models("gpt2", {"plain": "plain"})["plain"]
        reference = float64_of(plain, (1.0, batch(), 0, None))  # (before a LossOf holds the model: its names)
        return plain, loss_and_grads(plain, batch()), reference
    finally:
        ms.set_context(mode=before)


def same_weights(model, other):
    """``model``'s float32 Parameters equal ``other``'s of the same name (a shared reference's weights)."""
    values = dict(other.parameters_and_names())
    assert all(np.array_equal(param.asnumpy(), values[name].asnumpy())
               for name, param in model.parameters_and_names() if param.dtype == ms.float32)


@pytest.mark.parametrize("layout", [name for name in LAYOUTS if name != "llama"])  # Llama's: with the AdamW steps
def test_float32_step_matches_the_plain_graph_and_todays_kernels(library, graph_mode, gpt2_plain_step, layout):
    """``check_float32_step``, and for GPT-2's layers, compiled, today's per-op kernels' errors too (the other
    layouts, which differ inside the kernel only, in PYNATIVE: quicker; Llama's in the AdamW steps' test below, on
    the graphs those steps compile)."""
    if layout == "gpt2":  # the plain side's step: gpt2_plain_step's (the same weights, batch and masks)
        plain, plain_step, reference = gpt2_plain_step
        built = dict(models(layout, {"fused": FUSED, "kernels": "auto"}), plain=plain)
        same_weights(built["fused"], plain)
        check_float32_step(library, built,
                           lambda name: plain_step if name == "plain" else loss_and_grads(built[name], batch()),
                           reference)
        return
    ms.set_context(mode=ms.PYNATIVE_MODE)  # the fixture sets the mode before the test back afterwards
    built = models(layout, {"fused": FUSED, "plain": "plain"})
    check_float32_step(library, built, lambda name: loss_and_grads(built[name], batch()),
                       float64_of(built["plain"], (1.0, batch(), 0, None)))


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_bf16_step_within_bf16_rounding(library, pynative_mode, layout):
    """compute_dtype bfloat16 (bf16 GEMMs; the kernel saves their operands as bf16 and goes on from them): the loss
    within 1e-3 relative of the plain bf16 graph's and of float32's, the gradients within 3e-2 of their largest
    values of the plain bf16 graph's, and no farther from float32's than the plain bf16 graph's are (1.5x at most,
    the worst over every gradient)."""
    built = models(layout, {"fused": FUSED, "plain": "plain"}, compute_dtype="bfloat16")
    float32 = models(layout, {"float32": "plain"})["float32"]
    loss, grads = loss_and_grads(built["fused"], batch())
    plain_loss, plain_grads = loss_and_grads(built["plain"], batch())
    reference_loss, reference = loss_and_grads(float32, batch())
    assert abs(loss - plain_loss) <= 1e-3 * abs(plain_loss) and abs(loss - reference_loss) <= 1e-3 * reference_loss
    assert worst(grads, plain_grads) <= 3e-2
    assert worst(grads, reference) <= 1.5 * worst(plain_grads, reference)


def test_float32_llama_step_and_steps_with_an_eval_forward_between_them_train_like_the_plain_graph(library,
                                                                                                   graph_mode):
    """Llama's layers, compiled: ``check_float32_step`` on the first step of each side (today's per-op kernels'
    errors too), then three AdamW steps, an eval forward (the per-op graph, train flag off) after each: the losses
    (falling) and the eval logits with errors against the float64 model's (same weights, masks and AdamW steps)
    within 8x the plain graph's + 4 u; every backward paired with its own forward."""
    built = models("llama", {"fused": FUSED, "plain": "plain", "kernels": "auto"})
    plain = built["plain"]
    exact_losses, _, exact_logits = gpt_float64_steps(
        float64_weights(plain), (batch()[:, :-1], batch()[:, 1:]), plain.config, 3, 1e-2,
        trainable=[param.name for param in plain.trainable_params()], dropout=True, eval_ids=batch(7)[:, :-1])
    reference = float64_of(plain, (1.0, batch(), 0, None))  # (before a LossOf holds the model: its names)
    steps = {}
    for name, model in built.items():
        weights = model.trainable_params()
        steps[name] = weights, ms.jit(ms.value_and_grad(LossOf(model), None, weights=weights))
    firsts = {}

    def first_step(name):  # the compiled step the AdamW steps below go on with, before any update
        built[name].set_train(True)
        weights, step = steps[name]
        loss, grads = step(batch())
        firsts[name] = loss, grads
        return float(loss.asnumpy()), {param.name: grad.asnumpy() for param, grad in zip(weights, grads)}

    check_float32_step(library, built, first_step, reference)
    results = {}
    for name in ("fused", "plain"):
        model = built[name]
        weights, step = steps[name]
        optimizer = nn.AdamWeightDecay(weights, learning_rate=1e-2)
        losses, logits = [], []
        before = counts(library)
        for index in range(3):
            model.set_train(True)
            loss, grads = firsts.pop(name) if index == 0 else step(batch())
            optimizer(grads)
            losses.append(float(loss.asnumpy()))
            model.set_train(False)
            logits.append(model(batch(7)[:, :-1]).asnumpy())
        after = counts(library)
        results[name] = losses, logits, after["recomputed"] - before["recomputed"]
    losses, logits, recomputed = results["fused"]
    for index, (got, want, exact) in enumerate(zip(logits, results["plain"][1], exact_logits)):
        assert_error_of_plain_size(got, want, exact, ("logits after step", index + 1))
    assert_error_of_plain_size(losses, results["plain"][0], exact_losses, "losses")
    assert losses[-1] < losses[0] and recomputed == 0


def test_packed_documents_match_the_plain_graph(library, pynative_mode):
    """Packed rows (``actual_seq_len``: a mask per row [B, 1, S, S], rope's angles per row as positions restart at
    each document), Llama's layout: the loss and every gradient with errors against the float64 model's within 8x
    the plain graph's + 4 u."""
    built = models("llama", {"fused": FUSED, "plain": "plain"})
    ids = batch(3)
    ends = Tensor(np.array([[4, 9, SEQ], [7, SEQ, SEQ]], np.int32))
    inputs = (ids[:, :-1], ids[:, 1:], None, None, None, ends)
    reference = float64_of(built["plain"], (1.0, ids, 0, ends))
    loss, grads = loss_and_grads(built["fused"], *inputs)
    plain_loss, plain_grads = loss_and_grads(built["plain"], *inputs)
    of_plain_size(loss, grads, plain_loss, plain_grads, reference, "packed")
    unpacked, _ = loss_and_grads(built["plain"], ids)
    assert abs(unpacked - plain_loss) > 1e-4  # the documents do change the loss


class TwoForwards(nn.Cell):
    """Two forwards of every layer before either backward (what a graph of two micro-batches would do)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, first, second):
        return self.model(first)[0] + 2.0 * self.model(second)[0]


def test_a_backward_whose_slot_holds_another_forward_runs_its_forward_again(library, graph_mode, gpt2_plain_step):
    """Two forwards of each layer before their backwards (each layer's slot then holds the second's activations), and
    every layer recomputed by MindSpore (one slot for all): the gradients are the plain graph's (for the recomputed
    layers the plain graph's step without recompute, ``gpt2_plain_step``: recompute changes no value), and the
    backwards that found another forward's activations ran their own forward again (counted). The losses and
    gradients with errors against the float64 model's (forwards 0 and 1's masks) within 8x the plain graph's + 4 u."""
    sides = {"fused": FUSED, "plain": "plain"}
    built = models("gpt2", sides)
    reference = float64_of(built["plain"], (1.0, batch(1), 0, None), (2.0, batch(2), 1, None))
    before = counts(library)
    loss, grads = loss_and_grads(built["fused"], batch(1), batch(2), net=TwoForwards(built["fused"]))
    twice = counts(library)
    plain_loss, plain = loss_and_grads(built["plain"], batch(1), batch(2), net=TwoForwards(built["plain"]))
    of_plain_size(loss, grads, plain_loss, plain, reference, "two forwards")
    assert twice["forwards"] - before["forwards"] >= 4 and twice["recomputed"] > before["recomputed"]
    recomputed = models("gpt2", {"fused": FUSED}, parallel_config={"recompute": {"recompute": True}})["fused"]
    layers = recomputed.model.layers
    assert [layer.recompute_mode for layer in layers] == ["full", "full"]
    assert [layer.train_kernel.slot for layer in layers] == [train_layer.SHARED_SLOT] * 2
    plain_model, (plain_loss, plain), reference = gpt2_plain_step
    same_weights(recomputed, plain_model)
    loss, grads = loss_and_grads(recomputed, batch())
    of_plain_size(loss, grads, plain_loss, plain, reference, "recomputed")
    assert counts(library)["backwards"] - twice["backwards"] == 2


def test_saved_bytes_per_token(library, pynative_mode):
    """What a layer keeps for its backward, per token: float32 qkv [Q], ctx [N D], the MLP's GEMM output(s) [I or 2 I],
    h [H] and the logsumexp [N]; with bf16 GEMMs the first three at two bytes."""
    held = {}
    for layout, dtype in (("gpt2", "float32"), ("gpt2", "bfloat16"), ("llama", "float32"), ("llama", "bfloat16")):
        model = models(layout, {"fused": FUSED}, compute_dtype=dtype)["fused"]
        model.set_train(True)
        before = counts(library)
        LossOf(model)(batch()).asnumpy()  # a training forward fills the slots
        held[layout, dtype] = (counts(library)["slot_bytes"] - before["slot_bytes"]) / (2 * 2 * SEQ)  # 2 layers
    hidden, heads = 40, 5
    gemm, rest = (3 * hidden) + hidden + 37, 4 * (hidden + heads)  # GPT-2: Q = 3H, ctx H, fc1's I; h, lse float32
    assert held["gpt2", "float32"] == 4 * gemm + rest and held["gpt2", "bfloat16"] == 2 * gemm + rest
    hidden, heads, groups, head_dim = 60, 6, 3, 10
    gemm, rest = (heads + 2 * groups) * head_dim + hidden + 2 * 37, 4 * (hidden + heads)
    assert held["llama", "float32"] == 4 * gemm + rest and held["llama", "bfloat16"] == 2 * gemm + rest


def test_a_models_slots_go_with_it(library, pynative_mode):
    """The slots a model's layers filled are freed when the model is collected (a compiled graph's model lives on in
    MindSpore's compile cache, and its slots with it)."""
    model = models("gpt2", {"fused": FUSED})["fused"]
    model.set_train(True)
    gc.collect()  # earlier tests' models, collected now, not during this test
    before = counts(library)["slots"]
    loss = LossOf(model)(batch())  # the training forward alone fills them (a backward would read them)
    assert np.isfinite(loss.asnumpy()).all()
    assert counts(library)["slots"] == before + 2
    del model, loss
    gc.collect()
    assert counts(library)["slots"] == before


def kernel_of(cpu_kernels=FUSED, layout="gpt2", **changes):
    """The built first layer's training kernel's class name, or None."""
    config = GPTLocalConfig(**dict(BASE, **LAYOUTS[layout], **changes), cpu_kernels=cpu_kernels)
    kernel = GPTLocalForCausalLM(config).model.layers[0].train_kernel
    return None if kernel is None else type(kernel).__name__


def test_which_builds_run_the_kernel(library):
    """``train_layer: kernel`` runs it for every layout and in bf16; ``auto`` (not measured faster yet) and ``plain``
    do not; nor a layer with LoRA, an adapter, a prefix or LayerDrop, the blockwise attention, the erf GeLU, a
    float16 softmax, or an inference build."""
    assert {kernel_of(layout=layout) for layout in LAYOUTS} == {"CPUTrainLayer"}
    assert kernel_of(compute_dtype="bfloat16") == "CPUTrainLayer"
    assert kernel_of("kernel", hidden_dropout=0.0, attention_dropout=0.0) == "CPUTrainLayer"
    assert kernel_of("auto") is None and kernel_of("plain") is None and kernel_of({"train_layer": "plain"}) is None
    frozen = dict(freeze_include=["*"], freeze_exclude=["*lora*", "*adapter*", "*prefix*"])
    lora = dict(pet_type="lora", lora_rank=2, lora_alpha=4, target_modules=".*linear_qkv", **frozen)
    adapter = dict(pet_type="adapter", bottleneck_size=4, non_linearity="gelu", **frozen)
    prefix = dict(pet_type="prefixtuning", prefix_token_num=2, **frozen)
    for pet in (lora, adapter, prefix):
        assert kernel_of(pet_config=pet) is None, pet
    assert kernel_of(layerdrop=0.1) is None
    assert kernel_of(attention_block_size=4) is None
    assert kernel_of(hidden_act="gelu") is None
    assert kernel_of(softmax_compute_dtype="float16") is None
    config = GPTLocalConfig(**BASE, cpu_kernels=FUSED)
    assert GPTLocalForCausalLM(config, inference=True).model.layers[0].train_kernel is None
