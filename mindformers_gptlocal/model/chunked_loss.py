"""Tied-head cross-entropy over token chunks, for long sequences on CPU/GPU (``model_config.loss_chunk_size``).

The plain path (``GPTLocalForCausalLM.logits`` + ``lm_loss``) makes fp32 logits [T, V] and keeps them, their
log-softmax and the gradients of both: at T = 1024 and GPT-2's 50,257 tokens that is 206 MB a copy.
``ChunkedLoss`` computes the head and the cross-entropy ``chunk_size`` tokens at a time (a static loop,
unrolled at compile time) and its hand-written backward recomputes each chunk's logits, so only a
[chunk, V] block exists at once. The cost is one more head matmul (the recompute).
"""
import mindspore as ms
from mindspore import nn, ops


class ChunkedLoss(nn.Cell):
    """``construct(hidden, weight, labels, keep)`` -> sum over tokens of ``keep`` * negative log-likelihood.

    hidden [T, H] and weight [V, H] in the compute dtype (the tied head: logits = hidden @ weight^T, taken
    in fp32 as the plain path does), labels [T] int32 in [0, V), keep [T] float32 (0 drops a token)."""

    def __init__(self, chunk_size):
        super().__init__()
        self.chunk_size = int(chunk_size)
        self.head_matmul = ops.MatMul(transpose_b=True)
        self.grad_weight_matmul = ops.MatMul(transpose_a=True)
        self.grad_hidden_matmul = ops.MatMul()
        self.log_softmax = ops.LogSoftmax(axis=-1)
        self.softmax = ops.Softmax(axis=-1)
        self.gather_d = ops.GatherD()
        self.one_hot = ops.OneHot()

    def _logits(self, hidden, weight, start, end):
        return ops.cast(self.head_matmul(hidden[start:end], weight), ms.float32)

    def construct(self, hidden, weight, labels, keep):
        tokens = hidden.shape[0]
        count = (tokens + self.chunk_size - 1) // self.chunk_size
        total = None
        for index in range(count):  # unrolled: the token count is static
            start = index * self.chunk_size
            end = start + self.chunk_size if start + self.chunk_size < tokens else tokens
            if total is not None:  # one chunk after the other (see BlockwiseAttention)
                hidden = ops.depend(hidden, total)
            log_probs = self.log_softmax(self._logits(hidden, weight, start, end))
            picked = self.gather_d(log_probs, 1, ops.reshape(labels[start:end], (-1, 1)))
            part = ops.reduce_sum(-ops.reshape(picked, (-1,)) * keep[start:end])
            total = part if total is None else total + part
        return total

    def bprop(self, hidden, weight, labels, keep, out, dout):
        """d(sum keep * nll)/d logits = keep * (softmax - one_hot(label)), recomputed chunk by chunk."""
        tokens = hidden.shape[0]
        vocab = weight.shape[0]
        count = (tokens + self.chunk_size - 1) // self.chunk_size
        grad_hidden = []
        grad_weight = ops.zeros(weight.shape, ms.float32)
        for index in range(count):
            start = index * self.chunk_size
            end = start + self.chunk_size if start + self.chunk_size < tokens else tokens
            hidden = ops.depend(hidden, grad_weight)
            probs = self.softmax(self._logits(hidden, weight, start, end))
            target = self.one_hot(labels[start:end], vocab, ops.ones((), ms.float32), ops.zeros((), ms.float32))
            scale = ops.broadcast_to(ops.reshape(keep[start:end] * dout, (-1, 1)), probs.shape)  # explicit
            grad_logits = ops.cast((probs - target) * scale, hidden.dtype)
            grad_hidden.append(self.grad_hidden_matmul(grad_logits, weight))
            grad_weight = grad_weight + ops.cast(self.grad_weight_matmul(grad_logits, hidden[start:end]), ms.float32)
        grad_hidden = grad_hidden[0] if count == 1 else ops.concat(grad_hidden, axis=0)
        return grad_hidden, ops.cast(grad_weight, weight.dtype), ops.zeros_like(labels), ops.zeros_like(keep)
