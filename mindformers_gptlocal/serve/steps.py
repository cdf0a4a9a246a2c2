"""The server's compiled multi-token call: ``SlotGreedySteps``, ``KVCache.decode_greedy``'s ``GreedySteps`` over
the rows' own cache slots.

``GreedySteps`` (``model/kv_cache.py``) runs k greedy decode steps in ONE graph, the argmax on the device and
only the [B, k] token ids coming back; it reads slots 0..B-1 of a cache of exactly B slots. The server decodes
b <= max_batch_size rows that sit in any of its slots, so here the slots are a call input (as
``KVCache.step(..., slots=)``): with b < the cache's slots attention reads only those slots. Imported by the
engine's worker thread only (it needs MindSpore).
"""
from mindspore import ops

from ..model.kv_cache import GreedySteps


class SlotGreedySteps(GreedySteps):
    """``steps`` greedy steps of ``cache`` for b rows in the cache slots ``slots`` [b]: tokens, positions [b, 1]
    -> picked tokens [b, steps]. Positions past the cache's last row are clamped to it (steps the caller
    discards)."""

    def construct(self, tokens, positions, slots):
        last_index = ops.zeros_like(slots)
        picked = ()
        for _ in range(self.steps):
            logits = self.cache(tokens, ops.minimum(positions, self.last_row), slots, last_index)
            tokens = ops.expand_dims(self.argmax(logits), 1)
            positions = positions + 1
            picked = picked + (tokens,)
        return ops.concat(picked, 1)
