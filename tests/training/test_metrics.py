"""Perplexity from the model's eval outputs through GPTLocalPerplexityMetric equals PyTorch's cross-entropy
on the same logits, whatever the batching and the loss mask."""
import math

import numpy as np
import torch
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalForCausalLM
from mindformers_gptlocal.training.metrics import GPTLocalPerplexityMetric


def test_perplexity_equals_torch_cross_entropy_over_masked_tokens(tiny_config):
    ms.set_seed(0)
    model = GPTLocalForCausalLM(tiny_config)
    model.set_train(False)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, tiny_config.vocab_size, (5, 17)).astype(np.int32)
    inputs, labels = ids[:, :-1], ids[:, 1:].copy()
    mask = (rng.random(labels.shape) > 0.3).astype(np.int32)
    labels[0, 3] = tiny_config.ignore_token_id  # an ignored label counts like a masked one
    logits = model(Tensor(inputs)).asnumpy()
    keep = (mask > 0) & (labels != tiny_config.ignore_token_id)
    losses = torch.nn.functional.cross_entropy(torch.from_numpy(logits.astype(np.float64)).reshape(-1, logits.shape[-1]),
                                               torch.from_numpy(np.maximum(labels, 0).astype(np.int64)).reshape(-1),
                                               reduction="none").numpy().reshape(labels.shape)
    expected = float(losses[keep].mean())

    metric = GPTLocalPerplexityMetric()
    for rows in (slice(0, 3), slice(3, 5)):  # two batches of different sizes
        metric.update(*model(Tensor(inputs[rows]), Tensor(labels[rows]), Tensor(mask[rows])))
    result = metric.eval()
    assert result["tokens"] == int(keep.sum())
    assert math.isclose(result["loss"], expected, rel_tol=1e-6)
    assert math.isclose(result["PPL"], math.exp(expected), rel_tol=1e-6)
