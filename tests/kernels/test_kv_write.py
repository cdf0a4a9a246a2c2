"""The in-place KV-cache write (kernels/cells/kv_write.py): ScatterNdUpdate's values, only the updated rows touched,
ordered before the reads that follow it; and a decode cache written up to its last row."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.cells.kv_write import in_place_scatter_nd_update, kernel_library
from conftest import TINY


@pytest.fixture(scope="module", autouse=True)
def graph_mode():
    ms.set_context(mode=ms.GRAPH_MODE)
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture(scope="module")
def library():
    path = kernel_library()
    assert path is not None, "g++ is on this machine: the kernel must build"
    return path


class Writes(nn.Cell):
    """Two writes into one cache Parameter, each followed by a read of the whole cache (as attention reads
    the cache right after writing it): the reads show whether each write landed before them."""

    def __init__(self, cache, op):
        super().__init__()
        self.cache = Parameter(Tensor(cache), name="cache", requires_grad=False)
        self.op = op

    def construct(self, index1, updates1, index2, updates2):
        first = ops.depend(self.cache, self.op(self.cache, index1, updates1)) * 1.0
        second = ops.depend(self.cache, self.op(self.cache, index2, updates2)) * 1.0
        return first, second


def _triples(slots, heads, positions):
    """(slot, head, position) [B, G, S, 3], as KVCache.write_index builds them."""
    batch, seq = positions.shape
    shape = (batch, heads, seq)
    return np.stack([np.broadcast_to(slots[:, None, None], shape), np.broadcast_to(np.arange(heads)[None, :, None],
                     shape), np.broadcast_to(positions[:, None, :], shape)], -1).astype(np.int32)


@pytest.mark.parametrize("dtype,index_dtype", [(np.float32, np.int32), (np.float16, np.int64)])
def test_in_place_write_has_scatter_nd_update_values_and_reads_see_it(library, dtype, index_dtype):
    """Odd shapes, ragged per-row positions including the cache's last row, S > 1 and a row subset (slots):
    the cache after each write and the reads after it equal MindSpore's ScatterNdUpdate's exactly."""
    rng = np.random.default_rng(0)
    slots_total, heads, length, dim = 3, 2, 37, 5
    cache = rng.standard_normal((slots_total, heads, length, dim)).astype(dtype)
    first = _triples(np.array([2, 0]), heads, np.array([[35, 36], [0, 1]])).astype(index_dtype)
    second = _triples(np.array([0, 1, 2]), heads, np.array([[36], [17], [0]])).astype(index_dtype)
    updates1 = rng.standard_normal((2, heads, 2, dim)).astype(dtype)
    updates2 = rng.standard_normal((3, heads, 1, dim)).astype(dtype)
    args = [Tensor(a) for a in (first, updates1, second, updates2)]
    ours_cell, plain_cell = Writes(cache, in_place_scatter_nd_update(library)), Writes(cache, ops.ScatterNdUpdate())
    ours, plain = ours_cell(*args), plain_cell(*args)
    expected = cache.copy()
    for index, updates in ((first, updates1), (second, updates2)):
        expected[tuple(np.moveaxis(index.reshape(-1, 3), -1, 0))] = updates.reshape(-1, dim)
        if index is first:
            after_first = expected.copy()
    for mine, theirs, want in zip(ours, plain, (after_first, expected)):
        np.testing.assert_array_equal(mine.asnumpy(), theirs.asnumpy())
        np.testing.assert_array_equal(mine.asnumpy(), want)
    np.testing.assert_array_equal(ours_cell.cache.asnumpy(), expected)


def test_in_place_write_over_leading_axes_only(library):
    """An index over the first axis alone writes whole [G, L, D] slices (ScatterNdUpdate's general form)."""
    rng = np.random.default_rng(1)
    cache = rng.standard_normal((4, 3, 6, 2)).astype(np.float32)
    index = np.array([[3], [1]], np.int32)
    updates = rng.standard_normal((2, 3, 6, 2)).astype(np.float32)
    ours, plain = (Writes(cache, op) for op in (in_place_scatter_nd_update(library), ops.ScatterNdUpdate()))
    args = [Tensor(index), Tensor(updates), Tensor(index[:1]), Tensor(updates[1:])]
    for mine, theirs in zip(ours(*args), plain(*args)):
        np.testing.assert_array_equal(mine.asnumpy(), theirs.asnumpy())


def test_out_of_range_index_is_an_error_not_a_stray_write(library):
    cache = np.zeros((2, 1, 4, 3), np.float32)
    cell = Writes(cache, in_place_scatter_nd_update(library))
    bad = _triples(np.array([0]), 1, np.array([[4]]))  # row 4 of a 4-row cache
    good = _triples(np.array([0]), 1, np.array([[0]]))
    with pytest.raises(RuntimeError):
        cell(Tensor(bad), Tensor(np.ones((1, 1, 1, 3), np.float32)), Tensor(good),
             Tensor(np.ones((1, 1, 1, 3), np.float32)))[0].asnumpy()


def test_a_cache_filled_to_its_last_row_has_the_full_forward_logits(library):
    """Ragged rows decoded until one reaches the cache's last row (63 of 64): each step's logits equal the
    uncached forward's. The model's attention writes with the in-place kernel here (CPU; the compiled runner's
    graphs: ``cpu_kernels: {runner: plain}``)."""
    ms.set_seed(3)
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY, cpu_kernels={"runner": "plain"}))
    model.set_train(False)
    assert isinstance(model.model.layers[0].attention.cache.scatter_update, ops.Custom)
    plain = GPTLocalForCausalLM(GPTLocalConfig(**TINY, cpu_kernels={"kv_write": "plain"}))
    assert isinstance(plain.model.layers[0].attention.cache.scatter_update, ops.ScatterNdUpdate)  # the plain write
    rng = np.random.default_rng(2)
    prompts = [rng.integers(1, 512, n).tolist() for n in (59, 3, 40)]
    cache = model.kv_cache(len(prompts), 64)
    assert cache.max_length == 64
    logits = cache.prefill(prompts)
    sequences = [list(p) for p in prompts]
    for step in range(6):  # row 0's decodes write rows 59..63
        block = np.zeros((len(sequences), 64), np.int32)
        for row, seq in enumerate(sequences):
            block[row, :len(seq)] = seq
        full = model(Tensor(block, ms.int32)).asnumpy()
        for row, seq in enumerate(sequences):
            np.testing.assert_allclose(logits[row], full[row, len(seq) - 1], rtol=1e-4, atol=1e-4,
                                       err_msg=f"step {step}, row {row}")
        if step == 5:
            break
        tokens = rng.integers(1, 512, len(sequences))
        logits = cache.decode(tokens, [len(seq) for seq in sequences])
        for seq, token in zip(sequences, tokens):
            seq.append(int(token))
    assert len(sequences[0]) == 64  # its last token went to the cache's last row, 63
