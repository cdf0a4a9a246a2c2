"""A model meets only data made by its own tokenizer (issue 26, item 1).

Builds, once, the folders README tells a user to make (shrunk: seq 64, a 512-token BPE, small corpora) in one
working directory, then runs every shipped CPU YAML's pre-flight on them in-process, and the issue's case:
the quickstart's model finetuned on `prepare-data`'s default data (another BPE of the same size) is refused
before any step, with one error naming both files.
"""
import json
import os
import shutil

import pytest

from mindformers_gptlocal import tokenizer_id
from mindformers_gptlocal.errors import GPTLocalError
from conftest import TINY, tiny_yaml

WORDS = ["alpha", "beta", "gamma", "delta", "kappa", "sigma", "omega", "theta"]


def _alpaca(path, count=48):
    with open(path, "w", encoding="utf-8") as handle:
        for i in range(count):
            handle.write(json.dumps({"instruction": f"repeat {WORDS[i % 8]}", "input": WORDS[(i * 3) % 8],
                                     "output": f"{WORDS[i % 8]} {WORDS[(i * 5) % 8]}"}) + "\n")
    return str(path)


def _tiny_model_dir(out, tokenizer_dir, **changes):
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, **changes)))
    model.save_pretrained(str(out), tokenizer_dir=str(tokenizer_dir))
    return str(out)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """README's folders, relative to one working directory (the shipped YAMLs' paths are relative)."""
    from mindformers_gptlocal.data.prepare import prepare
    root = tmp_path_factory.mktemp("readme_world")
    # bash run_scripts/quickstart.sh: its own BPE (a smaller slice of the stdlib), a trained model
    quick = prepare(out=str(root / "runs/quickstart/data"), seq_length=64, vocab_size=512, max_bytes=60_000)
    _tiny_model_dir(root / "runs/quickstart/train/model", quick["model_dir"])
    # gptlocal prepare-data (no --input: the stdlib), then pretrain -> output/model
    default = prepare(out=str(root / "data/gptlocal"), seq_length=64, vocab_size=512, max_bytes=120_000)
    _tiny_model_dir(root / "output/model", default["model_dir"])
    # finetune the quickstart's model: data made with its tokenizer
    prepare(out=str(root / "data/ft_tiny"), seq_length=64, tokenizer_path=str(root / "runs/quickstart/train/model"),
            max_bytes=40_000)
    alpaca = _alpaca(root / "data/alpaca.jsonl")
    prepare([alpaca], out=str(root / "data/sft"), seq_length=64, fmt="alpaca",
            tokenizer_path=str(root / "runs/quickstart/train/model"), eval_fraction=0)
    # gptlocal convert hf2ms --hf-dir gpt2 --out gpt2_gptlocal: a Hugging Face GPT-2 folder with its own BPE
    # (written by the real ms2hf converter from a tiny random model, so no torch import is needed here)
    from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms, ms_to_hf
    other = prepare(out=str(root / "hf_bpe"), seq_length=64, vocab_size=512, max_bytes=30_000)
    hf_dir = root / "hf_gpt2"
    ms_to_hf(_tiny_model_dir(root / "hf_src", other["model_dir"]), str(hf_dir))
    os.remove(hf_dir / "tokenizer_id")  # a Hugging Face folder has none
    hf_to_ms(str(hf_dir), str(root / "gpt2_gptlocal"))
    prepare(out=str(root / "data/ft"), seq_length=64, tokenizer_path=str(root / "gpt2_gptlocal/tokenizer.json"),
            max_bytes=40_000)
    return root


def _preflight(world, tmp_path, name, args=(), sources=None, **changes):
    """The shipped YAML shrunk to TINY (its paths kept), through load_config + preflight from ``world``.
    Returns the log lines."""
    from mindformers_gptlocal import yaml_io
    from mindformers_gptlocal.cli.launcher import load_config
    from mindformers_gptlocal.mf.run_yaml import preflight
    path = tiny_yaml(tmp_path, name, **changes)
    config = yaml_io.load_yaml(path)
    for section in ("train_dataset", "eval_dataset"):
        loader = (config.get(section) or {}).get("data_loader") or {}
        for handler in loader.get("handler") or []:
            handler["seq_length"] = 64
        if loader.get("type") == "HFDataLoader":
            loader["compressed_eod_mask_length"] = 64
        if loader.get("type") == "BlendedMegatronDatasetDataLoader":
            loader["config"]["seq_length"] = 64
        if f"{section}_task" in config and section in config:
            config[f"{section}_task"]["dataset_config"] = config[section]
    yaml_io.dump_yaml(config, path)
    lines = []
    cwd = os.getcwd()
    os.chdir(world)
    try:
        config = load_config(["--config", path, *args])
        preflight(config, log=lines.append)
        if sources is not None:
            from mindformers_gptlocal.preflight.tokenizers import tokenizer_sources
            sources.extend(tokenizer_sources(config, log=lines.append))
    finally:
        os.chdir(cwd)
    return lines


GPT2 = dict(model__model_config__intermediate_size=256, model__model_config__max_position_embeddings=64)
README_ROUTES = {  # YAML -> (its flags as README shows them, YAML changes only to shrink it to TINY)
    "pretrain_gpt_local_tiny_cpu.yaml": ((), {}),
    "pretrain_gpt_local_tiny_cpu_megatron.yaml": ((), {"train_dataset__data_loader__sizes": [16, 0, 0]}),
    "pretrain_llama_style_tiny_cpu.yaml": ((), {}),
    "eval_gpt_local_tiny_cpu.yaml": (("--load_checkpoint", "output/model"), {}),
    "predict_gpt_local_tiny_cpu.yaml": (("--load_checkpoint", "output/model", "--predict_data", "def main("), {}),
    "finetune_gpt_local_tiny_cpu.yaml": ((), {}),
    "finetune_gpt_local_tiny_sft_cpu.yaml": ((), {}),
    "finetune_gpt_local_tiny_sft_mindrecord_cpu.yaml": ((), {}),
    "finetune_gpt_local_tiny_sft_lora_cpu.yaml": ((), {}),
    "finetune_gpt_local_tiny_sft_adapter_cpu.yaml": ((), {}),
    "finetune_gpt2_hf_cpu.yaml": (("--train_dataset_dir", "data/ft/train.mindrecord"), GPT2),
    "finetune_gpt2_sft_cpu.yaml": ((), GPT2),
}


def test_every_shipped_cpu_yaml_is_routed():
    from conftest import CONFIGS
    shipped = {n for n in os.listdir(CONFIGS) if n.endswith("_cpu.yaml")}
    assert shipped - set(README_ROUTES) == set(), "a new CPU YAML needs its README route here"


@pytest.mark.parametrize("name", sorted(README_ROUTES))
def test_shipped_cpu_yaml_preflight_passes_on_readme_data(world, tmp_path, name):
    args, shrink = README_ROUTES[name]
    sources = []
    lines = _preflight(world, tmp_path, name, args, sources, **shrink)
    assert not [line for line in lines if "tokenizer" in line], lines  # every id known ...
    assert len(sources) >= 2 and len({source[2] for source in sources}) == 1, sources  # ... and equal


def test_quickstart_model_on_default_data_is_refused_before_any_step(world, tmp_path, capsys):
    """The issue's case, through `gptlocal run` in-process: exit 2, one error naming both files, nothing written."""
    from mindformers_gptlocal.cli.launcher import main
    path = tiny_yaml(tmp_path, "finetune_gpt_local_tiny_cpu.yaml")
    cwd = os.getcwd()
    os.chdir(world)
    try:
        code = main(["--config", path, "--train_dataset_dir", "data/gptlocal/train.mindrecord"])
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == 2, err
    assert "tokenizer mismatch" in err and "data/gptlocal/meta.json" in err, err
    assert "runs/quickstart/train/model/tokenizer_id" in err and "prepare-data --tokenizer" in err, err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert not os.path.exists(tmp_path / "output")


def test_save_tokenizer_dir_of_other_tokenizer_or_missing_is_refused(world, tmp_path):
    other = str(world / "data/gptlocal/model")
    with pytest.raises(GPTLocalError, match="tokenizer mismatch: callbacks.GPTLocalSaveModelDir.tokenizer_dir"):
        _preflight(world, tmp_path, "finetune_gpt_local_tiny_cpu.yaml",
                   callbacks=[{"type": "GPTLocalSaveModelDir", "tokenizer_dir": other}])
    with pytest.raises(GPTLocalError, match="tokenizer_dir nowhere does not exist"):
        _preflight(world, tmp_path, "finetune_gpt_local_tiny_cpu.yaml",
                   callbacks=[{"type": "GPTLocalSaveModelDir", "tokenizer_dir": "nowhere"}])
    with pytest.raises(GPTLocalError, match="pretrained_model_dir nowhere does not exist"):
        _preflight(world, tmp_path, "finetune_gpt_local_tiny_sft_cpu.yaml", pretrained_model_dir="nowhere")


def test_old_data_set_without_id_warns_and_runs(world, tmp_path):
    copy = tmp_path / "old"
    shutil.copytree(world / "data/ft_tiny", copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["tokenizer_id"]
    (copy / "meta.json").write_text(json.dumps(meta))
    lines = _preflight(world, tmp_path, "finetune_gpt_local_tiny_cpu.yaml",
                       ("--train_dataset_dir", str(copy / "train.mindrecord")))
    assert any("records no tokenizer_id" in line and "warning" in line for line in lines), lines


def test_save_model_dir_refuses_a_missing_tokenizer_dir(tmp_path):
    with pytest.raises(GPTLocalError, match="tokenizer_dir .*missing does not exist"):
        _tiny_model_dir(tmp_path / "m", tmp_path / "missing")
    assert not os.path.exists(tmp_path / "m")


def test_id_ignores_formatting_and_sees_content(world, tmp_path):
    """Indentation, key order and the two merge spellings give one id; GPT-2's vocab.json + merges.txt the
    id of the tokenizer.json made from them; one merge less, another id."""
    from mindformers_gptlocal.data.tokenizer import from_gpt2_files
    source = world / "data/gptlocal/model/tokenizer.json"
    data = json.loads(source.read_text())
    base = tokenizer_id.id_of_file(str(source))
    merges = data["model"]["merges"]
    as_strings = [" ".join(m) if isinstance(m, list) else m for m in merges]
    as_pairs = [m.split(" ", 1) if isinstance(m, str) else m for m in merges]
    for variant, indent in ((as_strings, 4), (as_pairs, None)):
        changed = dict(reversed(list(data.items())))
        changed["model"] = dict(data["model"], merges=variant,
                                vocab=dict(reversed(list(data["model"]["vocab"].items()))))
        (tmp_path / "t.json").write_text(json.dumps(changed, indent=indent))
        assert tokenizer_id.id_of_file(str(tmp_path / "t.json")) == base
    vocab = {k: v for k, v in data["model"]["vocab"].items()}
    (tmp_path / "vocab.json").write_text(json.dumps(vocab))
    (tmp_path / "merges.txt").write_text("#version: 0.2\n" + "\n".join(as_strings) + "\n")
    files_id = tokenizer_id.id_of_gpt2_files(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    built = tokenizer_id.id_of_tokenizer(from_gpt2_files(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")))
    assert files_id == built
    (tmp_path / "merges.txt").write_text("\n".join(as_strings[:-1]) + "\n")
    assert tokenizer_id.id_of_gpt2_files(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt")) != files_id
    quick = tokenizer_id.id_of_file(str(world / "runs/quickstart/train/model/tokenizer.json"))
    assert quick != base  # the two BPEs of the issue: same size, other merges


def test_model_dir_with_a_swapped_tokenizer_is_refused_by_from_pretrained_and_prepare_data(world, tmp_path):
    """generate, chat, serve and eval load through from_pretrained; prepare-data --tokenizer reads the dir."""
    from mindformers_gptlocal import GPTLocalForCausalLM
    from mindformers_gptlocal.data.prepare import prepare
    model_dir = tmp_path / "model"
    shutil.copytree(world / "runs/quickstart/train/model", model_dir)
    assert tokenizer_id.recorded_id(str(model_dir)) == tokenizer_id.id_of_file(str(model_dir / "tokenizer.json"))
    GPTLocalForCausalLM.from_pretrained(str(model_dir))  # its own tokenizer: loads
    shutil.copyfile(world / "data/gptlocal/model/tokenizer.json", model_dir / "tokenizer.json")
    with pytest.raises(GPTLocalError, match="is not the tokenizer this model was trained with") as caught:
        GPTLocalForCausalLM.from_pretrained(str(model_dir))
    assert str(model_dir / "tokenizer_id") in str(caught.value)
    with pytest.raises(GPTLocalError, match="is not the tokenizer this model was trained with"):
        prepare(out=str(tmp_path / "d"), seq_length=64, tokenizer_path=str(model_dir), max_bytes=20_000)
