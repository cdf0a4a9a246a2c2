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


ODD = ["a", "bc", " ", "  ", "\n", "\n\n", "\t", "'s", " x1", "é", "\u3000", "<|endoftext|>", ".", "\r\n", " \n", "9",
       "\u00a0", "\x1c", "def f(x):\n    return x\n"]


def _odd_text(seed, count):
    rng = np.random.default_rng(seed)
    return "".join(ODD[i] for i in rng.integers(0, len(ODD), count))


def _prepared(summary):
    """A prepared folder's content by value: tokenizer, both formats' tokens, the counts."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(summary["model_dir"], "tokenizer.json")).to_str()
    with open(summary["megatron_prefix"] + ".bin", "rb") as handle:
        megatron = handle.read()
    rows = {name: [r["input_ids"].tolist() for r in _mindrecord_rows(summary[name])]
            for name in ("train_mindrecord", "eval_mindrecord") if name in summary}
    counts = {k: v for k, v in summary.items() if isinstance(v, int)}
    return tokenizer, megatron, rows, counts


def test_pieces_give_the_one_piece_result(tmp_path):
    """Text files read and tokenized in pieces (cut after a newline between two non-space characters) give the
    same prepared folder as whole documents, on odd text (runs of spaces and newlines, \\r\\n, non-ASCII spaces, the
    special token, a file of only whitespace), for a BPE trained here and for a given GPT-2 vocab + merges."""
    from mindformers_gptlocal.data.prepare import iter_pieces
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.txt").write_text(_odd_text(0, 30000), newline="")
    (docs / "b.txt").write_text(_odd_text(1, 5000), newline="")
    (docs / "blank.txt").write_text(" \n\n \t\n" * 50)
    (docs / "c.jsonl").write_text("\n".join(json.dumps({"text": _odd_text(i, 200)}) for i in range(3)) + "\n")
    files = sorted(str(p) for p in docs.iterdir())
    pieces = list(iter_pieces(files, piece_chars=500))
    assert len(pieces) > 60 and {n for n, _ in pieces} == {0, 1, 2, 3, 4}  # the blank file is no document
    whole = {n: t for n, t in iter_pieces(files, piece_chars=None)}
    assert {n: "".join(t for m, t in pieces if m == n) for n in whole} == whole
    one = prepare([str(docs)], out=str(tmp_path / "one"), seq_length=32, vocab_size=400, piece_chars=None)
    many = prepare([str(docs)], out=str(tmp_path / "many"), seq_length=32, vocab_size=400, piece_chars=500)
    assert one["documents"] == 5 and _prepared(many) == _prepared(one)
    from tokenizers import Tokenizer
    Tokenizer.from_file(os.path.join(one["model_dir"], "tokenizer.json")).model.save(str(tmp_path), "gpt2")
    given = dict(vocab=str(tmp_path / "gpt2-vocab.json"), merges=str(tmp_path / "gpt2-merges.txt"), seq_length=32)
    one = prepare([str(docs)], out=str(tmp_path / "one_given"), piece_chars=None, **given)
    many = prepare([str(docs)], out=str(tmp_path / "many_given"), piece_chars=500, **given)
    assert _prepared(many) == _prepared(one)


def test_a_tokenizer_that_splits_otherwise_gets_whole_documents():
    """A normalizer, a prefix space, a post-processor that adds tokens or an added token that takes in the
    whitespace beside it could tokenize pieces otherwise: such a tokenizer gets each document whole."""
    from tokenizers import AddedToken, normalizers, pre_tokenizers, processors
    from mindformers_gptlocal.data.prepare import splits_alike
    from mindformers_gptlocal.data.tokenizer import train_bpe

    def tokenizer():
        return train_bpe(["def f(x):\n    return x\n"] * 20, 300)
    assert splits_alike(tokenizer())
    changed = tokenizer()
    changed.normalizer = normalizers.NFKC()
    assert not splits_alike(changed)
    changed = tokenizer()
    changed.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert not splits_alike(changed)
    changed = tokenizer()
    changed.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                           special_tokens=[("<|endoftext|>", 0)])
    assert not splits_alike(changed)
    changed = tokenizer()
    changed.add_special_tokens([AddedToken("<sep>", lstrip=True)])
    assert not splits_alike(changed)


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
