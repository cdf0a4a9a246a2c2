"""Counter-based dropout (model/dropout.py): masks equal a numpy re-derivation bit for bit, keep the asked
rate, change with the step and the site, and a model's forward counter reproduces a forward exactly."""
import numpy as np
import pytest

import mindspore as ms
from mindspore import Tensor, nn

from mindformers_gptlocal.model.dropout import CounterDropout
from references import keep_reference

from conftest import TINY


class Keep(nn.Cell):
    def __init__(self, p, site, seed):
        super().__init__()
        self.dropout = CounterDropout(p, site, seed)

    def construct(self, x, step):
        return self.dropout.keep(x, step)


@pytest.mark.parametrize("p", [0.1, 0.7])
def test_masks_equal_the_numpy_derivation_and_keep_the_rate(p):
    keep = Keep(p, site=5, seed=11)
    shape = (3, 4, 40000)  # larger than both tables: the tiling is exercised
    x = Tensor(np.zeros(shape, np.float32))
    masks = []
    for step in (0, 1, 65521, 2 ** 31 - 3):
        got = keep(x, Tensor(step, ms.int32)).asnumpy()
        np.testing.assert_array_equal(got, keep_reference(shape, step, 5, 11, p))
        assert abs(got.mean() - (1 - p)) < 0.005, got.mean()
        masks.append(got)
    assert all((a != b).mean() > 0.1 for a, b in zip(masks, masks[1:]))  # each step draws a new mask
    other_site = Keep(p, site=6, seed=11)(x, Tensor(0, ms.int32)).asnumpy()
    assert (other_site != masks[0]).mean() > 0.1


def test_dropout_scales_kept_values_and_is_identity_in_eval():
    dropout = CounterDropout(0.25, site=1, seed=0)
    x = Tensor(np.full((8, 64), 3.0, np.float32))
    dropout.set_train(True)
    y = dropout(x, Tensor(7, ms.int32)).asnumpy()
    assert set(np.unique(y)) == {0.0, 4.0}
    dropout.set_train(False)
    np.testing.assert_array_equal(dropout(x, Tensor(7, ms.int32)).asnumpy(), x.asnumpy())


def test_model_forward_counter_reproduces_a_training_forward(tmp_path):
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    config = GPTLocalConfig(**dict(TINY, hidden_dropout=0.1, attention_dropout=0.1))
    model = GPTLocalForCausalLM(config)
    assert model.model.counter_dropout
    model.set_train(True)
    ids = Tensor(np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 33)).astype(np.int32))
    first = model(ids)[0].asnumpy()
    assert int(model.dropout_step.asnumpy()) == 1
    second = model(ids)[0].asnumpy()
    assert first != second  # another step, other masks
    model.dropout_step.set_data(Tensor(0, ms.int32))
    assert model(ids)[0].asnumpy() == first  # the counter alone decides the masks: bit for bit
    # the counter is training state: not in model files, and a model file loads without it
    model.save_pretrained(str(tmp_path / "model"))
    from safetensors import safe_open
    with safe_open(str(tmp_path / "model" / "model.safetensors"), framework="numpy") as handle:
        assert "dropout_step" not in set(handle.keys())
    GPTLocalForCausalLM.from_pretrained(str(tmp_path / "model"))
