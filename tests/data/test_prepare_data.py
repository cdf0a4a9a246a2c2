"""gptlocal prepare-data: inputs, tokenizers, both dataset formats, and nothing half-written on failure."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mindformers_gptlocal.data.prepare import prepare
from mindformers_gptlocal.errors import DataError
from conftest import source_env

TEXT = "def add(a, b):\n    return a + b\n\nclass Point:\n    x = 1\n    y = 2\n" * 30


def _write_docs(folder, count=6):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        (folder / f"doc{i}.txt").write_text(f"# document {i}\n" + TEXT)
    return folder


def _mindrecord_rows(path):
    from mindspore.mindrecord import FileReader
    reader = FileReader(path)
    rows = list(reader.get_next())
    reader.close()
    return rows


def test_folder_to_mindrecord_and_megatron(tmp_path):
    summary = prepare([str(_write_docs(tmp_path / "docs"))], out=str(tmp_path / "out"), seq_length=32,
                      vocab_size=300, eval_fraction=0.0)
    rows = _mindrecord_rows(summary["train_mindrecord"])
    assert len(rows) == summary["train_samples"] > 0
    first = rows[0]
    assert set(first) == {"input_ids", "labels", "loss_mask", "position_ids"}
    np.testing.assert_array_equal(first["input_ids"][1:], first["labels"][:-1])  # labels are shifted inputs
    np.testing.assert_array_equal(first["position_ids"], np.arange(32))
    from mindformers.dataset.blended_datasets.indexed_dataset import IndexedDataset
    megatron = IndexedDataset(summary["megatron_prefix"])
    assert len(megatron) == summary["documents"] == 6
    stream = np.concatenate([megatron[i] for i in range(len(megatron))])
    assert stream[-1] == summary["eod_token_id"] and (stream == summary["eod_token_id"]).sum() == 6
    np.testing.assert_array_equal(first["input_ids"], stream[:32])  # both formats hold the same tokens
    model_dir = summary["model_dir"]
    config = json.load(open(os.path.join(model_dir, "config.json")))
    assert config["model_type"] == "gpt_local" and config["vocab_size"] == summary["vocab_size"]
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.decode(tokenizer("def add(a, b):")["input_ids"]) == "def add(a, b):"


def test_jsonl_and_gpt2_vocab_merges(tmp_path):
    first = prepare([str(_write_docs(tmp_path / "docs"))], out=str(tmp_path / "first"), seq_length=16,
                    vocab_size=300)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(os.path.join(first["model_dir"], "tokenizer.json"))
    tok.model.save(str(tmp_path), "gpt2")  # writes gpt2-vocab.json, gpt2-merges.txt
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps({"content": TEXT, "id": i}) for i in range(4)) + "\n")
    summary = prepare([str(jsonl)], out=str(tmp_path / "second"), seq_length=16, jsonl_key="content",
                      vocab=str(tmp_path / "gpt2-vocab.json"), merges=str(tmp_path / "gpt2-merges.txt"))
    assert summary["documents"] == 4 and summary["vocab_size"] == first["vocab_size"]
    with pytest.raises(DataError, match=r"no 'text' field; pass --jsonl-key"):
        prepare([str(jsonl)], out=str(tmp_path / "third"), seq_length=16)


def test_failure_leaves_nothing_behind(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: not valid JSON"):
        prepare([str(bad)], out=str(tmp_path / "out"), seq_length=16, vocab_size=300)
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl"]


def test_existing_output_is_kept_unless_overwrite(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(DataError, match="--overwrite"):
        prepare([str(_write_docs(tmp_path / "docs"))], out=str(out), seq_length=16, vocab_size=300)
    assert (out / "keep.txt").exists()


def test_cli_default_corpus_is_stdlib(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "prepare-data", "--out",
                           str(tmp_path / "std"), "--max-bytes", "60000", "--vocab-size", "400", "--seq-length", "32"],
                          capture_output=True, text=True, env=source_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert summary["files"] >= 1 and summary["train_samples"] > 0
    assert "tokenize" in proc.stderr  # progress is shown
    missing = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "prepare-data", "--input",
                              str(tmp_path / "nope"), "--out", str(tmp_path / "x")],
                             capture_output=True, text=True, env=source_env(), timeout=300)
    assert missing.returncode == 2 and "nope: no such file or folder" in missing.stderr
    assert "Traceback" not in missing.stderr


def test_held_out_documents_fill_at_least_one_window():
    from mindformers_gptlocal.data.prepare import split_documents
    docs = [np.arange(n) for n in (5, 5, 40, 300)]
    train, held = split_documents(docs, eval_fraction=0.05, seq_length=32)
    assert [len(d) for d in held] == [5, 5, 40] and [len(d) for d in train] == [300]
    train, held = split_documents([np.arange(10), np.arange(10)], eval_fraction=0.5, seq_length=32)
    assert held == [] and len(train) == 2  # too little text: nothing held out


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "prepare-data", *args], cwd=str(cwd),
                          capture_output=True, text=True, env=source_env(), timeout=300)


@pytest.mark.parametrize("args,expected", [
    (["--seq-length", "0"], "--seq-length must be an integer >= 1, got 0"),
    (["--seq-length", "-1"], "--seq-length must be an integer >= 1, got -1"),
    (["--vocab-size", "0"], "--vocab-size must be an integer >= 1, got 0"),
    (["--eval-fraction", "1.5"], "--eval-fraction must be a share in [0, 1), got 1.5"),
    (["--max-bytes", "-5"], "--max-bytes must be an integer >= 1, got -5"),
])
def test_cli_bad_numbers_one_line_nothing_written(tmp_path, args, expected):
    proc = _cli("--input", str(_write_docs(tmp_path / "docs")), "--out", "out", *args, cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and expected in lines[0], proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["docs"]


def test_binary_input_is_refused(tmp_path):
    """An executable is not tokenised into a training set: one line, exit 2, nothing written."""
    proc = _cli("--input", sys.executable, "--out", "out", cwd=tmp_path)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "is not a text file (it holds NUL bytes" in lines[0] and os.listdir(tmp_path) == []
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9 ".encode("latin-1") * 50)
    with pytest.raises(DataError, match="is not UTF-8 text"):
        prepare([str(latin)], out=str(tmp_path / "out"), seq_length=16)
    assert not os.path.exists(tmp_path / "out")


def test_megatron_files_equal_mindformers_builders(tmp_path):
    """write_megatron (no MindFormers import) writes byte for byte what MindFormers' IndexedDatasetBuilder writes."""
    from mindformers.dataset.blended_datasets.indexed_dataset import IndexedDatasetBuilder
    from mindformers_gptlocal.data.prepare import write_megatron
    docs = [np.arange(7, dtype=np.int32), np.array([5], np.int32), np.arange(300, 1301, dtype=np.int32)]
    write_megatron(str(tmp_path / "ours"), docs)
    builder = IndexedDatasetBuilder(str(tmp_path / "theirs.bin"), dtype=np.int32)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(str(tmp_path / "theirs.idx"))
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"ours{suffix}").read_bytes() == (tmp_path / f"theirs{suffix}").read_bytes(), suffix
