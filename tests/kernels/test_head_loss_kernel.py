"""The fused CPU head + cross-entropy (mindformers_gptlocal/kernels/head_loss.cc): the loss and the gradients of
the hidden states and of the head's table within 1e-5 of the plain path (MatMul + LogSoftmax + GatherD + masked
mean) on odd sizes (rows not a multiple of the chunk, a vocab not a multiple of the block) with ignored and
masked rows; a tiny model, tied and untied, trains with the plain path's losses and gradients step for step."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels import build, head_loss
from conftest import TINY
from references import train_steps

IGNORE = -100


@pytest.fixture
def head_kernel_on(monkeypatch):
    """The kernel is opt-in: GPTLOCAL_HEAD_LOSS_KERNEL=1 while the model is built."""
    monkeypatch.setenv("GPTLOCAL_HEAD_LOSS_KERNEL", "1")


def _plain_loss(hidden, weight, labels, keep):
    """The model's plain path (GPTLocalForCausalLM.logits + lm_loss)."""
    log_probs = ops.log_softmax(ops.matmul(hidden, weight.T), -1)
    picked = ops.gather_elements(log_probs, 1, ops.reshape(ops.maximum(labels, 0), (-1, 1)))
    return ops.reduce_sum(-ops.reshape(picked, (-1,)) * keep) / ops.maximum(ops.reduce_sum(keep), 1.0)


# (rows N, hidden H, vocab V, chunk rows, vocab block, threads): N not a multiple of the chunk, V not a multiple
# of the block; one chunk and one block; more threads than blocks
CASES = {"odd": (37, 24, 301, 8, 64, 2), "one_chunk": (13, 16, 97, 64, 128, 1),
         "threads_gt_blocks": (9, 8, 50, 4, 64, 3)}


@pytest.mark.parametrize("case", CASES)
def test_loss_and_gradients_match_plain(library, pynative_mode, case):
    rows, width, vocab, chunk, block, threads = CASES[case]
    rng = np.random.default_rng(len(case))
    hidden = Tensor(rng.standard_normal((rows, width)).astype(np.float32))
    weight = Tensor((rng.standard_normal((vocab, width)) * 0.5).astype(np.float32))
    labels_np = rng.integers(0, vocab, rows).astype(np.int32)
    labels_np[[1, rows - 1]] = IGNORE  # ignored tokens
    keep_np = (labels_np != IGNORE) & (rng.random(rows) > 0.25)  # and a loss mask
    labels, keep = Tensor(labels_np), Tensor(keep_np.astype(np.float32))
    cell = head_loss.CPUHeadLoss(library, vocab, threads=threads, rows=chunk, block=block)
    scale = 2.5  # an upstream gradient other than 1 (the loss scale, gradient accumulation)
    got, got_grads = ms.value_and_grad(lambda h, w: cell(h, w, labels, keep) * scale, (0, 1))(hidden, weight)
    want, want_grads = ms.value_and_grad(lambda h, w: _plain_loss(h, w, labels, keep) * scale, (0, 1))(hidden, weight)
    want_loss = float(want.asnumpy())
    assert got.shape == () and abs(float(got.asnumpy()) - want_loss) <= 1e-5 * max(1.0, want_loss)
    for name, actual, expected in zip(("hidden", "weight"), got_grads, want_grads):
        np.testing.assert_allclose(actual.asnumpy(), expected.asnumpy(), atol=1e-5, rtol=0, err_msg=name)
    masked = ~keep_np
    assert masked.any() and not np.abs(got_grads[0].asnumpy()[masked]).any()  # masked rows: no gradient
    assert np.abs(want_grads[1].asnumpy()).max() > 0.05


def test_all_rows_masked_and_bad_label(library, pynative_mode):
    """No kept row: loss 0 and zero gradients, as the plain path; a label outside [0, V) in a kept row is refused
    (MindSpore raises on the kernel's error code) instead of reading past the row."""
    rng = np.random.default_rng(1)
    hidden = Tensor(rng.standard_normal((6, 8)).astype(np.float32))
    weight = Tensor(rng.standard_normal((40, 8)).astype(np.float32))
    cell = head_loss.CPUHeadLoss(library, 40, threads=2, rows=4, block=16)
    labels = Tensor(np.full((6,), IGNORE, np.int32))
    none_kept = ops.zeros((6,), ms.float32)
    loss, grads = ms.value_and_grad(lambda h, w: cell(h, w, labels, none_kept), (0, 1))(hidden, weight)
    assert float(loss.asnumpy()) == 0.0 and not any(np.abs(g.asnumpy()).any() for g in grads)
    with pytest.raises(RuntimeError):
        cell(hidden, weight, Tensor(np.full((6,), 40, np.int32)), ops.ones((6,), ms.float32)).asnumpy()


# ---------------------------------------------------------------------------------------- the model
SEQ = 40


@pytest.mark.parametrize("untied", [False, True])
def test_tiny_training_matches_plain_path(library, head_kernel_on, untied):
    """3 AdamW steps in GRAPH mode: losses step for step and every parameter's first-step gradient within 1e-5 of
    the plain head, with ignored labels and a loss mask; the tied table's gradient sums the lookup's and the
    head's, the untied ``output_layer`` gets the head's."""
    config = GPTLocalConfig(**dict(TINY, vocab_size=301, max_position_embeddings=SEQ, seq_length=SEQ,
                                   untie_embeddings_and_output_weights=untied))
    before = ms.get_context("mode")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        fused = GPTLocalForCausalLM(config)
        plain = GPTLocalForCausalLM(config)
        assert fused.head_loss is not None
        plain.head_loss = None  # chosen at build time; unset, construct takes the plain path
        values = dict(fused.parameters_and_names())
        for name, param in plain.parameters_and_names():
            param.set_data(Tensor(values[name].asnumpy()))
        rng = np.random.default_rng(4)
        ids = rng.integers(1, config.vocab_size, (3, SEQ + 1)).astype(np.int32)
        labels = ids[:, 1:].copy()
        labels[0, :5] = config.ignore_token_id
        loss_mask = (rng.random((3, SEQ)) > 0.2).astype(np.int32)
        batch = (Tensor(ids[:, :-1]), Tensor(labels), Tensor(loss_mask))
        losses, grads = train_steps(fused, [batch], learning_rate=1e-3)
        plain_losses, plain_grads = train_steps(plain, [batch], learning_rate=1e-3)
    finally:
        ms.set_context(mode=before)
    np.testing.assert_allclose(losses, plain_losses, atol=1e-5, rtol=0)
    assert losses[-1] < losses[0]
    worst = {name: float(np.abs(grads[name] - plain_grads[name]).max()) for name in grads}
    assert max(worst.values()) <= 1e-5, worst
    head = "output_layer.weight" if untied else "model.embedding.word_embeddings"
    assert any(name.endswith(head) or name == head for name in grads), sorted(grads)


def test_fp16_and_plain_switch_keep_the_plain_head(monkeypatch, capfd):
    """Off by default; with GPTLOCAL_HEAD_LOSS_KERNEL=1: float16 compute: no kernel, one warning naming float32;
    GPTLOCAL_PLAIN_KERNELS=1 (every fast path), GPTLOCAL_HEAD_LOSS_KERNEL=0 or a frozen table: no kernel, no
    warning."""
    assert GPTLocalForCausalLM(GPTLocalConfig(**TINY)).head_loss is None
    monkeypatch.setenv("GPTLOCAL_HEAD_LOSS_KERNEL", "1")
    monkeypatch.setattr(build, "_WARNED", set())
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, compute_dtype="float16")))
    assert model.head_loss is None
    err = capfd.readouterr().err
    assert err.count("head + loss kernel off") == 1 and "float32" in err, err
    monkeypatch.setenv("GPTLOCAL_PLAIN_KERNELS", "1")
    assert GPTLocalForCausalLM(GPTLocalConfig(**TINY)).head_loss is None
    monkeypatch.delenv("GPTLOCAL_PLAIN_KERNELS")
    monkeypatch.setenv("GPTLOCAL_HEAD_LOSS_KERNEL", "0")  # this kernel alone off
    off = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    assert off.head_loss is None and off.model.layers[0].attention.cpu_attention is not None
    monkeypatch.setenv("GPTLOCAL_HEAD_LOSS_KERNEL", "1")
    lora = dict(pet_type="lora", lora_rank=4, lora_alpha=8, lora_dropout=0.0, target_modules=".*linear_qkv",
                freeze_include=["*"], freeze_exclude=["*lora*"])
    frozen = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, pet_config=lora)))
    assert not frozen.model.embedding.word_embeddings.requires_grad
    assert frozen.head_loss is None  # a frozen table: the plain head (the kernel always computes its gradient)
    assert "head + loss kernel off" not in capfd.readouterr().err


def test_eval_returns_plain_logits(library, head_kernel_on, pynative_mode):
    """With the kernel on, eval and predict still return the [B, S, V] logits of ``logits``."""
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    assert model.head_loss is not None
    model.set_train(False)
    ids = Tensor(np.arange(1, 17, dtype=np.int32).reshape(2, 8))
    logits = model(ids)
    assert logits.shape == (2, 8, TINY["vocab_size"])
