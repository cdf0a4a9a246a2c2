"""Migration from MindFormers' own GPT-2 (the 1.x line): convert mf2ms/ms2mf, migrate-yaml, old MindRecord data.

The MindFormers checkpoint is built here exactly as MindFormers' ``mindformers/models/gpt2/convert_weight.py``
(mindspore-lab/mindformers, branch r1.3.0) builds it from a Hugging Face GPT-2 state dict; the YAMLs in
``tests/fixtures/mindformers_gpt2/`` are copies of that branch's ``configs/gpt2/`` files.
"""
import copy
import os

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalForCausalLM, yaml_io
from mindformers_gptlocal.checkpoint.mf_gpt2 import mf_to_ms, ms_to_mf
from mindformers_gptlocal.cli.main import main
from mindformers_gptlocal.errors import CheckpointError

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "mindformers_gpt2")
# odd sizes: head_dim 12, vocab and positions not powers of two
HF = dict(vocab_size=301, n_positions=40, n_embd=48, n_layer=3, n_head=4)


# --- MindFormers' convert_weight.py, re-implemented from its source (r1.3.0) -------------------------------------
MF_MS_NAME = ["backbone.blocks.{}.layernorm1.gamma", "backbone.blocks.{}.layernorm1.beta",
              "backbone.blocks.{}.layernorm2.gamma", "backbone.blocks.{}.layernorm2.beta",
              "backbone.blocks.{}.attention.beta", "backbone.blocks.{}.attention.masked_beta",
              "backbone.blocks.{}.attention.projection.weight", "backbone.blocks.{}.attention.projection.bias",
              "backbone.blocks.{}.attention.dense1.weight", "backbone.blocks.{}.attention.dense1.bias",
              "backbone.blocks.{}.attention.dense2.weight", "backbone.blocks.{}.attention.dense2.bias",
              "backbone.blocks.{}.attention.dense3.weight", "backbone.blocks.{}.attention.dense3.bias",
              "backbone.blocks.{}.output.mapping.weight", "backbone.blocks.{}.output.mapping.bias",
              "backbone.blocks.{}.output.projection.weight", "backbone.blocks.{}.output.projection.bias"]
MF_TORCH_NAME = ["h.{}.ln_1.weight", "h.{}.ln_1.bias", "h.{}.ln_2.weight", "h.{}.ln_2.bias", "h.{}.attn.bias",
                 "h.{}.attn.masked_bias", "h.{}.attn.c_proj.weight", "h.{}.attn.c_proj.bias",
                 "h.{}.attn.c_attn.weight.q", "h.{}.attn.c_attn.bias.q", "h.{}.attn.c_attn.weight.k",
                 "h.{}.attn.c_attn.bias.k", "h.{}.attn.c_attn.weight.v", "h.{}.attn.c_attn.bias.v",
                 "h.{}.mlp.c_fc.weight", "h.{}.mlp.c_fc.bias", "h.{}.mlp.c_proj.weight", "h.{}.mlp.c_proj.bias"]
MF_ADDITION = [("backbone.layernorm.gamma", "ln_f.weight"), ("backbone.layernorm.beta", "ln_f.bias"),
               ("backbone.embedding.word_embedding.embedding_table", "wte.weight"),
               ("backbone.embedding.position_embedding.embedding_table", "wpe.weight")]


def mindformers_convert_weight(state, output_path, layers):
    """``convert_pt_to_ms``: split c_attn into q, k, v along the last axis (``split_torch_attention``), transpose
    the names containing 'c_attn.weight', copy the rest, save with ``ms.save_checkpoint``."""
    state = dict(state)
    for name in list(state):
        if name.endswith("attn.c_attn.weight") or name.endswith("attn.c_attn.bias"):
            q, k, v = np.split(state.pop(name).numpy(), 3, -1)
            state[name + ".q"], state[name + ".k"], state[name + ".v"] = q, k, v
        else:
            state[name] = state[name].numpy()
    mapped = [(m.format(i), t.format(i)) for i in range(layers) for m, t in zip(MF_MS_NAME, MF_TORCH_NAME)]
    entries = []
    for src, tgt in mapped + MF_ADDITION:
        if tgt in state:
            value = state[tgt]
            if "c_attn.weight" in tgt:
                value = value.transpose([1, 0])
            entries.append({"data": Tensor(value), "name": src})
    ms.save_checkpoint(entries, output_path)
    return {e["name"]: e["data"].asnumpy() for e in entries}


def build_mf_gpt2(path, hidden_act="gelu"):
    """A random HF GPT-2 with non-trivial biases and norms, the MindFormers .ckpt of it and a run_gpt2.yaml of its
    sizes. MindFormers' ``gelu`` is HF's gelu_new, its ``fast_gelu`` (P.FastGeLU) HF's quick_gelu."""
    torch.manual_seed(0)
    hf_act = {"gelu": "gelu_new", "fast_gelu": "quick_gelu"}[hidden_act]
    hf = GPT2LMHeadModel(GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, activation_function=hf_act,
                                    **HF)).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                param.add_(0.1 * torch.randn_like(param))
            if name.endswith("mlp.c_fc.weight"):  # pre-activations of order 1, where the activations differ
                param.mul_(20.0)
    state = hf.transformer.state_dict()  # GPT2Model names, as the hub's pytorch_model.bin holds them
    n = HF["n_positions"]
    for i in range(HF["n_layer"]):  # the buffers older transformers saved (the hub's gpt2 file has them)
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n, dtype=torch.bool)).view(1, 1, n, n)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    ckpt = str(path / "gpt2_mf.ckpt")
    written = mindformers_convert_weight(state, ckpt, HF["n_layer"])
    config = yaml_io.load_yaml(os.path.join(DATA, "run_gpt2.yaml"))
    config["model"]["model_config"].update(vocab_size=HF["vocab_size"], seq_length=HF["n_positions"],
                                           hidden_size=HF["n_embd"], num_layers=HF["n_layer"],
                                           num_heads=HF["n_head"], hidden_dropout_rate=0.0,
                                           attention_dropout_rate=0.0, embedding_dropout_prob=0.0,
                                           hidden_act=hidden_act)
    mf_yaml = yaml_io.dump_yaml(config, str(path / "run_gpt2_tiny.yaml"))
    return {"hf": hf, "ckpt": ckpt, "written": written, "yaml": mf_yaml, "dir": path}


@pytest.fixture(scope="module")
def mf_gpt2(tmp_path_factory):
    return build_mf_gpt2(tmp_path_factory.mktemp("mf_gpt2"))


@pytest.mark.parametrize("hidden_act", ["gelu", "fast_gelu"])
def test_mf2ms_logits_equal_transformers_and_ms2mf_gives_the_checkpoint_back(hidden_act, mf_gpt2, tmp_path):
    if hidden_act != "gelu":  # the xl/13B/52B activation
        mf_gpt2 = build_mf_gpt2(tmp_path, hidden_act)
    assert any(k.endswith("attention.beta") for k in mf_gpt2["written"])  # the buffers are in the file
    out = tmp_path / "ms"
    assert main(["convert", "mf2ms", "--mf-ckpt", mf_gpt2["ckpt"], "--mf-yaml", mf_gpt2["yaml"],
                 "--out", str(out)]) == 0
    ours = GPTLocalForCausalLM.from_pretrained(str(out))
    ours.set_train(False)
    ids = np.random.default_rng(1).integers(0, HF["vocab_size"], (2, 37))
    with torch.no_grad():
        expected = mf_gpt2["hf"](torch.from_numpy(ids)).logits.numpy()
    diff = np.abs(ours(Tensor(ids, ms.int32)).asnumpy() - expected).max()
    print(f"mf2ms {hidden_act}: max |logit diff| against transformers = {diff:.3e}")
    assert diff <= 1e-4
    ours.set_train(True)  # the training graph (loss) too
    with torch.no_grad():
        hf_loss = float(mf_gpt2["hf"](torch.from_numpy(ids), labels=torch.from_numpy(ids)).loss)
    loss = float(ours(Tensor(ids[:, :-1], ms.int32), Tensor(ids[:, 1:], ms.int32))[0])
    assert abs(loss - hf_loss) <= 1e-5 * hf_loss

    back = str(tmp_path / "back.ckpt")
    assert main(["convert", "ms2mf", "--ms-dir", str(out), "--out", back]) == 0
    again = {k: v.asnumpy() for k, v in ms.load_checkpoint(back).items()}
    weights = {k: v for k, v in mf_gpt2["written"].items() if not k.endswith(("attention.beta", "masked_beta"))}
    assert set(again) == set(weights)
    for name, value in weights.items():
        assert again[name].shape == value.shape and np.array_equal(again[name], value), name
    with pytest.raises(CheckpointError, match=r"ending in \.ckpt"):
        ms_to_mf(str(out), str(tmp_path / "back.safetensors"))


def test_mf2ms_sizes_from_shapes_and_training_state_reported(mf_gpt2, tmp_path):
    """No YAML: sizes from the shapes (heads given); a training checkpoint's moments, step and scale are
    reported and dropped, the weights convert the same."""
    entries = [{"name": k, "data": Tensor(v)} for k, v in mf_gpt2["written"].items()]
    entries += [{"name": f"adam_{m}.{k}", "data": Tensor(np.full_like(v, 0.5, dtype=np.float32))}
                for m in ("m", "v") for k, v in mf_gpt2["written"].items() if "beta" not in k.split(".")[-1]
                or "layernorm" in k]
    entries += [{"name": "global_step", "data": Tensor(np.array([120], np.int32))},
                {"name": "scale_sense", "data": Tensor(np.array(65536.0, np.float32))},
                {"name": "current_iterator_step", "data": Tensor(np.array(120, np.int32))},
                {"name": "last_overflow_iterator_step", "data": Tensor(np.array(7, np.int32))}]
    ckpt = str(tmp_path / "train.ckpt")
    ms.save_checkpoint(entries, ckpt)
    from tokenizers import Tokenizer, models, trainers
    tokenizer = Tokenizer(models.BPE())
    tokenizer.train_from_iterator(["def main(): return 1"] * 4, trainers.BpeTrainer(vocab_size=40))
    os.makedirs(tmp_path / "tok")
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    summary = mf_to_ms(ckpt, str(tmp_path / "ms"), num_heads=HF["n_head"], tokenizer=str(tmp_path / "tok"))
    with open(tmp_path / "tok" / "tokenizer.json", "rb") as a, open(tmp_path / "ms" / "tokenizer.json", "rb") as b:
        assert a.read() == b.read()
    assert summary["config"]["num_hidden_layers"] == HF["n_layer"]
    assert summary["config"]["vocab_size"] == HF["vocab_size"]
    assert summary["config"]["max_position_embeddings"] == HF["n_positions"]
    moments = [e["name"] for e in entries if e["name"].startswith("adam_")]
    assert sorted(summary["dropped"]["optimizer"]) == sorted(moments)
    assert summary["dropped"]["training"] == {"global_step": 120, "scale_sense": 65536.0,
                                              "current_iterator_step": 120, "last_overflow_iterator_step": 7}
    assert any("training state dropped" in note and str(len(moments)) in note for note in summary["notes"])
    from safetensors.numpy import load_file
    with_yaml = tmp_path / "ms_yaml"
    mf_to_ms(mf_gpt2["ckpt"], str(with_yaml), mf_yaml=mf_gpt2["yaml"])
    a, b = load_file(str(tmp_path / "ms" / "model.safetensors")), load_file(str(with_yaml / "model.safetensors"))
    assert set(a) == set(b) and all(np.array_equal(a[k], b[k]) for k in a)


def test_mf2ms_lists_every_problem_in_one_error(mf_gpt2, tmp_path):
    written = dict(mf_gpt2["written"])
    written.pop("backbone.blocks.1.output.mapping.bias")
    written["backbone.blocks.0.attention.rotary.inv_freq"] = np.zeros(4, np.float32)
    written["backbone.blocks.0.attention.dense1.mindpet_delta_lora_a"] = np.zeros((2, 48), np.float32)
    ckpt = str(tmp_path / "bad.ckpt")
    ms.save_checkpoint([{"name": k, "data": Tensor(v)} for k, v in written.items()], ckpt)
    with pytest.raises(CheckpointError) as err:
        mf_to_ms(ckpt, str(tmp_path / "out"), mf_yaml=mf_gpt2["yaml"])
    message = str(err.value)
    assert "missing backbone.blocks.1.output.mapping.bias" in message
    assert "backbone.blocks.0.attention.rotary.inv_freq" in message and "1 are GPT2WithLora adapters" in message
    assert not (tmp_path / "out").exists()
    # the YAML says another size: every mismatching tensor named, in the same one error
    config = yaml_io.load_yaml(mf_gpt2["yaml"])
    config["model"]["model_config"]["hidden_size"] = 64
    other = yaml_io.dump_yaml(config, str(tmp_path / "other.yaml"))
    with pytest.raises(CheckpointError, match=r"backbone\.embedding\.word_embedding\.embedding_table is "
                                              r"\(301, 48\), expected \(301, 64\).*output\.projection.*integrated_save") as err:
        mf_to_ms(mf_gpt2["ckpt"], str(tmp_path / "out"), mf_yaml=other)
    config["model"]["model_config"].update(hidden_size=HF["n_embd"], hidden_act="hswish")
    other_act = yaml_io.dump_yaml(config, str(tmp_path / "hswish.yaml"))
    with pytest.raises(CheckpointError, match="hidden_act 'hswish' is not supported.*gelu, fast_gelu, relu"):
        mf_to_ms(mf_gpt2["ckpt"], str(tmp_path / "out"), mf_yaml=other_act)


# --- old MindRecord data ------------------------------------------------------------------------------------------
def write_mf_mindrecord(path, ids, masks, mask_column="input_mask"):
    """A MindRecord as MindFormers' GPT-2 preprocessing writes it: input_ids + a mask, seq_length + 1 a row."""
    from mindspore.mindrecord import FileWriter
    writer = FileWriter(str(path), shard_num=1, overwrite=True)
    writer.add_schema({"input_ids": {"type": "int32", "shape": [-1]}, mask_column: {"type": "int32", "shape": [-1]}},
                      "mindformers_gpt2")
    writer.write_raw_data([{"input_ids": np.asarray(i, np.int32), mask_column: np.asarray(m, np.int32)}
                           for i, m in zip(ids, masks)])
    writer.commit()
    return str(path)


def padded_rows(rows, width, vocab, seed=0):
    """Rows whose last r % 5 tokens are padding (mask 0), so the masked positions can be counted."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (rows, width))
    masks = np.ones((rows, width), np.int32)
    for r in range(rows):
        if r % 5:
            masks[r, width - r % 5:] = 0
    return ids, masks


def test_rewrite_shifts_labels_counts_masked_positions_and_refuses_wrong_width(tmp_path):
    from mindspore.mindrecord import FileReader
    ids, masks = padded_rows(9, 17, 100)
    masks[3, 4] = 0  # an interior zero: MindFormers also hid it from attention; reported
    old = write_mf_mindrecord(tmp_path / "wiki.mindrecord", ids, masks)
    assert main(["prepare-data", "--from-mf-mindrecord", old, "--seq-length", "16"]) == 0
    new = tmp_path / "wiki_gptlocal" / "wiki.mindrecord"
    reader = FileReader(str(new))
    rows = list(reader.get_next())
    reader.close()
    assert len(rows) == 9
    for row, i, m in zip(rows, ids, masks):
        assert np.array_equal(row["input_ids"], i[:-1]) and np.array_equal(row["labels"], i[1:])
        assert np.array_equal(row["loss_mask"], m[1:]) and np.array_equal(row["position_ids"], np.arange(16))
    assert main(["prepare-data", "--from-mf-mindrecord", old, "--out", str(tmp_path / "cli_out")]) == 0
    assert (tmp_path / "cli_out" / "wiki.mindrecord").is_file()
    from mindformers_gptlocal.data.mf_mindrecord import rewrite
    summary = rewrite(old, str(tmp_path / "again"))
    pads = sum(r % 5 for r in range(9))  # trailing pads, all inside mask[1:]
    assert summary["masked_positions"] == pads + 1 and summary["loss_positions"] == 9 * 16 - pads - 1
    assert summary["interior_rows"] == 1 and summary["seq_length"] == 16 and summary["mask_column"] == "input_mask"

    from mindformers_gptlocal.errors import DataError
    with pytest.raises(DataError, match=r"seq_length \+ 1 = 33 tokens.*found 9 rows of 17"):
        rewrite(old, str(tmp_path / "wrong"), seq_length=32)
    mixed = write_mf_mindrecord(tmp_path / "mixed.mindrecord", [ids[0], ids[1][:12]], [masks[0], masks[1][:12]],
                                mask_column="attention_mask")
    with pytest.raises(DataError, match="found 1 rows of 12, 1 rows of 17"):
        rewrite(mixed, str(tmp_path / "mixed_out"))
    assert not (tmp_path / "wrong").exists() and not (tmp_path / "mixed_out").exists()


# --- YAMLs --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,seq", [("run_gpt2", 1024), ("run_gpt2_xl", 1024), ("run_gpt2_13b", 2048),
                                      ("run_gpt2_lora", 1024)])
def test_migrate_yaml_of_mindformers_yamls_passes_plan_and_preflight(name, seq, tmp_path, capsys):
    from mindformers_gptlocal.cli.launcher import check_model_section, load_config
    from mindformers_gptlocal.data.mf_mindrecord import rewrite
    from mindformers_gptlocal.mf.run_yaml import preflight
    old = yaml_io.load_yaml(os.path.join(DATA, f"{name}.yaml"))
    old["train_dataset"]["data_loader"]["dataset_dir"] = write_mf_mindrecord(
        tmp_path / "old.mindrecord", *padded_rows(16, seq + 1, 50257), mask_column="attention_mask")
    old["output_dir"] = str(tmp_path / "output")
    old_yaml = yaml_io.dump_yaml(old, str(tmp_path / f"{name}.yaml"))
    rewrite(old["train_dataset"]["data_loader"]["dataset_dir"], seq_length=seq)
    new_yaml = str(tmp_path / "new.yaml")
    assert main(["migrate-yaml", old_yaml, "--out", new_yaml, "--device-target", "CPU"]) == 0
    printed = capsys.readouterr().out
    new = yaml_io.load_yaml(new_yaml)
    mc, mf = new["model"]["model_config"], old["model"]["model_config"]
    assert (mc["hidden_size"], mc["num_hidden_layers"], mc["num_attention_heads"], mc["seq_length"],
            mc["intermediate_size"]) == (mf["hidden_size"], mf["num_layers"], mf["num_heads"], mf["seq_length"],
                                         mf["hidden_size"] * mf["expand_ratio"])
    assert (mc["hidden_dropout"], mc["attention_dropout"]) == (mf["hidden_dropout_rate"], mf["attention_dropout_rate"])
    assert new["optimizer"] == {"type": "GPTLocalAdamW", "betas": [old["optimizer"]["beta1"], old["optimizer"]["beta2"]],
                                "eps": old["optimizer"]["eps"], "weight_decay": old["optimizer"]["weight_decay"]}
    assert new["lr_schedule"]["type"] == "PolynomialWithWarmUpLR"
    assert new["lr_schedule"]["learning_rate"] == old["lr_schedule"]["learning_rate"]
    assert new["parallel_config"] == old["parallel_config"] and new["recompute_config"] == old["recompute_config"]
    assert new["runner_wrapper"]["type"] == "GPTLocalTrainOneStepCell" and new["runner_config"]["sink_mode"] is False
    assert new["train_dataset"]["data_loader"]["dataset_dir"] == str(tmp_path / "old_gptlocal" / "old.mindrecord")
    kinds = [c["type"] for c in new["callbacks"]]
    assert "ObsMonitor" not in kinds and "GPTLocalCheckpointMonitor" in kinds
    for said in ("ObsMonitor dropped", "sink_mode True -> False", "FusedAdamWeightDecay -> GPTLocalAdamW",
                 "MFTrainOneStepCell -> GPTLocalTrainOneStepCell", "remote_save_url dropped"):
        assert said in printed, said
    with open(new_yaml, encoding="utf-8") as handle:
        assert "# - callbacks ObsMonitor dropped" in handle.read()  # the notes head the new YAML too
    assert mc["hidden_act"] == {"gelu": "gelu_new", "fast_gelu": "quick_gelu"}[mf["hidden_act"]]
    if name == "run_gpt2_lora":
        assert mc["pet_config"]["lora_rank"] == 64 and mc["pet_config"]["target_modules"] == ".*linear_qkv"
    assert main(["plan", "--config", new_yaml]) == 0
    config = load_config(["--config", new_yaml])
    check_model_section(config)
    preflight(config, log=lambda _: None)


# --- all three together: a migrated run -----------------------------------------------------------------------
def test_migrated_run_starts_at_mindformers_loss_and_trains(tmp_path):
    """Old checkpoint (mf2ms), old YAML (migrate-yaml) and old data (--from-mf-mindrecord): the first step's loss
    is GPT2LMHeadModel's (logits of input_ids[:-1], targets input_ids[1:], mask[1:] weights, here from the HF
    model the checkpoint came from) and the loss falls over 4 steps. With fast_gelu, as the xl/13B/52B YAMLs."""
    from conftest import run_launcher, step_losses
    mf_gpt2 = build_mf_gpt2(tmp_path, "fast_gelu")
    seq = 32
    rng = np.random.default_rng(3)
    base = rng.integers(0, HF["vocab_size"], (4, seq + 1))
    masks = np.ones((4, seq + 1), np.int32)
    masks[1, -12:] = 0
    masks[2, -20:] = 0  # right padding, as MindFormers' preprocessing writes it
    ids, masks = np.tile(base, (4, 1)), np.tile(masks, (4, 1))  # 16 rows: the same batch of 4 each step
    old_data = write_mf_mindrecord(tmp_path / "wiki.mindrecord", ids, masks, mask_column="attention_mask")
    assert main(["prepare-data", "--from-mf-mindrecord", old_data, "--seq-length", str(seq)]) == 0
    model_dir = str(tmp_path / "gpt2_ms")
    from tokenizers import Tokenizer, models, trainers  # the run saves a model directory: it needs a tokenizer
    tokenizer = Tokenizer(models.BPE())
    tokenizer.train_from_iterator(["def main(): return 1"] * 4, trainers.BpeTrainer(vocab_size=40))
    os.makedirs(tmp_path / "tok")
    tokenizer.save(str(tmp_path / "tok" / "tokenizer.json"))
    assert main(["convert", "mf2ms", "--mf-ckpt", mf_gpt2["ckpt"], "--mf-yaml", mf_gpt2["yaml"],
                 "--tokenizer", str(tmp_path / "tok"), "--out", model_dir]) == 0

    old = yaml_io.load_yaml(mf_gpt2["yaml"])  # run_gpt2.yaml of r1.3.0 at the test model's sizes
    old["model"]["model_config"].update(seq_length=seq, max_position_embeddings=HF["n_positions"],
                                        embedding_dropout_prob=0.0)  # GPT2Config's default is 0.1
    old.update(run_mode="finetune", output_dir=str(tmp_path / "output"))
    old["runner_config"].update(epochs=1, batch_size=4)
    old["train_dataset"].update(batch_size=4, num_parallel_workers=1)
    old["train_dataset"]["data_loader"].update(dataset_dir=old_data, shuffle=False)
    old["lr_schedule"].update(learning_rate=0.005, lr_end=0.001)
    next(c for c in old["callbacks"] if c["type"] == "CheckpointMonitor")["save_checkpoint_steps"] = 1000
    old_yaml = yaml_io.dump_yaml(old, str(tmp_path / "run_gpt2_tiny.yaml"))
    new_yaml = str(tmp_path / "gpt_local.yaml")
    assert main(["migrate-yaml", old_yaml, "--out", new_yaml, "--device-target", "CPU", "--model-dir", model_dir]) == 0

    code, out = run_launcher(["--config", new_yaml], cwd=str(tmp_path))
    assert code == 0, out[-3000:]
    losses = step_losses(out)
    with torch.no_grad():
        logits = mf_gpt2["hf"](torch.from_numpy(base[:, :-1])).logits
        per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, HF["vocab_size"]),
                                                      torch.from_numpy(base[:, 1:]).reshape(-1), reduction="none")
        weight = torch.from_numpy(masks[:4, 1:].astype(np.float32)).reshape(-1)
        expected = float((per_token * weight).sum() / weight.sum())
    unmasked = float(per_token.mean())
    print("migrated run losses", losses, "MindFormers' first-step loss", expected, "without the mask", unmasked)
    assert len(losses) == 4
    assert abs(losses[0] - expected) < 1e-5 * expected < abs(unmasked - expected)  # fp32: 3e-7 seen
    assert losses[-1] < losses[0] - 0.1


def test_migrate_yaml_loads_neither_mindspore_nor_mindformers(tmp_path):
    """migrate-yaml is YAML work: it runs without MindSpore, MindFormers or torch."""
    import subprocess
    import sys
    from conftest import source_env
    code = ("import sys\nfrom mindformers_gptlocal.cli.main import main\n"
            "assert main(['migrate-yaml', sys.argv[1], '--out', sys.argv[2]]) == 0\n"
            "print('HEAVY', sorted({m.split('.')[0] for m in sys.modules} & {'mindspore', 'mindformers', 'torch'}))\n")
    out = subprocess.run([sys.executable, "-c", code, os.path.join(DATA, "run_gpt2_13b.yaml"), str(tmp_path / "n.yaml")],
                         capture_output=True, text=True, env=source_env())
    assert "HEAVY []" in out.stdout, out.stdout + out.stderr[-2000:]
    assert yaml_io.load_yaml(str(tmp_path / "n.yaml"))["context"]["device_target"] == "Ascend"  # kept without flag


def test_quick_gelu_is_mindspore_fastgelu_and_gets_a_shard_strategy():
    """quick_gelu (MindFormers' fast_gelu) is P.FastGeLU, x * sigmoid(1.702 x), and tensor parallel splits it like
    the other activations (columns of the ffn)."""
    from mindformers_gptlocal import GPTLocalConfig
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.layers import Activation
    from mindformers_gptlocal.parallel.sharding import apply_sharding
    x = np.linspace(-8, 8, 97, dtype=np.float32)
    out = Activation("quick_gelu", KernelProvider())(Tensor(x)).asnumpy()
    assert np.abs(out - x / (1 + np.exp(-1.702 * x))).max() < 1e-6
    config = GPTLocalConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                            max_position_embeddings=16, seq_length=16, hidden_act="quick_gelu", hidden_dropout=0.0,
                            attention_dropout=0.0,
                            parallel_config={"data_parallel": 2, "model_parallel": 2})
    applied = apply_sharding(GPTLocalForCausalLM(config), config)
    assert applied["model.layers.0.mlp.activation.fast_gelu"] == ((2, 1, 2),)


def test_migrate_yaml_keeps_bfloat16_on_cpu_and_drops_fp16(tmp_path, capsys):
    """A bf16 YAML keeps compute_dtype bfloat16 on CPU (bf16 GEMMs there) and needs no loss scale; float16 still
    becomes float32 there."""
    old = yaml_io.load_yaml(os.path.join(DATA, "run_gpt2.yaml"))
    old["model"]["model_config"].update(compute_dtype="bfloat16", layernorm_compute_type="float16")
    old["runner_wrapper"]["scale_sense"] = {"type": "DynamicLossScaleUpdateCell", "loss_scale_value": 65536}
    old_yaml = yaml_io.dump_yaml(old, str(tmp_path / "bf16.yaml"))
    new_yaml = str(tmp_path / "new.yaml")
    assert main(["migrate-yaml", old_yaml, "--out", new_yaml, "--device-target", "CPU"]) == 0
    printed = capsys.readouterr().out
    new = yaml_io.load_yaml(new_yaml)
    mc = new["model"]["model_config"]
    assert mc["compute_dtype"] == "bfloat16" and mc["layernorm_compute_dtype"] == "float32"
    assert new["runner_wrapper"]["scale_sense"] == 1.0
    assert "compute_dtype bfloat16 kept" in printed and "layernorm_compute_dtype float16 -> float32" in printed
