"""Hugging Face GPT-2 interop: logits/loss parity with transformers, exact round trip, bad input."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from transformers import GPT2LMHeadModel

import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalForCausalLM
from mindformers_gptlocal.checkpoint.hf_gpt2 import hf_to_ms, ms_to_hf
from mindformers_gptlocal.errors import CheckpointError
from conftest import save_hf, source_env

CONFIGS = {
    "tiny": dict(vocab_size=300, n_positions=64, n_embd=64, n_layer=2, n_head=4),
    "gpt2-small-shape": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    "inner-relu-eps-idx": dict(vocab_size=300, n_positions=48, n_embd=96, n_layer=3, n_head=6, n_inner=200,
                               activation_function="relu", layer_norm_epsilon=1e-6,
                               scale_attn_by_inverse_layer_idx=True),
    "exact-gelu": dict(vocab_size=300, n_positions=32, n_embd=32, n_layer=2, n_head=2, activation_function="gelu"),
}


def tokens(config, batch=2, seq=None, seed=1):
    seq = seq or min(32, config["n_positions"])
    return np.random.default_rng(seed).integers(0, config["vocab_size"], (batch, seq))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_loss_match_transformers(name, tmp_path):
    config = CONFIGS[name]
    hf = save_hf(tmp_path / "hf", **config)
    hf_to_ms(str(tmp_path / "hf"), str(tmp_path / "ms"))
    ours = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "ms"))
    ours.set_train(False)
    ids = tokens(config)
    with torch.no_grad():
        out = hf(torch.from_numpy(ids), labels=torch.from_numpy(ids))
    logits = ours(Tensor(ids, ms.int32)).asnumpy()
    diff = np.abs(logits - out.logits.numpy()).max()
    print(f"{name}: max |logit diff| = {diff:.3e}")
    assert diff <= 1e-4
    ours.set_train(True)
    loss = float(ours(Tensor(ids[:, :-1], ms.int32), Tensor(ids[:, 1:], ms.int32))[0])
    assert abs(loss - float(out.loss)) <= 1e-5 * float(out.loss)


def test_round_trip_is_bit_exact_and_loads_in_transformers(tmp_path):
    config = CONFIGS["inner-relu-eps-idx"]
    hf = save_hf(tmp_path / "hf", **config)
    hf_to_ms(str(tmp_path / "hf"), str(tmp_path / "ms"))
    ms_to_hf(str(tmp_path / "ms"), str(tmp_path / "back"))
    original = load_file(str(tmp_path / "hf" / "model.safetensors"))
    back = load_file(str(tmp_path / "back" / "model.safetensors"))
    kept = {k: v for k, v in original.items() if not k.endswith((".attn.bias", ".attn.masked_bias"))}
    assert set(back) == set(kept)
    for key, value in kept.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key
    reloaded = GPT2LMHeadModel.from_pretrained(str(tmp_path / "back")).eval()
    ids = torch.from_numpy(tokens(config))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, hf(ids).logits)
    assert reloaded.config.scale_attn_by_inverse_layer_idx and reloaded.config.n_inner == 200


def test_tokenizer_files_are_carried_and_built(tmp_path):
    save_hf(tmp_path / "hf", **CONFIGS["tiny"])
    from mindformers_gptlocal.data.tokenizer import train_bpe
    train_bpe(["def f(x):\n    return x\n"] * 50, 300).model.save(str(tmp_path / "hf"))  # vocab.json, merges.txt
    hf_to_ms(str(tmp_path / "hf"), str(tmp_path / "ms"))
    names = set(os.listdir(tmp_path / "ms"))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.json"} <= names
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "ms"))
    assert tok.decode(tok("def f(x):")["input_ids"]) == "def f(x):"


def test_sharded_safetensors_and_weights_only_bin(tmp_path):
    config = CONFIGS["tiny"]
    hf = save_hf(tmp_path / "hf", **config)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="40KB")
    assert os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    hf.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    for source in ("sharded", "bin"):
        hf_to_ms(str(tmp_path / source), str(tmp_path / f"ms_{source}"))
    reference = load_file(str(tmp_path / "ms_sharded" / "model.safetensors"))
    hf_to_ms(str(tmp_path / "hf"), str(tmp_path / "ms"))
    for source in ("ms", "ms_bin"):
        other = load_file(str(tmp_path / source / "model.safetensors"))
        assert all(np.array_equal(reference[k], other[k]) for k in reference)


def _error(tmp_path, hf_dir, match):
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=match):
        hf_to_ms(str(hf_dir), str(out))
    assert not out.exists() and not [p for p in os.listdir(tmp_path) if ".partial-" in p]


def test_bad_inputs(tmp_path):
    hf_dir = tmp_path / "hf"
    _error(tmp_path, tmp_path / "missing", "does not exist")
    save_hf(hf_dir, **CONFIGS["tiny"])
    weights = load_file(str(hf_dir / "model.safetensors"))
    from safetensors.numpy import save_file
    # a wrong-shaped tensor
    bad = dict(weights, **{"transformer.h.1.mlp.c_fc.weight": np.zeros((64, 100), np.float32)})
    save_file(bad, str(hf_dir / "model.safetensors"))
    _error(tmp_path, hf_dir, r"transformer.h.1.mlp.c_fc.weight' has shape \(64, 100\)")
    # Llama keys
    save_file({"model.layers.0.self_attn.q_proj.weight": np.zeros((4, 4), np.float32)}, str(hf_dir / "model.safetensors"))
    _error(tmp_path, hf_dir, "not a GPT-2 checkpoint|not part of a GPT-2 model")
    # config that does not match the weights
    save_file(weights, str(hf_dir / "model.safetensors"))
    config = json.load(open(hf_dir / "config.json"))
    json.dump(dict(config, n_embd=32), open(hf_dir / "config.json", "w"))
    _error(tmp_path, hf_dir, "does not match these weights")
    json.dump(dict(config, model_type="llama"), open(hf_dir / "config.json", "w"))
    _error(tmp_path, hf_dir, "only GPT-2 checkpoints")
    json.dump(dict(config, reorder_and_upcast_attn=True), open(hf_dir / "config.json", "w"))
    _error(tmp_path, hf_dir, "reorder_and_upcast_attn")
    # a missing weights file
    json.dump(config, open(hf_dir / "config.json", "w"))
    os.remove(hf_dir / "model.safetensors")
    _error(tmp_path, hf_dir, "no weights found")


def test_cli_convert_round_trip(tmp_path):
    save_hf(tmp_path / "hf", **CONFIGS["tiny"])
    for args in (["hf2ms", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "ms")],
                 ["ms2hf", "--ms-dir", str(tmp_path / "ms"), "--out", str(tmp_path / "back")]):
        proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "convert", *args],
                              capture_output=True, text=True, env=source_env(), timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
    proc = subprocess.run([sys.executable, "-m", "mindformers_gptlocal.cli", "convert", "hf2ms", "--hf-dir",
                           str(tmp_path / "nope"), "--out", str(tmp_path / "x")],
                          capture_output=True, text=True, env=source_env(), timeout=300)
    assert proc.returncode == 2 and "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def _windows(path):
    from mindspore.mindrecord import FileReader
    reader = FileReader(path)
    rows = list(reader.get_next())
    reader.close()
    return np.stack([r["input_ids"] for r in rows]), np.stack([r["labels"] for r in rows])


def test_launcher_eval_and_finetune_from_converted_weights(corpus, tmp_path):
    """Eval perplexity through MindFormers equals HF's on the same tokens; finetune starts at HF's loss."""
    import re
    from conftest import Launch, step_losses, tiny_yaml
    config = dict(vocab_size=512, n_positions=64, n_embd=64, n_layer=2, n_head=4)
    hf = save_hf(tmp_path / "hf", **config)
    hf_to_ms(str(tmp_path / "hf"), str(tmp_path / "ms"))
    model_overrides = dict(model__model_config__vocab_size=512, model__model_config__max_position_embeddings=64,
                           model__model_config__hidden_size=64, model__model_config__num_hidden_layers=2,
                           model__model_config__num_attention_heads=4, model__model_config__intermediate_size=256)

    (tmp_path / "eval").mkdir()
    (tmp_path / "ft").mkdir()
    eval_yaml = tiny_yaml(tmp_path / "eval", "eval_gpt_local_tiny_cpu.yaml", corpus=corpus, eval_dataset__batch_size=1,
                          **model_overrides)
    ft_yaml = tiny_yaml(tmp_path / "ft", "finetune_gpt2_hf_cpu.yaml", corpus=corpus, runner_config__batch_size=4,
                        train_dataset__batch_size=4, train_dataset__data_loader__shuffle=False,
                        train_dataset__data_loader__num_samples=8, model__model_config__seq_length=64,
                        **model_overrides)
    # the two runs are independent: they overlap each other and the transformers references computed meanwhile
    evaluation = Launch(["--config", eval_yaml, "--load_checkpoint", str(tmp_path / "ms")], cwd=str(tmp_path / "eval"))
    finetune = Launch(["--config", ft_yaml, "--load_checkpoint", str(tmp_path / "ms"),
                       "--pretrained_model_dir", str(tmp_path / "ms")], cwd=str(tmp_path / "ft"))

    inputs, labels = _windows(corpus["eval_mindrecord"])
    with torch.no_grad():
        logits = hf(torch.from_numpy(inputs).long()).logits
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, 512), torch.from_numpy(labels).long().reshape(-1))
    hf_ppl = float(torch.exp(nll))
    train_inputs, train_labels = _windows(corpus["train_mindrecord"])
    with torch.no_grad():
        first = torch.nn.functional.cross_entropy(hf(torch.from_numpy(train_inputs[:4]).long()).logits.reshape(-1, 512),
                                                  torch.from_numpy(train_labels[:4]).long().reshape(-1))

    code, out = evaluation.result()
    assert code == 0, out[-3000:]
    ppl = float(re.search(r"^\s+PPL\s+([0-9.]+)", out, re.M).group(1))
    assert abs(ppl - hf_ppl) <= 1e-4 * hf_ppl, (ppl, hf_ppl)
    code, out = finetune.result()
    assert code == 0, out[-3000:]
    assert abs(step_losses(out)[0] - float(first)) < 1e-3, (step_losses(out), float(first))
