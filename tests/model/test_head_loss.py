"""The head and its loss as one kernel node each way in training graphs (``cpu_kernels.head_loss``;
``kernels/csrc/cpu_head_loss.cc``, ``kernels/cells/head_loss.py`` ``CPUHeadLoss``, ``model/gpt.py`` ``_fused_loss``): the loss
and every parameter's gradient against the plain head + LogSoftmax (``{head_loss: plain}``) on odd shapes (vocab 97,
13 tokens), with ignored labels and a loss mask, a tied head (GPT-2's) and an untied one (Llama's); the loss's
incoming gradient (a loss scale) reaching the head and the layers below; and which builds run the kernel (``kernel``
only: ``auto`` leaves it off)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.cells.head_loss import CPUHeadLoss
from mindformers_gptlocal.model.quantization import QUANTIZATION
from test_train_layer import BASE, LAYOUTS, SEQ, loss_and_grads, models, worst

FUSED = {"head_loss": "kernel"}
PLAIN = {"head_loss": "plain"}


class ScaledLoss(nn.Cell):
    """The model's loss on (input_ids, labels, loss_mask) times ``scale``: a loss scale's incoming gradient."""

    def __init__(self, model, scale):
        super().__init__()
        self.model, self.scale = model, scale

    def construct(self, input_ids, labels, loss_mask):
        return self.model(input_ids, labels, loss_mask)[0] * self.scale


def inputs(seed=3):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, BASE["vocab_size"], (2, SEQ)).astype(np.int32)
    labels = rng.integers(0, BASE["vocab_size"], (2, SEQ)).astype(np.int32)
    labels[0, :4] = -100  # ignored (ignore_token_id)
    mask = np.ones((2, SEQ), np.int32)
    mask[1, 9:] = 0  # padding
    return Tensor(ids), Tensor(labels), Tensor(mask)


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_fused_loss_and_gradients_match_the_plain_head(library, graph_mode, layout):
    """float32: the loss within 1e-5 relative and every gradient within 1e-5 of its largest value, scaled by 3
    (the loss's incoming gradient) on both sides; the head's table and the layers below get theirs."""
    built = models(layout, {"fused": FUSED, "plain": PLAIN}, hidden_dropout=0.0, attention_dropout=0.0)
    assert isinstance(built["fused"].head_loss, CPUHeadLoss) and built["plain"].head_loss is None
    loss, grads = loss_and_grads(built["fused"], *inputs(), net=ScaledLoss(built["fused"], 3.0))
    plain_loss, plain_grads = loss_and_grads(built["plain"], *inputs(), net=ScaledLoss(built["plain"], 3.0))
    assert abs(loss - plain_loss) <= 1e-5 * abs(plain_loss)
    assert worst(grads, plain_grads) <= 1e-5
    head = "output_layer.weight" if layout == "llama" else "model.embedding.word_embeddings"
    assert any(name.endswith(head) and np.abs(grad).max() > 0 for name, grad in grads.items())
    assert any("linear_qkv.weight" in name and np.abs(grad).max() > 0 for name, grad in grads.items())


def config(**changes):
    return GPTLocalConfig(**dict(BASE, **changes))


@pytest.mark.parametrize("changes,runs", [
    ({}, False), (dict(cpu_kernels=FUSED), True), (dict(LAYOUTS["llama"], cpu_kernels=FUSED), True),
    (dict(cpu_kernels=PLAIN), False), (dict(cpu_kernels="kernel"), True),
    (dict(compute_dtype="bfloat16", cpu_kernels=FUSED), False),  # bf16 GEMMs: the head's bf16 GEMM and lm_loss
    (dict(quantization=dict(QUANTIZATION), cpu_kernels=FUSED), False),  # an int8 table: the int8 head
    (dict(cpu_kernels=FUSED, pet_config=dict(pet_type="lora", lora_rank=2, target_modules=".*linear_qkv",
                                              freeze_include=["*"], freeze_exclude=["*lora*"])), False),  # frozen head
    (dict(cpu_kernels=FUSED, pet_config=dict(pet_type="lora", lora_rank=2, target_modules=".*linear_qkv",
                                              freeze_include=["*"], freeze_exclude=["*lora*", "*word_embeddings"])),
     True),  # the head trains too
])
def test_which_builds_run_the_kernel(library, changes, runs):
    model = GPTLocalForCausalLM(config(**changes))
    assert (model.head_loss is not None) == runs
    assert (type(model.train_loss).__name__ == "FusedLoss") == runs


def test_an_inference_build_keeps_the_plain_head(library):
    assert GPTLocalForCausalLM(config(cpu_kernels=FUSED), inference=True).head_loss is None
