"""``gptlocal prepare-data``: text files, a folder or JSONL -> tokenizer + MindRecord + Megatron .bin/.idx.

Everything is written under ``<out>.partial-<pid>`` and renamed into place at the
end, so a failed or interrupted run leaves no half-written output behind.
"""
import glob
import json
import os
import struct
import sys
import sysconfig
import time

import numpy as np

from ..errors import DataError
from ..staging import write_folder
from ..tokenizer_id import id_of_tokenizer
from .tokenizer import EOD_TOKEN, build_tokenizer, save_model_dir

TEXT_SUFFIXES = (".txt", ".py", ".md", ".rst", ".jsonl", ".json")


def stdlib_sources(max_bytes=None):
    """The running Python's own standard-library ``.py`` files: a corpus every machine has."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "*", "*.py")))
    files = [f for f in files if "site-packages" not in f and "test" not in os.path.relpath(f, root).split(os.sep)[0]]
    return _limit(files, max_bytes)


def _limit(files, max_bytes):
    if not max_bytes:
        return files
    chosen, total = [], 0
    for path in files:
        size = os.path.getsize(path)
        if total + size > max_bytes and chosen:
            break
        chosen.append(path)
        total += size
    return chosen


TEXT_PROBE_BYTES = 8192


def check_numbers(seq_length=256, vocab_size=8192, eval_fraction=0.05, max_bytes=None):
    """prepare-data's numbers, before anything is read or written: each a ``DataError`` naming its flag."""
    def whole(flag, value, low):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise DataError(f"{flag} must be an integer >= {low}, got {value!r}.")
    whole("--seq-length", seq_length, 1)
    whole("--vocab-size", vocab_size, 1)
    if max_bytes is not None:
        whole("--max-bytes", max_bytes, 1)
    if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) or \
            not 0 <= eval_fraction < 1:
        raise DataError(f"--eval-fraction must be a share in [0, 1), got {eval_fraction!r}.")


def check_text_file(path):
    """A file given as input is text: its first bytes hold no NUL and decode as UTF-8 (an executable, an image
    or an archive would otherwise be tokenised into a training set)."""
    with open(path, "rb") as handle:
        head = handle.read(TEXT_PROBE_BYTES)
    if b"\0" in head:
        raise DataError(f"--input {path} is not a text file (it holds NUL bytes: a binary file); give text "
                        f"files, a folder of them, or .jsonl.")
    try:
        head.decode("utf-8")
    except UnicodeDecodeError as err:
        if err.start < len(head) - 3:  # not just a character cut at the probe's end
            raise DataError(f"--input {path} is not UTF-8 text (byte {err.start}: {err.reason}); convert it to "
                            f"UTF-8 or give text files, a folder of them, or .jsonl.") from err


def collect_files(inputs):
    """Expand files and folders into a sorted list of text files."""
    files = []
    for item in inputs:
        if os.path.isdir(item):
            for root, _, names in os.walk(item):
                files += [os.path.join(root, n) for n in names if n.endswith(TEXT_SUFFIXES)]
        elif os.path.isfile(item):
            files.append(item)
        else:
            raise DataError(f"--input {item}: no such file or folder. Give a text file, a folder of text files "
                            f"or a .jsonl file.")
    if not files:
        raise DataError(f"--input {' '.join(inputs)}: no text files found (looked for {', '.join(TEXT_SUFFIXES)}).")
    for path in files:
        check_text_file(path)
    return sorted(files)


def iter_documents(files, jsonl_key="text"):
    """Yield one document string per text file, or per JSONL line (its ``jsonl_key`` field)."""
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as handle:
            if path.endswith(".jsonl"):
                for number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise DataError(f"{path}:{number}: not valid JSON ({err.msg}).") from err
                    if jsonl_key not in record:
                        raise DataError(f"{path}:{number}: no '{jsonl_key}' field; pass --jsonl-key with the "
                                        f"field that holds the text (fields here: {', '.join(record)}).")
                    yield str(record[jsonl_key])
            else:
                text = handle.read()
                if text.strip():
                    yield text


class Progress:
    """One status line on stderr, at most every half second."""

    def __init__(self, total, label):
        self.total, self.label, self.last, self.start = total, label, 0.0, time.time()

    def update(self, done, extra=""):
        now = time.time()
        if now - self.last < 0.5 and done < self.total:
            return
        self.last = now
        rate = done / max(now - self.start, 1e-9)
        sys.stderr.write(f"\r{self.label}: {done}/{self.total} {extra} ({rate:.0f}/s)   ")
        if done >= self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def tokenize_documents(tokenizer, documents, total):
    """List of token-id arrays, one per document, each ending with the end-of-document token."""
    eod = tokenizer.token_to_id(EOD_TOKEN)
    progress = Progress(total, "tokenize")
    out, batch = [], []
    tokens = 0

    def flush():
        nonlocal tokens
        for enc in tokenizer.encode_batch(batch):
            out.append(np.asarray(enc.ids + [eod], dtype=np.int32))
            tokens += len(enc.ids) + 1
        batch.clear()
        progress.update(len(out), f"docs, {tokens} tokens")

    for doc in documents:
        batch.append(doc)
        if len(batch) == 64:
            flush()
    if batch:
        flush()
    return out


def pack_samples(docs, seq_length):
    """Concatenate documents and cut windows of seq_length + 1 tokens (input and shifted labels)."""
    stream = np.concatenate(docs) if docs else np.zeros((0,), np.int32)
    count = (len(stream) - 1) // seq_length
    if count < 1:
        raise DataError(f"the corpus has {len(stream)} tokens, fewer than seq_length + 1 = {seq_length + 1}; "
                        f"give more text or a smaller --seq-length.")
    return np.stack([stream[i * seq_length: i * seq_length + seq_length + 1] for i in range(count)])


def write_mindrecord(path, windows):
    """MindRecord with MindFormers' causal-LM columns: input_ids, labels, loss_mask, position_ids."""
    from mindspore.mindrecord import FileWriter
    seq = windows.shape[1] - 1
    writer = FileWriter(path, shard_num=1, overwrite=True)
    writer.set_page_size(1 << 22)
    writer.add_schema({name: {"type": "int32", "shape": [-1]}
                       for name in ("input_ids", "labels", "loss_mask", "position_ids")}, "gpt_local")
    positions = np.arange(seq, dtype=np.int32)
    ones = np.ones(seq, dtype=np.int32)
    rows = [{"input_ids": w[:-1], "labels": w[1:], "loss_mask": ones, "position_ids": positions} for w in windows]
    for start in range(0, len(rows), 1024):
        writer.write_raw_data(rows[start:start + 1024])
    writer.commit()


MEGATRON_HEADER = b"MMIDIDX\x00\x00"  # Megatron's indexed dataset, version 1 (MindFormers' IndexedDataset reads it)
MEGATRON_INT32 = 4  # the format's code of the token dtype


def write_megatron(prefix, docs):
    """Megatron ``.bin/.idx``, one document per entry, int32 tokens: the ``.bin`` the documents back to back; the
    ``.idx`` the header, version 1, the dtype code, the counts, each entry's length (int32) and byte offset (int64),
    the document boundaries (int64). What MindFormers' ``IndexedDatasetBuilder`` writes (``tests/data``: its
    ``IndexedDataset`` reads ours), without importing MindFormers."""
    lengths = np.array([len(doc) for doc in docs], np.int32)
    with open(prefix + ".bin", "wb") as handle:
        for doc in docs:
            handle.write(np.asarray(doc, np.int32).tobytes(order="C"))
    offsets = np.zeros(len(docs), np.int64)
    offsets[1:] = np.cumsum(lengths[:-1].astype(np.int64) * 4)
    with open(prefix + ".idx", "wb") as handle:
        handle.write(MEGATRON_HEADER + struct.pack("<Q", 1) + struct.pack("<B", MEGATRON_INT32))
        handle.write(struct.pack("<Q", len(docs)) + struct.pack("<Q", len(docs) + 1))
        handle.write(lengths.tobytes() + offsets.tobytes() + np.arange(len(docs) + 1, dtype=np.int64).tobytes())


def prepare(inputs=None, out="data", seq_length=256, vocab_size=8192, tokenizer_path=None, vocab=None,
            merges=None, jsonl_key="text", eval_fraction=0.05, max_bytes=None, overwrite=False,
            model_config=None, fmt="text", too_long="truncate", pack=True):
    """Build the tokenizer, tokenize, and write both dataset formats plus a model directory.

    ``fmt`` 'alpaca' or 'chat' reads instruction records instead of text (``instruct.py``): MindRecord
    only, with the prompt masked out of the loss, ``pack``ed several records a row with ``actual_seq_len``;
    ``too_long`` says what a record longer than seq_length gets ('truncate' the prompt, or 'error').
    Returns a summary dict (also written to ``<out>/meta.json``).
    """
    check_numbers(seq_length, vocab_size, eval_fraction, max_bytes)
    if fmt != "text":
        return _prepare_instruct(inputs, out, seq_length, vocab_size, tokenizer_path, vocab, merges,
                                 eval_fraction, overwrite, model_config, fmt, too_long, pack)
    out = os.path.abspath(out)
    files = stdlib_sources(max_bytes) if not inputs else _limit(collect_files(inputs), max_bytes)
    staging = f"{out}.partial-{os.getpid()}"
    summary = write_folder(out, lambda folder: _prepare_into(folder, files, seq_length, vocab_size, tokenizer_path,
                                                             vocab, merges, jsonl_key, eval_fraction, model_config),
                           DataError, overwrite=overwrite, overwrite_flag="--overwrite")
    summary = _absolute_paths(summary, staging, out)
    with open(os.path.join(out, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    return summary


def _prepare_into(staging, files, seq_length, vocab_size, tokenizer_path, vocab, merges, jsonl_key,
                  eval_fraction, model_config):
    started = time.time()
    tokenizer = build_tokenizer(lambda: iter_documents(files, jsonl_key), vocab_size, tokenizer_path, vocab, merges)
    docs = tokenize_documents(tokenizer, iter_documents(files, jsonl_key), _count_documents(files))
    if not docs:
        raise DataError("the input holds no documents (every file is empty).")
    train_docs, eval_docs = split_documents(docs, eval_fraction, seq_length)
    train = pack_samples(train_docs, seq_length)
    write_mindrecord(os.path.join(staging, "train.mindrecord"), train)
    summary = {"files": len(files), "documents": len(docs), "tokens": int(sum(len(d) for d in docs)),
               "vocab_size": tokenizer.get_vocab_size(), "eod_token_id": tokenizer.token_to_id(EOD_TOKEN),
               "tokenizer_id": id_of_tokenizer(tokenizer), "seq_length": seq_length, "train_samples": int(len(train)),
               "train_mindrecord": os.path.join(staging, "train.mindrecord"),
               "megatron_prefix": os.path.join(staging, "megatron", "train_text_document"),
               "model_dir": os.path.join(staging, "model")}
    if eval_docs:
        evals = pack_samples(eval_docs, seq_length)
        write_mindrecord(os.path.join(staging, "eval.mindrecord"), evals)
        summary["eval_samples"] = int(len(evals))
        summary["eval_mindrecord"] = os.path.join(staging, "eval.mindrecord")
    os.makedirs(os.path.join(staging, "megatron"))
    write_megatron(summary["megatron_prefix"], train_docs)
    save_model_dir(os.path.join(staging, "model"), tokenizer, seq_length, model_config)
    summary["seconds"] = round(time.time() - started, 1)
    return summary


def _prepare_instruct(inputs, out, seq_length, vocab_size, tokenizer_path, vocab, merges, eval_fraction,
                      overwrite, model_config, fmt, too_long, pack):
    from . import instruct
    if fmt not in instruct.FORMATS:
        raise DataError(f"--format {fmt}: choose text, {' or '.join(instruct.FORMATS)}.")
    if too_long not in instruct.TOO_LONG:
        raise DataError(f"--too-long {too_long}: choose {' or '.join(instruct.TOO_LONG)}.")
    if not inputs:
        raise DataError(f"--format {fmt} needs --input: .json or .jsonl files (or folders) of records.")
    out = os.path.abspath(out)
    files = collect_files(inputs)
    staging = f"{out}.partial-{os.getpid()}"

    def build(folder):
        started = time.time()
        make = instruct.alpaca_segments if fmt == "alpaca" else instruct.chat_segments

        def texts():  # what a new BPE learns from when no tokenizer is given
            for path in files:
                for line, record in instruct.read_records(path):
                    yield "".join(t for t, _ in make(record, f"{path}:{line}") if t)
        tokenizer = build_tokenizer(texts, vocab_size, tokenizer_path, vocab, merges)
        eos = tokenizer.token_to_id(EOD_TOKEN)
        summary = instruct.prepare_instruct(folder, files, fmt, tokenizer, eos, seq_length, too_long, pack,
                                            eval_fraction)
        summary.update({"files": len(files), "vocab_size": tokenizer.get_vocab_size(), "eod_token_id": eos,
                        "tokenizer_id": id_of_tokenizer(tokenizer),
                        "seq_length": seq_length, "too_long": too_long,
                        "model_dir": os.path.join(folder, "model")})
        save_model_dir(summary["model_dir"], tokenizer, seq_length, model_config,
                       chat_template=instruct.CHAT_TEMPLATE)
        summary["seconds"] = round(time.time() - started, 1)
        return summary

    summary = write_folder(out, build, DataError, overwrite=overwrite, overwrite_flag="--overwrite")
    summary = _absolute_paths(summary, staging, out)
    with open(os.path.join(out, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    return summary


def split_documents(docs, eval_fraction, seq_length):
    """Hold out the first documents for eval: at least ``eval_fraction`` of them, and enough for one
    window of seq_length + 1 tokens, as long as the rest still fill a training window."""
    if eval_fraction <= 0 or len(docs) < 2:
        return docs, []
    n_eval = max(1, int(len(docs) * eval_fraction))
    while sum(len(d) for d in docs[:n_eval]) <= seq_length and n_eval < len(docs) - 1:
        n_eval += 1
    held, rest = docs[:n_eval], docs[n_eval:]
    if sum(len(d) for d in held) <= seq_length or sum(len(d) for d in rest) <= seq_length:
        return docs, []  # too little text to hold any out; eval falls back to the train file
    return rest, held


def _count_documents(files):
    """How many documents iter_documents will yield (a JSONL file holds one per non-empty line)."""
    count = 0
    for path in files:
        if path.endswith(".jsonl"):
            with open(path, encoding="utf-8", errors="replace") as handle:
                count += sum(1 for line in handle if line.strip())
        else:
            count += 1
    return count


def _absolute_paths(summary, staging, out):
    return {k: (v.replace(staging, out) if isinstance(v, str) else v) for k, v in summary.items()}
