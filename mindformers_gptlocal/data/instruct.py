"""Instruction data (SFT): Alpaca and chat records -> token ids with a loss mask, and packing.

A record becomes segments of text, each marked learned (the response) or not (the prompt);
each segment is tokenized on its own, so the prompt/response boundary falls on a token edge
and the loss mask is exact. Templates (README "Finetune on your instructions"):

- Alpaca ``{"instruction", "input"?, "output"}``: MindFormers' ``AlpacaInstructDataHandler``
  prompt text, then ``"\\n"`` (prompt, loss 0), then ``output`` + EOS (learned, loss 1).
- Chat ``{"messages": [{"role", "content"}, ...]}``: every turn is ``"{role}: {content}"`` + EOS;
  the ``"assistant: "`` prefix is prompt, each assistant ``content`` + its EOS is learned.
  ``CHAT_TEMPLATE`` is the same text as a Jinja template for ``tokenizer_config.json``.

Rows follow MindFormers' packed layout (``PackingHandler`` + ``HFDataLoader``): ``input_ids``,
``labels`` (already shifted; -100 outside responses), ``loss_mask``, ``position_ids`` (restarting
at each record) and ``actual_seq_len`` (cumulative record ends, padded with seq_length).
We write this ourselves instead of running MindFormers' handlers because those need the
``datasets`` pipeline and a MindFormers tokenizer at training time; this file has neither.
"""
import json
import os

import numpy as np

from ..errors import DataError

FORMATS = ("alpaca", "chat")
TOO_LONG = ("truncate", "error")
IGNORE = -100
ROLES = ("system", "user", "assistant")

# The same text as MindFormers 1.8 AlpacaInstructDataHandler.prompt_with_input / prompt_without_input
# (tests/data/test_instruct_data.py compares them).
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:")
ALPACA_PROMPT_WITHOUT_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:")

# Chat template for Hugging Face's apply_chat_template: the text render_chat gives, EOS after every turn.
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def read_records(path):
    """Yield ``(line_number, record)`` from a JSONL file (one object a line) or a JSON file (an array of
    objects, as Alpaca's own alpaca_data.json); the line is where the record starts."""
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if path.endswith(".jsonl") or not text.lstrip().startswith("["):
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{number}: not valid JSON ({err.msg}); give one JSON object per line.") \
                    from err
        return
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        line = text.count("\n", 0, pos) + 1
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{text.count(chr(10), 0, err.pos) + 1}: not valid JSON ({err.msg}).") from err
        yield line, record


def alpaca_segments(record, where):
    """[(text, learned)] of one Alpaca record."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: an Alpaca record must be a JSON object with 'instruction' and 'output'.")
    for key in ("instruction", "output"):
        if not isinstance(record.get(key), str) or not record[key].strip():
            raise DataError(f"{where}: '{key}' is missing or empty; an Alpaca record needs a non-empty "
                            f"'instruction' and 'output' (and an optional 'input').")
    extra = record.get("input", "")
    if not isinstance(extra, str):
        raise DataError(f"{where}: 'input' must be a string.")
    template = ALPACA_PROMPT_WITH_INPUT if extra.strip() else ALPACA_PROMPT_WITHOUT_INPUT
    prompt = template.format(instruction=record["instruction"], input=extra)
    return [(prompt + "\n", False), (record["output"], True), (None, True)]  # None = the EOS token


def chat_segments(record, where):
    """[(text, learned)] of one chat record: ``{role}: {content}`` + EOS per turn, assistant content learned."""
    messages = record.get("messages") if isinstance(record, dict) else None
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: a chat record needs 'messages': a non-empty list of "
                        f"{{'role': 'system'|'user'|'assistant', 'content': '...'}}.")
    segments = []
    for index, message in enumerate(messages):
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ROLES or not isinstance(content, str):
            raise DataError(f"{where}: messages[{index}] must be {{'role': one of {', '.join(ROLES)}, "
                            f"'content': a string}}; got {json.dumps(message)[:80]}.")
        learned = role == "assistant"
        if learned and not content.strip():
            raise DataError(f"{where}: messages[{index}] is an empty assistant reply.")
        segments += [(f"{role}: ", False), (content, learned), (None, learned)]
    if messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: the last message must be the assistant's (the reply to learn); "
                        f"it is '{messages[-1]['role']}'.")
    return segments


def render_chat(messages, eos_text, add_generation_prompt=False):
    """The text CHAT_TEMPLATE renders: what a chat prompt at inference time looks like."""
    text = "".join(f"{m['role']}: {m['content']}{eos_text}" for m in messages)
    return text + ("assistant: " if add_generation_prompt else "")


def encode_segments(tokenizer, segments, eos_id):
    """Token ids and a per-token learned flag (1 for response tokens, 0 for prompt tokens)."""
    ids, learned = [], []
    for text, learn in segments:
        piece = [eos_id] if text is None else tokenizer.encode(text).ids
        ids += piece
        learned += [int(learn)] * len(piece)
    return np.asarray(ids, np.int32), np.asarray(learned, np.int32)


def fit_record(ids, learned, seq_length, too_long, where):
    """At most seq_length + 1 tokens (seq_length input/label pairs): drop tokens from the prompt side
    (the start) with too_long='truncate', else raise. The last response is never cut."""
    if len(ids) <= seq_length + 1:
        return ids, learned
    if too_long == "error":
        raise DataError(f"{where}: the record has {len(ids)} tokens, more than seq_length + 1 = "
                        f"{seq_length + 1}; raise --seq-length, shorten it, or pass --too-long truncate.")
    last_prompt = np.flatnonzero(learned == 0)[-1]  # the token just before the final response
    drop = len(ids) - (seq_length + 1)
    if drop > last_prompt:
        raise DataError(f"{where}: its last response has {len(ids) - last_prompt - 1} tokens, more than "
                        f"seq_length = {seq_length} can hold after one prompt token; raise --seq-length.")
    return ids[drop:], learned[drop:]


def tokenize_records(tokenizer, files, fmt, seq_length, too_long, eos_id):
    """List of (ids, learned) arrays, one per record, in file order."""
    make = alpaca_segments if fmt == "alpaca" else chat_segments
    out = []
    for path in files:
        count = 0
        for line, record in read_records(path):
            where = f"{path}:{line}"
            ids, learned = encode_segments(tokenizer, make(record, where), eos_id)
            out.append(fit_record(ids, learned, seq_length, too_long, where))
            count += 1
        if not count:
            raise DataError(f"{path}: no records; give JSONL (one object a line) or a JSON array of records.")
    return out


def to_example(ids, learned):
    """One record as shifted pairs: input ids[:-1], labels ids[1:] (-100 where not learned), loss mask."""
    loss_mask = learned[1:].astype(np.int32)
    labels = np.where(loss_mask == 1, ids[1:], IGNORE).astype(np.int32)
    return ids[:-1].astype(np.int32), labels, loss_mask


def pack_rows(examples, seq_length, pad_id, pack=True, max_docs=None):
    """Rows of seq_length: several records each (``pack``) in order, a new row when the next does not
    fit (MindFormers' PackingHandler 'pack' strategy), or one record a row. Returns a dict of arrays:
    input_ids, labels, loss_mask, position_ids [R, S] and actual_seq_len [R, max_docs] (cumulative
    record ends in the row, padded with seq_length; the padded tail is its own, unlearned segment)."""
    max_docs = max_docs or min(seq_length, 128)
    rows, current = [], []

    def flush():
        if current:
            rows.append(list(current))
            current.clear()

    for example in examples:
        used = sum(len(e[0]) for e in current)
        # keep one slot free so actual_seq_len always ends with seq_length (flash attention's TND form needs it)
        if not pack or used + len(example[0]) > seq_length or len(current) >= max_docs - 1:
            flush()
        current.append(example)
    flush()
    out = {k: np.zeros((len(rows), seq_length), np.int32) for k in ("input_ids", "labels", "loss_mask",
                                                                    "position_ids")}
    out["input_ids"][:] = pad_id
    out["labels"][:] = IGNORE
    out["actual_seq_len"] = np.full((len(rows), max_docs), seq_length, np.int32)
    for r, row in enumerate(rows):
        start = 0
        for d, (ids, labels, loss_mask) in enumerate(row):
            end = start + len(ids)
            out["input_ids"][r, start:end] = ids
            out["labels"][r, start:end] = labels
            out["loss_mask"][r, start:end] = loss_mask
            out["position_ids"][r, start:end] = np.arange(len(ids))
            out["actual_seq_len"][r, d] = end
            start = end
        out["position_ids"][r, start:] = np.arange(seq_length - start)
    return out


def write_rows(path, rows):
    """MindRecord with the columns MindFormers' packed datasets yield (see module docstring)."""
    from mindspore.mindrecord import FileWriter
    writer = FileWriter(path, shard_num=1, overwrite=True)
    writer.set_page_size(1 << 22)
    writer.add_schema({name: {"type": "int32", "shape": [-1]} for name in rows}, "gpt_local_sft")
    count = len(rows["input_ids"])
    for start in range(0, count, 1024):
        writer.write_raw_data([{name: rows[name][i] for name in rows}
                               for i in range(start, min(start + 1024, count))])
    writer.commit()


def prepare_instruct(staging, files, fmt, tokenizer, eos_id, seq_length, too_long, pack, eval_fraction):
    """Tokenize, split, pack and write train (and eval) MindRecords; returns the summary entries."""
    for path in files:
        if not path.endswith((".json", ".jsonl")):
            raise DataError(f"--input {path}: --format {fmt} reads .json or .jsonl records.")
    records = tokenize_records(tokenizer, files, fmt, seq_length, too_long, eos_id)
    examples = [to_example(ids, learned) for ids, learned in records]
    n_eval = int(len(examples) * eval_fraction) if len(examples) > 1 else 0
    eval_examples, train_examples = examples[:n_eval], examples[n_eval:]
    summary = {"format": fmt, "records": len(examples), "packed": bool(pack),
               "tokens": int(sum(len(r[0]) for r in records)),
               "response_tokens": int(sum(int(e[2].sum()) for e in examples))}
    for name, chosen in (("train", train_examples), ("eval", eval_examples)):
        if not chosen:
            continue
        rows = pack_rows(chosen, seq_length, eos_id, pack)
        path = os.path.join(staging, f"{name}.mindrecord")
        write_rows(path, rows)
        summary[f"{name}_samples"] = int(len(rows["input_ids"]))
        summary[f"{name}_mindrecord"] = path
    return summary
