"""GPTLocalPerplexityMetric: token-level perplexity, exact whatever the batching.

MindFormers' PerplexityMetric averages per-batch mean losses, so a short last batch or
uneven loss masks skew it. This metric sums negative log-likelihood and token counts over
the whole eval set. It reads the same (logits, labels, mask) layout as PerplexityMetric
(logits[:, t] scores labels[:, t + 1]), so either metric works with GPTLocalForCausalLM.
"""
import math

import numpy as np
from mindspore import nn

from ..errors import DataError


class GPTLocalPerplexityMetric(nn.Metric):
    """exp(total NLL / total tokens) over every masked-in token of the eval set."""

    def __init__(self):
        super().__init__()
        self.clear()

    def clear(self):
        self.total_nll = 0.0
        self.total_tokens = 0

    def update(self, *inputs):
        logits, labels, mask = (x.asnumpy() if hasattr(x, "asnumpy") else np.asarray(x) for x in inputs[:3])
        for row in range(logits.shape[0]):  # one row at a time keeps memory at one [seq, vocab] block
            scores = logits[row, :-1].astype(np.float64)
            target = labels[row, 1:]
            keep = mask[row, 1:] > 0
            top = scores.max(axis=-1, keepdims=True)
            log_z = (top + np.log(np.exp(scores - top).sum(axis=-1, keepdims=True)))[:, 0]
            nll = log_z - scores[np.arange(len(target)), target]
            self.total_nll += float(nll[keep].sum())
            self.total_tokens += int(keep.sum())

    def eval(self):
        if self.total_tokens == 0:
            raise DataError("GPTLocalPerplexityMetric saw no tokens (0 with loss_mask 1): the eval dataset "
                            "(eval_dataset.data_loader.dataset_dir) is empty or fully masked; prepare more text "
                            "with `gptlocal prepare-data`.")
        loss = self.total_nll / self.total_tokens
        return {"loss": loss, "PPL": math.exp(loss), "tokens": self.total_tokens}
