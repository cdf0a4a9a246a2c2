"""GPTLocalInstructHandler: Alpaca and chat records in MindFormers' ``HFDataLoader`` (a YAML ``handler:``).

The same templates, loss mask and packed rows as ``gptlocal prepare-data --format alpaca|chat``
(``data/instruct.py``), from a JSON/JSONL file that ``datasets.load_dataset('json', ...)`` reads.
Why not MindFormers' own handlers: in 1.8, ``AlpacaInstructDataHandler`` ends a response with the
text "</s>" (not the tokenizer's EOS) and reads no chat records, and ``PackingHandler`` ('pack')
shifts the labels it gets once more (``labels[1:]``), so Alpaca + PackingHandler trains each token
on the one two places ahead (tests/data/test_instruct_data.py shows it). This handler packs by itself;
set ``create_attention_mask: True`` and ``create_compressed_eod_mask: True`` on the HFDataLoader so it
yields ``input_ids, labels, loss_mask, position_ids, actual_seq_len`` (its packed-data path).
"""
from ..data import instruct
from ..errors import ConfigError
from .symbols import BaseInstructDataHandler, MindFormerRegister, MindFormerModuleType


class _Encoder:
    """A Hugging Face tokenizer seen as ``tokenizers.Tokenizer`` (``encode(text).ids``, no special tokens)."""

    class _Ids:
        def __init__(self, ids):
            self.ids = ids

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's own tokenizers.Tokenizer

    def encode(self, text):
        if self.backend is not None:
            return self._Ids(self.backend.encode(text, add_special_tokens=False).ids)
        return self._Ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@MindFormerRegister.register(MindFormerModuleType.DATA_HANDLER)
class GPTLocalInstructHandler(BaseInstructDataHandler):
    """``format``: alpaca or chat; ``too_long``: truncate (the prompt's start) or error; ``pack``: several
    records a row (rows as ``PackingHandler`` yields them) or one record a row, padded; ``max_docs``:
    at most this many records a row, the HFDataLoader's ``compressed_eod_mask_length``."""

    def __init__(self, seq_length, format="alpaca", too_long="truncate", pack=True, max_docs=128,  # noqa: A002
                 **kwargs):
        super().__init__(**kwargs)
        if format not in instruct.FORMATS:
            raise ConfigError(f"train_dataset.data_loader.handler GPTLocalInstructHandler.format is {format!r}; set "
                              f"it to {' or '.join(instruct.FORMATS)}.")
        if too_long not in instruct.TOO_LONG:
            raise ConfigError(f"train_dataset.data_loader.handler GPTLocalInstructHandler.too_long is {too_long!r}; "
                              f"set it to {' or '.join(instruct.TOO_LONG)}.")
        if self.tokenizer is None:
            raise ConfigError("train_dataset.data_loader.handler GPTLocalInstructHandler has no tokenizer (tokenizer: "
                              "None); set pretrained_model_dir to a model directory with tokenizer.json and "
                              "`tokenizer: {}` under the handler.")
        self.seq_length, self.format, self.too_long = seq_length, format, too_long
        self.pack, self.max_docs = pack, max_docs

    def __call__(self, dataset):
        from datasets import Dataset
        make = instruct.alpaca_segments if self.format == "alpaca" else instruct.chat_segments
        encoder, eos = _Encoder(self.tokenizer), self.tokenizer.eos_token_id
        examples = []
        for number, record in enumerate(dataset, 1):
            where = f"record {number} of the dataset"
            ids, learned = instruct.encode_segments(encoder, make(record, where), eos)
            examples.append(instruct.to_example(*instruct.fit_record(ids, learned, self.seq_length,
                                                                     self.too_long, where)))
        rows = instruct.pack_rows(examples, self.seq_length, self.pad_token_id, self.pack, self.max_docs)
        if not self.pack:
            return Dataset.from_dict({k: rows[k].tolist() for k in ("input_ids", "labels", "loss_mask",
                                                                    "position_ids")})
        # MindFormers' packed path pads actual_seq_len itself: give the record ends, then seq_length
        ends = [[int(e) for e in row if e < self.seq_length] + [self.seq_length] for row in rows["actual_seq_len"]]
        return Dataset.from_dict({"input_ids": rows["input_ids"].tolist(), "labels": rows["labels"].tolist(),
                                  "actual_seq_len": ends})
