"""Instruction data: prepare-data --format alpaca|chat (templates, loss mask counted by hand, truncation,
clear errors), the chat template in Hugging Face's apply_chat_template, and the HFDataLoader route."""
import json
import os

import numpy as np
import pytest

from mindformers_gptlocal.data import instruct
from mindformers_gptlocal.data.prepare import prepare
from mindformers_gptlocal.errors import DataError
from conftest import run_launcher, step_losses, tiny_yaml

EOS = "<|endoftext|>"


@pytest.fixture(scope="module")
def byte_tokenizer(tmp_path_factory):
    """A byte-level BPE with no merges: one token per byte (ASCII: per character), EOS id 0. Its token
    counts can be done by hand."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {EOS: 0}
    for char in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([EOS])
    path = str(tmp_path_factory.mktemp("bytes") / "tokenizer.json")
    tokenizer.save(path)
    return path, tokenizer


def _write(path, records):
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def _rows(path):
    from mindspore.mindrecord import FileReader
    reader = FileReader(path)
    rows = list(reader.get_next())
    reader.close()
    return rows


def _ids(tokenizer, text):
    return tokenizer.encode(text).ids


def test_alpaca_prompt_is_mindformers_text():
    from mindformers.dataset.handler.alpaca_handler import AlpacaInstructDataHandler
    assert instruct.ALPACA_PROMPT_WITH_INPUT == AlpacaInstructDataHandler.prompt_with_input
    assert instruct.ALPACA_PROMPT_WITHOUT_INPUT == AlpacaInstructDataHandler.prompt_without_input


def test_alpaca_record_loss_mask_by_hand(byte_tokenizer, tmp_path):
    path, tokenizer = byte_tokenizer
    data = _write(tmp_path / "a.jsonl", [{"instruction": "Hi", "output": "Yo"}])
    summary = prepare([data], out=str(tmp_path / "out"), seq_length=256, tokenizer_path=path, eval_fraction=0,
                      fmt="alpaca", pack=False)
    (row,) = _rows(summary["train_mindrecord"])
    prompt = instruct.ALPACA_PROMPT_WITHOUT_INPUT.format(instruction="Hi") + "\n"
    assert prompt.isascii()
    p = len(prompt)  # one token per character
    # tokens: prompt (p), "Y", "o", EOS -> inputs are all but the last; targets start at index p - 1
    learned = np.flatnonzero(row["loss_mask"])
    assert learned.tolist() == [p - 1, p, p + 1]
    assert row["labels"][learned].tolist() == _ids(tokenizer, "Yo") + [0]
    assert (row["labels"][row["loss_mask"] == 0] == -100).all()
    assert row["input_ids"][:p + 2].tolist() == _ids(tokenizer, prompt + "Yo")
    assert (row["input_ids"][p + 2:] == 0).all() and row["actual_seq_len"][0] == p + 2
    assert summary["response_tokens"] == 3


def test_chat_record_by_hand_and_hf_chat_template(byte_tokenizer, tmp_path):
    path, tokenizer = byte_tokenizer
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                {"role": "user", "content": "Ok?"}, {"role": "assistant", "content": "Sure"}]
    data = _write(tmp_path / "c.jsonl", [{"messages": messages}])
    summary = prepare([data], out=str(tmp_path / "out"), seq_length=64, tokenizer_path=path, eval_fraction=0,
                      fmt="chat", pack=False)
    (row,) = _rows(summary["train_mindrecord"])
    # "user: Hi"(8) EOS(1) "assistant: "(11) -> "Yo" is token 20, its target index 19; then "Yo"+EOS;
    # "user: Ok?"(9) EOS "assistant: "(11) -> "Sure" is token 20+3+9+1+11 = 44, target index 43.
    assert np.flatnonzero(row["loss_mask"]).tolist() == [19, 20, 21, 43, 44, 45, 46, 47]
    # the same text and tokens as Hugging Face's apply_chat_template with the saved tokenizer_config.json
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(summary["model_dir"])
    text = hf.apply_chat_template(messages, tokenize=False)
    assert text == instruct.render_chat(messages, EOS) == \
        f"user: Hi{EOS}assistant: Yo{EOS}user: Ok?{EOS}assistant: Sure{EOS}"
    full = hf.apply_chat_template(messages, tokenize=True)
    assert row["input_ids"][:len(full) - 1].tolist() == full[:-1]
    prompt = hf.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == f"user: Hi{EOS}assistant: "


def test_too_long_truncates_the_prompt_or_refuses(byte_tokenizer, tmp_path):
    path, tokenizer = byte_tokenizer
    long_input = "x" * 300
    data = _write(tmp_path / "a.jsonl", [{"instruction": "Hi", "output": "Yo"},
                                         {"instruction": "Copy", "input": long_input, "output": "done"}])
    summary = prepare([data], out=str(tmp_path / "t"), seq_length=200, tokenizer_path=path, eval_fraction=0,
                      fmt="alpaca", pack=False)
    rows = _rows(summary["train_mindrecord"])
    row = rows[1]
    # 200 + 1 tokens kept: the prompt's tail ("...xxx\n\n### Response:\n") and the whole response
    kept = (instruct.ALPACA_PROMPT_WITH_INPUT.format(instruction="Copy", input=long_input) + "\n")[-(201 - 5):]
    assert row["input_ids"].tolist() == _ids(tokenizer, kept + "done")
    assert row["labels"][row["loss_mask"] == 1].tolist() == _ids(tokenizer, "done") + [0]
    with pytest.raises(DataError, match=r"a\.jsonl:2: the record has \d+ tokens.*--too-long truncate"):
        prepare([data], out=str(tmp_path / "e"), seq_length=200, tokenizer_path=path, fmt="alpaca", too_long="error")
    data = _write(tmp_path / "b.jsonl", [{"instruction": "Hi", "output": "y" * 250}])
    with pytest.raises(DataError, match=r"b\.jsonl:1: its last response has 251 tokens"):
        prepare([data], out=str(tmp_path / "r"), seq_length=200, tokenizer_path=path, fmt="alpaca")
    assert not os.path.exists(tmp_path / "e") and not os.path.exists(tmp_path / "r")  # nothing half-written


def test_cli_flags_and_one_line_error(byte_tokenizer, tmp_path, capsys):
    from mindformers_gptlocal.cli.main import main
    path = byte_tokenizer[0]
    data = _write(tmp_path / "a.jsonl", [{"instruction": "Hi", "output": "Yo"}, {"instruction": "Hey", "output": "No"}])
    assert main(["prepare-data", "--format", "alpaca", "--input", data, "--tokenizer", path, "--seq-length", "400",
                 "--eval-fraction", "0", "--no-pack", "--out", str(tmp_path / "one")]) == 0
    assert json.loads(capsys.readouterr().out)["train_samples"] == 2  # --no-pack: one record a row
    assert main(["prepare-data", "--format", "alpaca", "--input", data, "--tokenizer", path, "--seq-length", "400",
                 "--eval-fraction", "0", "--out", str(tmp_path / "packed")]) == 0
    assert json.loads(capsys.readouterr().out)["train_samples"] == 1
    assert main(["prepare-data", "--format", "alpaca", "--input", data, "--tokenizer", path, "--seq-length", "64",
                 "--too-long", "error", "--out", str(tmp_path / "err")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "a.jsonl:1: the record has" in err[0]


@pytest.mark.parametrize("fmt, lines, where, message", [
    ("alpaca", [{"instruction": "a", "output": "b"}, "", "{not json"], ":3:", "not valid JSON"),
    ("alpaca", [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": ""}], ":2:", "'output' is missing"),
    ("alpaca", [["a", "b"]], ":1:", "must be a JSON object"),
    ("chat", [{"messages": [{"role": "user", "content": "hi"}]}], ":1:", "last message must be the assistant"),
    ("chat", [{"messages": [{"role": "bot", "content": "hi"}]}], ":1:", r"messages\[0\] must be"),
    ("chat", [{"text": "hi"}], ":1:", "needs 'messages'"),
])
def test_malformed_records_name_file_and_line(byte_tokenizer, tmp_path, fmt, lines, where, message):
    data = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=rf"bad\.jsonl{where} .*{message}"):
        prepare([data], out=str(tmp_path / "out"), seq_length=64, tokenizer_path=byte_tokenizer[0], fmt=fmt)


def test_json_array_file_and_its_line_numbers(byte_tokenizer, tmp_path):
    """Alpaca's own alpaca_data.json is a JSON array; an error names the line its record starts on."""
    good = [{"instruction": "a", "output": "b"}, {"instruction": "c", "input": "d", "output": "e"}]
    (tmp_path / "ok.json").write_text(json.dumps(good, indent=2))
    summary = prepare([str(tmp_path / "ok.json")], out=str(tmp_path / "ok"), seq_length=512,
                      tokenizer_path=byte_tokenizer[0], fmt="alpaca", eval_fraction=0)
    assert summary["records"] == 2 and summary["train_samples"] == 1  # both packed into one row
    (row,) = _rows(summary["train_mindrecord"])
    ends = row["actual_seq_len"]
    assert ends[1] > ends[0] and row["position_ids"][ends[0]] == 0 and (ends[2:] == 512).all()
    (tmp_path / "bad.json").write_text(json.dumps(good + [{"instruction": "x"}], indent=2))
    line = json.dumps(good + [{"instruction": "x"}], indent=2).splitlines().index("  {", 8) + 1
    with pytest.raises(DataError, match=rf"bad\.json:{line}: 'output' is missing"):
        prepare([str(tmp_path / "bad.json")], out=str(tmp_path / "bad"), seq_length=512,
                tokenizer_path=byte_tokenizer[0], fmt="alpaca")


def test_mindformers_packing_handler_shifts_labels_again():
    """Why GPTLocalInstructHandler packs by itself: MindFormers 1.8's PackingHandler ('pack') shifts the
    labels it gets (already shifted by AlpacaInstructDataHandler: labels[t] = token t+1) once more."""
    from datasets import Dataset
    from mindformers.dataset.handler.packing_handler import PackingHandler
    tokens = [5, 6, 7, 8, 9]
    shifted = [-100, -100, 8, 9, -100]  # AlpacaInstructDataHandler's layout: labels[t] = tokens[t + 1]
    # two samples that do not fit one row (with one sample alone, 1.8's pack_examples finds "no data")
    packed = PackingHandler(seq_length=8, pack_strategy="pack")(
        Dataset.from_dict({"input_ids": [tokens, tokens], "labels": [shifted, shifted]}))
    labels = packed[0]["labels"]
    assert labels[1] == tokens[3]  # the target of token 1 is now token 3: two places ahead
    # ours, from the tokens and which of them are learned: labels[t] = tokens[t + 1], once
    example = instruct.to_example(np.asarray(tokens, np.int32), np.asarray([0, 0, 0, 1, 1], np.int32))
    ours = instruct.pack_rows([example], 8, pad_id=0)
    assert ours["labels"][0, :4].tolist() == [-100, -100, 8, 9]


def test_hfdataloader_route_trains_as_the_prepare_data_route(corpus, tmp_path):
    """The same chat records through MindFormers' HFDataLoader (+ GPTLocalInstructHandler, packing) and
    through prepare-data's MindRecord give the same training losses, step for step (packed rows, batch 4,
    actual_seq_len offset by MindFormers' batch map on one route, per row on the other)."""
    words = ["alpha", "beta", "gamma", "delta", "kappa", "sigma"]
    records = [{"messages": [{"role": "user", "content": f"repeat {words[i % 6]}"},
                             {"role": "assistant", "content": f"{words[i % 6]} {words[(i * 5) % 6]}"}]}
               for i in range(64)]
    data = _write(tmp_path / "chat.jsonl", records)
    tokenizer = os.path.join(corpus["model_dir"], "tokenizer.json")
    summary = prepare([data], out=str(tmp_path / "sft"), seq_length=64, tokenizer_path=tokenizer, fmt="chat",
                      eval_fraction=0)
    rows = _rows(summary["train_mindrecord"])
    assert len(rows) <= len(records) // 2  # packed: two or more records a row
    (tmp_path / "hf").mkdir()
    (tmp_path / "mr").mkdir()
    callbacks = [{"type": "GPTLocalThroughputMonitor", "per_print_times": 1}]
    handler = [{"type": "GPTLocalInstructHandler", "format": "chat", "seq_length": 64, "pack": True,
                "max_docs": 64, "tokenizer": {}}]
    hf_yaml = tiny_yaml(tmp_path / "hf", "finetune_gpt_local_tiny_sft_cpu.yaml", load_checkpoint="",
                        pretrained_model_dir=corpus["model_dir"], callbacks=callbacks,
                        train_dataset__data_loader__data_files=data, train_dataset__data_loader__handler=handler,
                        train_dataset__data_loader__compressed_eod_mask_length=64)
    mr_yaml = tiny_yaml(tmp_path / "mr", "finetune_gpt_local_tiny_sft_mindrecord_cpu.yaml", load_checkpoint="",
                        callbacks=callbacks, train_dataset__data_loader__shuffle=False,
                        train_dataset__data_loader__dataset_dir=summary["train_mindrecord"])
    losses = []
    for yaml_path in (hf_yaml, mr_yaml):
        code, out = run_launcher(["--config", yaml_path], cwd=os.path.dirname(yaml_path))
        assert code == 0, out[-3000:]
        losses.append(step_losses(out))
    assert len(losses[0]) == len(rows) // 4 > 0
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_preflight_names_a_bad_record_and_a_seq_length_mismatch(corpus, tmp_path, monkeypatch):
    """HFDataLoader + GPTLocalInstructHandler: the pre-flight reads the records itself (inside the handler
    `datasets` has dropped the line numbers) and checks the handler's seq_length against the model's."""
    monkeypatch.chdir(tmp_path)  # the YAML's relative paths (./runs/quickstart/...) must not meet a local run
    from mindformers_gptlocal.cli.launcher import load_config
    from mindformers_gptlocal.errors import GPTLocalError
    from mindformers_gptlocal.mf.run_yaml import preflight
    data = _write(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "a"},
                                                          {"role": "assistant", "content": "b"}]},
                                            {"messages": [{"role": "user", "content": "a"}]}])

    def error(seq_length):
        handler = [{"type": "GPTLocalInstructHandler", "format": "chat", "seq_length": seq_length, "tokenizer": {}}]
        yaml_path = tiny_yaml(tmp_path, "finetune_gpt_local_tiny_sft_cpu.yaml", load_checkpoint="",
                              pretrained_model_dir=corpus["model_dir"], train_dataset__data_loader__data_files=data,
                              train_dataset__data_loader__handler=handler,
                              callbacks=[{"type": "GPTLocalSaveModelDir", "tokenizer_dir": corpus["model_dir"]}])
        with pytest.raises(GPTLocalError) as caught:
            preflight(load_config(["--config", yaml_path]), log=lambda _: None)
        return str(caught.value)

    assert "GPTLocalInstructHandler.seq_length is 256 but model_config.seq_length is 64" in error(256)
    assert f"{data}:2: the last message must be the assistant's" in error(64)
