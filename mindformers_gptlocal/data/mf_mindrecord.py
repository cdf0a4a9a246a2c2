"""``gptlocal prepare-data --from-mf-mindrecord``: MindFormers 1.x GPT-2 MindRecord -> gpt_local MindRecord, once.

MindFormers' GPT-2 data (``mindformers/tools/dataset_preprocess/gpt2/wikitext2_data_process.py``, branch r1.3.0,
and the older ``input_mask`` files) holds ``input_ids`` and a mask (``input_mask`` or ``attention_mask``) of
``seq_length + 1`` tokens a row; ``GPT2LMHeadModel.construct`` (``mindformers/models/gpt2/gpt2.py``) trains on
``input_ids[:-1]`` against ``input_ids[1:]`` with ``mask[1:]`` as the loss mask. The rewrite stores exactly that
in the columns every gpt_local YAML reads (``input_ids, labels, loss_mask, position_ids``, ``seq_length``
wide), so the training path, its pre-flight checks and its resume records know one data format; the old
file is only read.

One difference, reported by the rewrite: MindFormers also hid mask-0 tokens from attention. For padding at the
end of a row (what its preprocessing writes) that changes nothing a loss sees; rows with a 0 before a 1
(``interior_rows``) attended differently there.
"""
import os

import numpy as np

from ..errors import DataError
from ..staging import write_folder

MASK_COLUMNS = ("input_mask", "attention_mask")
COLUMNS = ("input_ids", "labels", "loss_mask", "position_ids")


def _stem(path):
    """``wiki.mindrecord`` / ``wiki.mindrecord0`` (a shard) / a folder -> its path without the suffix."""
    path = path.rstrip("/\\")
    base, ext = os.path.splitext(path)
    return base if ext.startswith(".mindrecord") else path


def default_out(path):
    """The folder the rewrite of ``path`` goes to unless --out says otherwise: ``<stem>_gptlocal``."""
    return _stem(path) + "_gptlocal"


def converted_path(path):
    """The rewritten file of ``path`` (what ``gptlocal migrate-yaml`` puts in dataset_dir)."""
    return os.path.join(default_out(path), os.path.basename(_stem(path)) + ".mindrecord")


def shift_row(ids, mask):
    """One old row (seq + 1 tokens) -> the gpt_local columns (seq tokens each), as GPT2LMHeadModel trains it."""
    seq = ids.size - 1
    return {"input_ids": ids[:-1].astype(np.int32), "labels": ids[1:].astype(np.int32),
            "loss_mask": (mask[1:] != 0).astype(np.int32), "position_ids": np.arange(seq, dtype=np.int32)}


def _source_file(path):
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if ".mindrecord" in f and not f.endswith(".db"))
        if not files:
            raise DataError(f"--from-mf-mindrecord {path}: the folder holds no .mindrecord file.")
        return os.path.join(path, files[0])
    if not os.path.isfile(path):
        raise DataError(f"--from-mf-mindrecord {path} does not exist.")
    return path


def rewrite(path, out=None, seq_length=None, overwrite=False):
    """Rewrite a MindFormers GPT-2 MindRecord into ``out`` (default ``<stem>_gptlocal``). ``seq_length``, when
    given, is the model's: every row must then hold seq_length + 1 tokens. Returns a summary."""
    from mindspore.mindrecord import FileReader, FileWriter
    source = _source_file(path)
    try:
        reader = FileReader(source)
    except Exception as err:  # MindRecord raises RuntimeError variants
        raise DataError(f"--from-mf-mindrecord {source} is not a readable MindRecord file ({err}).") from err
    try:
        schema = reader.schema()
        fields = schema.get("schema", schema) if isinstance(schema, dict) else {}
        mask_column = next((c for c in MASK_COLUMNS if c in fields), None)
        if "input_ids" not in fields or mask_column is None:
            raise DataError(f"--from-mf-mindrecord {source} has columns {sorted(fields)}; a MindFormers GPT-2 "
                            f"MindRecord has input_ids and input_mask (or attention_mask).")
        rows, widths = [], {}
        for row in reader.get_next():
            ids, mask = np.asarray(row["input_ids"]).ravel(), np.asarray(row[mask_column]).ravel()
            if ids.size != mask.size:
                raise DataError(f"--from-mf-mindrecord {source}: row {len(rows)} has {ids.size} input_ids but "
                                f"{mask.size} {mask_column}; the file is damaged.")
            widths[ids.size] = widths.get(ids.size, 0) + 1
            rows.append((ids, mask))
    finally:
        reader.close()
    if not rows:
        raise DataError(f"--from-mf-mindrecord {source} holds no rows.")
    if len(widths) > 1 or (seq_length and next(iter(widths)) != seq_length + 1):
        found = ", ".join(f"{count} rows of {width}" for width, count in sorted(widths.items()))
        want = f"seq_length + 1 = {seq_length + 1} tokens" if seq_length else "one width (seq_length + 1)"
        raise DataError(f"--from-mf-mindrecord {source}: rows must all hold {want}, as MindFormers' GPT-2 data "
                        f"does (written with --max_length seq_length + 1); found {found}. Pass --seq-length of the "
                        f"model the data was written for, or re-run MindFormers' preprocessing.")
    width = next(iter(widths))
    if width < 2:
        raise DataError(f"--from-mf-mindrecord {source}: rows of {width} token hold no next-token pair.")
    converted = [shift_row(ids, mask) for ids, mask in rows]
    masked = int(sum(int((r["loss_mask"] == 0).sum()) for r in converted))
    interior = sum(1 for _, mask in rows if _has_interior_zero(mask[1:]))
    out = out or default_out(path)
    name = os.path.basename(_stem(path)) + ".mindrecord"

    def build(staging):
        target = os.path.join(staging, name)
        writer = FileWriter(target, shard_num=1, overwrite=True)
        writer.add_schema({c: {"type": "int32", "shape": [-1]} for c in COLUMNS}, "gpt_local")
        for start in range(0, len(converted), 1024):
            writer.write_raw_data(converted[start:start + 1024])
        writer.commit()
        return {"rows": len(converted), "seq_length": width - 1, "mask_column": mask_column,
                "masked_positions": masked, "loss_positions": len(converted) * (width - 1) - masked,
                "interior_rows": interior}
    summary = write_folder(out, build, DataError, overwrite=overwrite, overwrite_flag="--overwrite")
    summary["mindrecord"] = os.path.join(os.path.abspath(out), name)
    return summary


def _has_interior_zero(mask):
    """A 0 followed later by a 1 (not trailing padding)."""
    zeros = np.flatnonzero(mask == 0)
    ones = np.flatnonzero(mask != 0)
    return bool(zeros.size and ones.size and zeros[0] < ones[-1])
