"""Memory-efficient exact attention for CPU/GPU: query blocks, with the scores recomputed in the backward.

The plain path (``attention.py`` ``MatmulSoftmaxAttention``) keeps the [B, N, S, S] scores and probabilities of
every layer for the backward; at long sequences they dominate peak memory (GPT-2 small at 1 x 1024 on CPU:
see the CHANGELOG). ``BlockwiseAttention`` splits the queries into static blocks of ``block_size`` rows
(the Python loop is unrolled when the graph is compiled). Each block's scores [B, N, block, K] exist
only while that block is computed; a custom ``bprop`` recomputes them from Q, K, V block by block, so
the graph keeps no [B, N, S, S] tensor between the forward and the backward.

Each block attends to the keys up to its last query only (K = that position + 1): gpt_local's masks (the
causal bias, ``GPTLocalModel.document_mask``) drop every later key, so the skipped keys would get a
probability of exactly 0 and the rows are the plain path's softmax over the same numbers. This also
skips about half of the attention matmuls.

Dropout on the probabilities takes a keep mask [B, N, S, S] (bool) from the caller, the one the plain
path's ``CounterDropout`` draws; each block reads its slice, so the same elements are dropped.
"""
from mindspore import nn, ops


class BlockwiseAttention(nn.Cell):
    """``construct(query, key, value, bias, keep)``: query/key/value [B, N, S, D], additive ``bias``
    [1 or B, 1, S, S], ``keep`` the bool dropout keep-mask [B, N, S, S] or any tensor of another rank (no
    dropout) -> context [B, N, S, D]. ``dropout_scale`` multiplies the kept probabilities (1 / (1 - p))."""

    def __init__(self, block_size, scale, softmax_dtype, compute_dtype, dropout_scale=1.0):
        super().__init__()
        self.block_size = int(block_size)
        self.scale = scale
        self.softmax_dtype = softmax_dtype
        self.compute_dtype = compute_dtype
        self.dropout_scale = dropout_scale
        self.qk_matmul = ops.BatchMatMul(transpose_b=True)
        self.pv_matmul = ops.BatchMatMul()
        self.grad_v_matmul = ops.BatchMatMul(transpose_a=True)  # P^T dO, dS^T Q
        self.softmax = ops.Softmax(axis=-1)
        self.cast = ops.Cast()
        self.row_sum = ops.ReduceSum(keep_dims=True)

    def _probs(self, query, key, bias, start, end):
        """Softmax probabilities of query rows [start, end) over keys [0, end), as the plain path computes them."""
        scores = self.qk_matmul(query[:, :, start:end], key[:, :, :end])
        scores = self.cast(scores, self.softmax_dtype) * self.scale
        # an explicit broadcast: MindSpore 2.7.2's CPU Add holds about twice the memory when it broadcasts
        # the [1, 1, block, K] bias itself (measured: 262 vs 580 MB for 8 blocks of [12, 256, <=2048])
        scores = scores + ops.broadcast_to(self.cast(bias[:, :, start:end, :end], self.softmax_dtype), scores.shape)
        return self.softmax(scores)

    def _drop(self, probs, keep, start, end):
        return probs * self.cast(keep[:, :, start:end, :end], probs.dtype) * self.dropout_scale

    def construct(self, query, key, value, bias, keep):
        seq = query.shape[2]
        outputs = []
        count = (seq + self.block_size - 1) // self.block_size
        # unrolled (seq is static); the last, widest block first, so the narrower ones after it fit in the
        # memory it frees, and each block only after the previous one (ops.depend): MindSpore's runtime
        # launches independent kernels as soon as their inputs are ready. Measured on CPU, both together
        # lower one layer's fwd + bwd peak by ~10%; the explicit broadcasts in _probs matter far more.
        for index in range(count):
            start = (count - 1 - index) * self.block_size
            end = start + self.block_size if start + self.block_size < seq else seq
            if outputs:
                done = outputs[-1]
                query, key = ops.depend(query, done), ops.depend(key, done)
                value, bias = ops.depend(value, done), ops.depend(bias, done)
            probs = self.cast(self._probs(query, key, bias, start, end), self.compute_dtype)
            if keep.ndim == 4:
                probs = self._drop(probs, keep, start, end)
            outputs.append(self.pv_matmul(probs, value[:, :, :end]))
        if len(outputs) == 1:
            return outputs[0]
        return ops.concat(outputs[::-1], axis=2)

    def bprop(self, query, key, value, bias, keep, out, dout):
        """Gradients of Q, K, V, recomputing each block's probabilities; none for the mask and the bias."""
        batch, heads, seq, dim = query.shape
        grad_query = []
        grad_key = ops.zeros((batch, heads, seq, dim), self.softmax_dtype)
        grad_value = ops.zeros((batch, heads, seq, dim), self.softmax_dtype)
        count = (seq + self.block_size - 1) // self.block_size
        for index in range(count):
            start = (count - 1 - index) * self.block_size
            end = start + self.block_size if start + self.block_size < seq else seq
            # after the previous block (see construct)
            query, key = ops.depend(query, grad_value), ops.depend(key, grad_value)
            value, bias = ops.depend(value, grad_value), ops.depend(bias, grad_value)
            dout = ops.depend(dout, grad_value)
            probs = self._probs(query, key, bias, start, end)  # softmax dtype
            grad_out = dout[:, :, start:end]
            grad_probs = self.qk_matmul(grad_out, value[:, :, :end])  # dO V^T
            used = self.cast(probs, self.compute_dtype)
            if keep.ndim == 4:
                used = self._drop(used, keep, start, end)
                grad_probs = self._drop(grad_probs, keep, start, end)
            grad_v = self.grad_v_matmul(used, grad_out)  # [B, N, end, D]
            grad_probs = self.cast(grad_probs, self.softmax_dtype)
            # softmax backward: dS = P * (dP - sum(dP * P)), then the 1/sqrt(d) scale of the scores
            row = ops.broadcast_to(self.row_sum(grad_probs * probs, -1), probs.shape)  # explicit, as in _probs
            grad_scores = probs * (grad_probs - row)
            grad_scores = self.cast(grad_scores * self.scale, self.compute_dtype)
            grad_query.append(self.pv_matmul(grad_scores, key[:, :, :end]))
            grad_k = self.grad_v_matmul(grad_scores, query[:, :, start:end])  # [B, N, end, D]
            grad_key = grad_key + self._pad_rows(self.cast(grad_k, self.softmax_dtype), seq)
            grad_value = grad_value + self._pad_rows(self.cast(grad_v, self.softmax_dtype), seq)
        grad_query = grad_query[0] if len(grad_query) == 1 else ops.concat(grad_query[::-1], axis=2)
        return (self.cast(grad_query, query.dtype), self.cast(grad_key, key.dtype),
                self.cast(grad_value, value.dtype), ops.zeros_like(bias), ops.zeros_like(keep))

    @staticmethod
    def _pad_rows(grad, seq):
        """[B, N, end, D] -> [B, N, seq, D] with zero rows after ``end``."""
        end = grad.shape[2]
        if end == seq:
            return grad
        return ops.pad(grad, (0, 0, 0, seq - end))
