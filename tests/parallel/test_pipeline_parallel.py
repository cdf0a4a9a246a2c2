"""Pipeline parallel, proved on CPU: the real model's Cells grouped by their ``pipeline_stage``,
run stage after stage (forward: stage 0 sends its activation; backward: the last stage sends the
activation's gradient back), give the full model's loss and gradients. The tied embedding is read
on stage 0 (lookup) and on the last stage (head); its gradient is the sum of both stages' parts,
which is what MindSpore's pipeline does for a shared Parameter (the owner, stage 0, receives the
last stage's part). Micro-batches accumulate to the full batch's gradient.
"""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops, Tensor, ParameterTuple

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from references import causal_bias
from mindformers_gptlocal.parallel.layout import stage_of_layers

SEQ, BATCH = 8, 4
SMALL = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=3,
             max_position_embeddings=16, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)
RTOL = 1e-5


@pytest.fixture(autouse=True, scope="module")
def pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)


def stage_cells(model, stage):
    """The model's own Cells placed on ``stage``, held in a plain dict so that no Parameter is renamed."""
    return {"blocks": [b for b in model.model.layers if b.pipeline_stage == stage], "model": model}


class FirstStage(nn.Cell):
    """Stage 0: the embedding and the blocks placed on stage 0."""

    def __init__(self, model):
        super().__init__()
        assert model.model.embedding.pipeline_stage == 0
        self.cells = stage_cells(model, 0)
        self.bias = causal_bias(SEQ)

    def construct(self, ids, positions):
        hidden = self.cells["model"].model.embedding(ids, positions)
        for block in self.cells["blocks"]:
            hidden = block(hidden, self.bias[:, :, :SEQ, :SEQ])
        return hidden


class LastStage(nn.Cell):
    """Stage 1 (last): its blocks, the final norm, the tied head and the loss of the real model."""

    def __init__(self, model):
        super().__init__()
        assert model.model.final_layernorm.pipeline_stage == 1
        self.cells = stage_cells(model, 1)
        self.bias = causal_bias(SEQ)

    def construct(self, hidden, labels):
        for block in self.cells["blocks"]:
            hidden = block(hidden, self.bias[:, :, :SEQ, :SEQ])
        lm = self.cells["model"]
        return lm.lm_loss(lm.logits(lm.model.final_layernorm(hidden)), labels, None)


class FullLoss(nn.Cell):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, ids, labels):
        return self.model(ids, labels)[0]


def stage_params(model, stage):
    """Trainable Parameters of the Cells on ``stage`` (the tied table counted on stage 0, its owner)."""
    cells = stage_cells(model, stage)["blocks"]
    cells += [model.model.embedding] if stage == 0 else [model.model.final_layernorm]
    return [p for cell in cells for p in cell.trainable_params()]


def run_pipeline(model, ids, labels, positions):
    """Forward stage 0 -> stage 1, backward stage 1 -> stage 0. Returns loss and {name: grad}."""
    first, last = FirstStage(model), LastStage(model)
    table = model.model.embedding.word_embeddings
    last_weights = ParameterTuple(stage_params(model, 1) + [table])
    first_weights = ParameterTuple(stage_params(model, 0))
    sent = first(ids, positions)  # the activation stage 0 sends
    loss = last(sent, labels)
    grad_last = ops.GradOperation(get_all=True, get_by_list=True)(last, last_weights)
    (d_sent, _), last_grads = grad_last(sent, labels)
    grad_first = ops.GradOperation(get_by_list=True, sens_param=True)(first, first_weights)
    first_grads = grad_first(ids, positions, d_sent)  # the gradient stage 1 sends back
    grads = {p.name: g.asnumpy() for p, g in zip(first_weights, first_grads)}
    head_part = last_grads[-1].asnumpy()
    lookup_part = grads[table.name]
    grads[table.name] = lookup_part + head_part  # the owner adds the last stage's part
    for p, g in zip(list(last_weights)[:-1], last_grads[:-1]):
        grads[p.name] = g.asnumpy()
    return loss.asnumpy(), grads, (lookup_part, head_part)


@pytest.mark.parametrize("offset,layers", [(0, [1, 2]), ([1, 0], [2, 1])])
def test_stages_run_in_turn_equal_the_full_model(offset, layers):
    config = GPTLocalConfig(**SMALL, parallel_config={"pipeline_stage": 2, "micro_batch_num": 2, "offset": offset})
    ms.set_seed(0)
    model = GPTLocalForCausalLM(config)
    rng = np.random.default_rng(1)
    for param in model.trainable_params():  # non-trivial LayerNorm and bias values
        param.set_data(Tensor(rng.normal(0, 0.2, param.shape).astype(np.float32)))
    model.set_train(True)
    assert model.model.stage_ids == stage_of_layers(3, 2, offset)
    assert [sum(1 for s in model.model.stage_ids if s == k) for k in (0, 1)] == layers
    tokens = rng.integers(0, SMALL["vocab_size"], (BATCH, SEQ + 1))
    ids, labels = Tensor(tokens[:, :-1], ms.int32), Tensor(tokens[:, 1:], ms.int32)
    positions = Tensor(np.tile(np.arange(SEQ), (BATCH, 1)), ms.int32)

    full = FullLoss(model)
    weights = ParameterTuple(model.trainable_params())
    ref_loss, ref_grads = ms.value_and_grad(full, None, weights=weights)(ids, labels)
    ref = {p.name: g.asnumpy() for p, g in zip(weights, ref_grads)}

    loss, grads, (lookup_part, head_part) = run_pipeline(model, ids, labels, positions)
    assert set(grads) == set(ref)
    errors = {"loss": abs(float(loss) - float(ref_loss.asnumpy()))}
    np.testing.assert_allclose(loss, ref_loss.asnumpy(), rtol=RTOL)
    for name, expected in ref.items():
        np.testing.assert_allclose(grads[name], expected, atol=RTOL * np.abs(expected).max(), err_msg=name)
        errors[name] = np.abs(grads[name] - expected).max()
    # the tie: both stages contribute, and neither part alone is the gradient
    table = model.model.embedding.word_embeddings.name
    assert np.abs(lookup_part).max() > 1e-4 and np.abs(head_part).max() > 1e-4
    assert np.abs(head_part - ref[table]).max() > 1e-4 and np.abs(lookup_part - ref[table]).max() > 1e-4

    # two micro-batches, gradients accumulated and averaged (equal token counts), equal the full batch
    half = BATCH // 2
    micro = [run_pipeline(model, ids[i:i + half], labels[i:i + half], positions[i:i + half]) for i in (0, half)]
    for name, expected in ref.items():
        accumulated = (micro[0][1][name] + micro[1][1][name]) / 2
        np.testing.assert_allclose(accumulated, expected, atol=RTOL * np.abs(expected).max(), err_msg=name)
        errors[f"micro {name}"] = np.abs(accumulated - expected).max()
    worst = max(errors, key=errors.get)
    print(f"\npipeline stages {layers}: loss {float(loss):.6f}, max abs error {errors[worst]:.2e} ({worst})")
