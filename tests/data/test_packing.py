"""Packed rows: several documents in one row keep apart (positions, attention, loss), in every form
MindFormers feeds them: actual_seq_len per row (MindRecord, PackingHandler), actual_seq_len offset over the
batch (MindFormers' asl_batch_wrapper), Megatron's reset attention_mask + position_ids (GPTDataset)."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.data.instruct import pack_rows, to_example
from conftest import TINY

SEQ = 48
LENGTHS = [[11, 7, 16], [20, 9]]  # two rows of documents; each row ends with padding


@pytest.fixture(scope="module")
def model():
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ)))
    model.set_train(False)
    return model


@pytest.fixture(scope="module")
def docs():
    """Token arrays per row; each document ends with the EOD token (0), no other 0 inside."""
    rng = np.random.default_rng(3)
    out = []
    for row in LENGTHS:
        out.append([np.append(rng.integers(1, TINY["vocab_size"], n - 1), 0).astype(np.int32) for n in row])
    return out


def _rows(docs, pad=0):
    ids = np.full((len(docs), SEQ), pad, np.int32)
    ends = np.full((len(docs), 8), SEQ, np.int32)
    for r, row in enumerate(docs):
        joined = np.concatenate(row)
        ids[r, :len(joined)] = joined
        ends[r, :len(row)] = np.cumsum([len(d) for d in row])
    return ids, ends


def _alone(model, doc):
    return model(Tensor(doc[None])).asnumpy()[0]


def _assert_documents_match(model, docs, packed):
    worst = 0.0
    for r, row in enumerate(docs):
        start = 0
        for doc in row:
            worst = max(worst, float(np.abs(packed[r, start:start + len(doc)] - _alone(model, doc)).max()))
            start += len(doc)
    assert worst <= 1e-5, worst


def test_actual_seq_len_per_row_and_offset_over_batch(model, docs):
    """Each document's logits in a packed row equal the document run alone (fp32, max abs diff <= 1e-5),
    for actual_seq_len as a row holds it and as MindFormers' batch map offsets it (row b + b * S)."""
    from mindformers.dataset.causal_language_model_dataset import asl_batch_wrapper
    ids, ends = _rows(docs)
    packed = model(Tensor(ids), None, None, None, None, Tensor(ends)).asnumpy()
    _assert_documents_match(model, docs, packed)
    # the batch map MindFormers applies to HFDataLoader / Megatron data with create_compressed_eod_mask
    (offset,) = asl_batch_wrapper(list(ends), None, micro_batch_num=1)
    offset = np.stack(offset)
    assert offset[1, 0] == ends[1, 0] + SEQ  # it did offset row 1
    again = model(Tensor(ids), None, None, None, None, Tensor(offset)).asnumpy()
    np.testing.assert_array_equal(again, packed)
    # without the document ends the rows do mix (the check above could fail)
    plain = model(Tensor(ids)).asnumpy()
    assert np.abs(plain[0, 11:18] - _alone(model, docs[0][1])).max() > 1e-3


def test_megatron_reset_mask_and_positions(model, docs):
    """Megatron GPTDataset's own mask and positions (reset_position_ids, reset_attention_mask) and its
    compressed EOD form (actual_seq_len from the EOD tokens) give the documents' own logits."""
    from mindformers.dataset.blended_datasets.gpt_dataset import (_get_eod_attention_mask,
                                                                  _get_ltor_masks_and_position_ids)
    ids, _ = _rows(docs, pad=5)  # padding is a token run with no EOD: one more "document"
    masks, positions, ends = [], [], []
    for row in ids:
        mask, loss_mask, pos = _get_ltor_masks_and_position_ids(row, 0, True, True, True, True)
        masks.append(mask.astype(np.int32))
        positions.append(pos.astype(np.int32))
        ends.append(_get_eod_attention_mask(row, 0, 8))
        assert loss_mask[row == 0].sum() == 0  # eod_mask_loss: no loss where the input is the EOD
    dense = model(Tensor(ids), None, None, Tensor(np.stack(positions)), Tensor(np.stack(masks))).asnumpy()
    _assert_documents_match(model, docs, dense)
    compressed = model(Tensor(ids), None, None, None, None, Tensor(np.stack(ends))).asnumpy()
    _assert_documents_match(model, docs, compressed)


def test_packed_loss_is_the_token_mean_over_documents(model, docs):
    """Training loss of a packed batch = the documents' losses run alone, weighted by their learned tokens;
    no target crosses a document (each document's last label is its own EOD)."""
    rng = np.random.default_rng(5)
    examples = []
    for row in docs:
        for doc in row:
            learned = (rng.random(len(doc)) < 0.6).astype(np.int32)
            learned[-1] = 1
            examples.append(to_example(doc, learned))
    rows = pack_rows(examples, SEQ, pad_id=0, max_docs=8)
    assert rows["input_ids"].shape[0] == 2  # the documents were packed, not one a row
    model.set_train(True)
    try:
        packed = float(model(*[Tensor(rows[k]) for k in ("input_ids", "labels", "loss_mask", "position_ids")],
                             None, Tensor(rows["actual_seq_len"]))[0].asnumpy())
        total, count = 0.0, 0
        for ids, labels, loss_mask in examples:
            loss = float(model(Tensor(ids[None]), Tensor(labels[None]), Tensor(loss_mask[None]))[0].asnumpy())
            total += loss * loss_mask.sum()
            count += loss_mask.sum()
    finally:
        model.set_train(False)
    assert packed == pytest.approx(total / count, rel=1e-5, abs=1e-6)


def test_flash_varlen_gets_document_ends_over_the_flat_batch(model, docs):
    """With flash attention (Ascend), the varlen kernel gets the ends over B * S tokens and the positions
    restart; checked here on the helper the kernel call takes its inputs from (no Ascend on this machine)."""
    from mindformers_gptlocal.model.gpt import FlashMasks
    ids, ends = _rows(docs)
    body = model.model
    saved, mode = body.masks, ms.get_context("mode")
    ms.set_context(mode=ms.PYNATIVE_MODE)
    try:
        body.masks = FlashMasks()  # the masks' form a flash-attention build picks
        positions, mask, flat = body.document_mask(Tensor(ends), 2, SEQ)
    finally:
        body.masks = saved
        ms.set_context(mode=mode)
    expected = np.concatenate([ends[0], ends[1] + SEQ])
    np.testing.assert_array_equal(flat.asnumpy(), expected)
    assert mask.shape == (2048, 2048)
    want = np.concatenate([np.concatenate([np.arange(n) for n in row] + [np.arange(SEQ - sum(row))])
                           for row in LENGTHS]).reshape(2, SEQ)
    np.testing.assert_array_equal(positions.asnumpy(), want)
