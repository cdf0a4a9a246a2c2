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


PIECE_CHARS = 1 << 18  # characters of a text file read (and tokenized) at a time: a signal is heard between pieces
BATCH_CHARS = 1 << 20  # characters tokenized in one call (one encode_batch)


def iter_pieces(files, jsonl_key="text", piece_chars=PIECE_CHARS):
    """Yield ``(document number, text)``: a document per text file or per JSONL line (its ``jsonl_key`` field),
    numbered from 0 (documents of only whitespace left out), a text file in pieces of about ``piece_chars``
    characters cut only where a GPT-2 byte-level tokenizer splits anyway (``split_points``; ``None``: one piece a
    document). Concatenated, a document's pieces are the document."""
    number = 0
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as handle:
            if path.endswith(".jsonl"):
                for line_number, line in enumerate(handle, 1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as err:
                        raise DataError(f"{path}:{line_number}: not valid JSON ({err.msg}).") from err
                    if jsonl_key not in record:
                        raise DataError(f"{path}:{line_number}: no '{jsonl_key}' field; pass --jsonl-key with the "
                                        f"field that holds the text (fields here: {', '.join(record)}).")
                    yield number, str(record[jsonl_key])
                    number += 1
            elif piece_chars is None:
                text = handle.read()
                if text.strip():
                    yield number, text
                    number += 1
            else:
                given = False
                for piece in _text_pieces(handle, piece_chars):
                    if given or piece.strip():  # the first piece holds text unless the file is only whitespace
                        yield number, piece
                        given = True
                number += given


def iter_documents(files, jsonl_key="text"):
    """Yield one document string per text file, or per JSONL line (its ``jsonl_key`` field)."""
    for _, text in iter_pieces(files, jsonl_key, piece_chars=None):
        yield text


def _text_pieces(handle, piece_chars):
    """A text file's text in pieces: each ends just after a newline with text on both sides of it."""
    carry = ""
    while True:
        chunk = handle.read(piece_chars)
        if not chunk:
            break
        searched = max(len(carry) - 1, 0)  # cuts in the carry were looked for already
        carry += chunk
        cut = last_split_point(carry, searched)
        if cut:
            yield carry[:cut]
            carry = carry[cut:]
    if carry:
        yield carry


def last_split_point(text, start=0):
    """The last index ``i > start`` (a newline at ``start`` or after) where ``text[i - 1]`` is a newline between two characters that are not
    whitespace (0: none). GPT-2's pre-tokenizer pattern (``'s|'t|... | ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|
    \\s+(?!\\S)|\\s+``, no look-behind) ends a token there in the whole text and in either part alike, so the
    tokens of the parts, joined, are the whole text's (``str.isspace`` covers more than the pattern's ``\\s``: a
    character it calls whitespace is never cut beside, which only skips a cut)."""
    end = len(text) - 1
    while True:
        newline = text.rfind("\n", start, end)
        if newline < max(start, 1):
            return 0
        if not text[newline - 1].isspace() and not text[newline + 1].isspace():
            return newline + 1
        end = newline


def splits_alike(tokenizer):
    """Whether ``tokenizer`` gives a text's tokens in pieces cut at ``last_split_point`` exactly as in one call:
    no normalizer, GPT-2's byte-level pre-tokenizer (its pattern, no prefix space), no post-processor that adds
    tokens, no added token that takes in the whitespace beside it. prepare-data's own and GPT-2's tokenizers are
    such; another ``tokenizer.json`` gets each document in one call."""
    spec = json.loads(tokenizer.to_str())
    pre, post = spec.get("pre_tokenizer") or {}, spec.get("post_processor")
    return (spec.get("normalizer") is None and pre.get("type") == "ByteLevel"
            and not pre.get("add_prefix_space", True) and pre.get("use_regex", True)
            and (post is None or post.get("type") == "ByteLevel")
            and not any(t.get("lstrip") or t.get("rstrip") for t in spec.get("added_tokens") or []))


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


def tokenize_documents(tokenizer, pieces, total):
    """List of token-id arrays, one per document, each ending with the end-of-document token. ``pieces``:
    ``(document number, text)`` in order (``iter_pieces``), tokenized about ``BATCH_CHARS`` characters a call."""
    eod = np.asarray([tokenizer.token_to_id(EOD_TOKEN)], dtype=np.int32)
    progress = Progress(total, "tokenize")
    out, parts, batch = [], [], []
    tokens = chars = 0
    current = None  # the number of the document whose parts are in ``parts``

    def flush():
        nonlocal tokens, chars, current
        for (number, _), enc in zip(batch, tokenizer.encode_batch([text for _, text in batch])):
            if number != current and current is not None:
                out.append(np.concatenate(parts + [eod]))
                parts.clear()
            current = number
            parts.append(np.asarray(enc.ids, dtype=np.int32))
            tokens += len(enc.ids) + (1 if len(parts) == 1 else 0)
        batch.clear()
        chars = 0
        progress.update(len(out), f"docs, {tokens} tokens")

    for number, text in pieces:
        batch.append((number, text))
        chars += len(text)
        if len(batch) == 64 or chars >= BATCH_CHARS:
            flush()
    if batch:
        flush()
    if parts:
        out.append(np.concatenate(parts + [eod]))
        progress.update(len(out), f"docs, {tokens} tokens")
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
            model_config=None, fmt="text", too_long="truncate", pack=True, piece_chars=PIECE_CHARS):
    """Build the tokenizer, tokenize, and write both dataset formats plus a model directory.

    ``fmt`` 'alpaca' or 'chat' reads instruction records instead of text (``instruct.py``): MindRecord
    only, with the prompt masked out of the loss, ``pack``ed several records a row with ``actual_seq_len``;
    ``too_long`` says what a record longer than seq_length gets ('truncate' the prompt, or 'error').
    ``piece_chars``: text files are read and tokenized in pieces of about that many characters (``iter_pieces``;
    None: whole), which gives the same tokens. Returns a summary dict (also written to ``<out>/meta.json``).
    """
    check_numbers(seq_length, vocab_size, eval_fraction, max_bytes)
    if fmt != "text":
        return _prepare_instruct(inputs, out, seq_length, vocab_size, tokenizer_path, vocab, merges,
                                 eval_fraction, overwrite, model_config, fmt, too_long, pack)
    out = os.path.abspath(out)
    files = stdlib_sources(max_bytes) if not inputs else _limit(collect_files(inputs), max_bytes)
    return write_folder(out, lambda folder: _with_meta(folder, out, _prepare_into(
        folder, files, seq_length, vocab_size, tokenizer_path, vocab, merges, jsonl_key, eval_fraction, model_config,
        piece_chars)), DataError, overwrite=overwrite, overwrite_flag="--overwrite")


def _with_meta(folder, out, summary):
    """The summary with ``out``'s paths, written to ``meta.json`` inside the folder before it is renamed."""
    summary = _absolute_paths(summary, folder, out)
    with open(os.path.join(folder, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    return summary


def _prepare_into(staging, files, seq_length, vocab_size, tokenizer_path, vocab, merges, jsonl_key,
                  eval_fraction, model_config, piece_chars=PIECE_CHARS):
    started = time.time()
    # a new BPE learns from pieces (the same words as whole documents: last_split_point); a given tokenizer gets
    # them if it splits alike (splits_alike), else whole documents
    tokenizer = build_tokenizer(lambda: (text for _, text in iter_pieces(files, jsonl_key, piece_chars)),
                                vocab_size, tokenizer_path, vocab, merges)
    docs = tokenize_documents(tokenizer, iter_pieces(files, jsonl_key, piece_chars if splits_alike(tokenizer) else None),
                              _count_documents(files))
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

    return write_folder(out, lambda folder: _with_meta(folder, out, build(folder)), DataError,
                        overwrite=overwrite, overwrite_flag="--overwrite")


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
