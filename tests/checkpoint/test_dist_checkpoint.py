"""gptlocal ckpt split / merge: per-rank shards laid out by the sharding rules, merged back bit-identical."""
import os
import shutil

import numpy as np
import pytest

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM, yaml_io
from mindformers_gptlocal.model.weights import save_weights
from mindformers_gptlocal.safetensors_io import read_safetensors
from mindformers_gptlocal.cli import main
from mindformers_gptlocal.checkpoint.distributed import SHARD_NAME, merge_checkpoint
from mindformers_gptlocal.errors import CheckpointError
from references import rank_block

SMALL = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=4,
             max_position_embeddings=16, seq_length=16, bos_token_id=0, eos_token_id=0, pad_token_id=0)
H, V, FFN = 32, 64, 64


@pytest.fixture(scope="module")
def full_ckpt(tmp_path_factory):
    """A full checkpoint with optimizer state beside the weights, as a training checkpoint has."""
    from safetensors.numpy import save_file
    folder = tmp_path_factory.mktemp("full")
    model = GPTLocalForCausalLM(GPTLocalConfig(**SMALL))
    path = str(folder / "full.safetensors")
    save_weights(model, path)
    tensors = read_safetensors(path)
    rng = np.random.default_rng(0)
    for name in ("model.layers.3.mlp.linear_fc1.weight", "model.embedding.word_embeddings"):
        tensors[f"adam_m.{name}"] = rng.normal(size=tensors[name].shape).astype(np.float32)
    tensors["global_step"] = np.array([7], np.int32)
    save_file(tensors, path, metadata={"format": "gpt_local"})
    return path


def run_yaml(tmp_path, **parallel):
    parallel.setdefault("micro_batch_num", 2 * parallel.get("pipeline_stage", 1))  # a pipeline run needs >= stages
    config = {"model": {"model_config": dict(SMALL, model_type="gpt_local", architectures=["GPTLocalForCausalLM"])},
              "parallel_config": parallel}
    return yaml_io.dump_yaml(config, str(tmp_path / "run.yaml"))


def test_split_lays_out_ranks_and_merge_is_bit_identical(full_ckpt, tmp_path, capsys):
    config = run_yaml(tmp_path, data_parallel=2, model_parallel=2, pipeline_stage=2, offset=[1, -1],
                      vocab_emb_dp=False)
    out = str(tmp_path / "dist")
    assert main(["ckpt", "split", "--ckpt", full_ckpt, "--config", config, "--out", out]) == 0
    assert sorted(os.listdir(out)) == sorted(["strategy.json"] + [f"rank_{i}" for i in range(8)])
    full = read_safetensors(full_ckpt)
    ranks = [read_safetensors(os.path.join(out, f"rank_{i}", SHARD_NAME)) for i in range(8)]
    # stage 0 = ranks 0-3 (layers 0-2 with offset [1, -1]), stage 1 = ranks 4-7 (layer 3 + final norm)
    layers = lambda shard: sorted({int(n.split(".")[2]) for n in shard if n.startswith("model.layers.")})
    assert layers(ranks[0]) == [0, 1, 2] and layers(ranks[4]) == [3]
    assert "model.final_layernorm.weight" not in ranks[0] and "model.final_layernorm.weight" in ranks[4]
    assert "model.embedding.position_embeddings" in ranks[0] and "model.embedding.position_embeddings" not in ranks[4]
    # the tied table, vocab-split: on stage 0 and the last stage; mp index = rank % 2
    table = full["model.embedding.word_embeddings"]
    for rank in (0, 1, 4, 5):
        half = rank % 2
        np.testing.assert_array_equal(ranks[rank]["model.embedding.word_embeddings"],
                                      table[half * V // 2:(half + 1) * V // 2])
    # column-parallel QKV: mp index 1 holds the second half of the rows (heads 2-3); row-parallel fc2: columns
    qkv = "model.layers.1.attention.linear_qkv.weight"
    np.testing.assert_array_equal(ranks[1][qkv], full[qkv][3 * H // 2:])
    fc2 = "model.layers.3.mlp.linear_fc2.weight"
    np.testing.assert_array_equal(ranks[5][fc2], full[fc2][:, FFN // 2:])
    np.testing.assert_array_equal(ranks[5]["model.layers.3.mlp.linear_fc2.bias"], full["model.layers.3.mlp.linear_fc2.bias"])
    # optimizer state follows its parameter; other tensors go everywhere; dp replicas are equal
    assert ranks[6]["adam_m.model.layers.3.mlp.linear_fc1.weight"].shape == (FFN // 2, H)
    assert "adam_m.model.layers.3.mlp.linear_fc1.weight" not in ranks[0]
    assert all(int(r["global_step"][0]) == 7 for r in ranks)
    for name in ranks[1]:
        np.testing.assert_array_equal(ranks[1][name], ranks[3][name])
    # a rank's slices load into that rank's real Cells (model_parallel 2)
    part = rank_block(GPTLocalConfig(**SMALL), 2, 2)
    for name, param in part.parameters_and_names():
        assert ranks[1][f"model.layers.1.{name}"].shape == tuple(param.shape), name

    merged = str(tmp_path / "merged.safetensors")
    assert main(["ckpt", "merge", "--dir", out, "--out", merged]) == 0
    back = read_safetensors(merged)
    assert sorted(back) == sorted(full)
    for name, array in full.items():
        assert back[name].dtype == array.dtype and np.array_equal(back[name], array), name
    assert "rank shards" in capsys.readouterr().out


@pytest.mark.parametrize("parallel", [dict(model_parallel=4), dict(data_parallel=1, model_parallel=1, pipeline_stage=4),
                                      dict(model_parallel=2, vocab_emb_dp=True, pipeline_stage=3, offset=[1, 0, 0])])
def test_round_trip_for_other_strategies(full_ckpt, tmp_path, parallel):
    config = run_yaml(tmp_path, **parallel)
    assert main(["ckpt", "split", "--ckpt", full_ckpt, "--config", config, "--out", str(tmp_path / "d")]) == 0
    merged = str(tmp_path / "m.safetensors")
    assert main(["ckpt", "merge", "--dir", str(tmp_path / "d"), "--out", merged]) == 0
    full, back = read_safetensors(full_ckpt), read_safetensors(merged)
    assert sorted(back) == sorted(full) and all(np.array_equal(back[n], full[n]) for n in full)


def test_merge_refuses_a_missing_rank(full_ckpt, tmp_path, capsys):
    config = run_yaml(tmp_path, model_parallel=2, pipeline_stage=2)
    out = str(tmp_path / "dist")
    assert main(["ckpt", "split", "--ckpt", full_ckpt, "--config", config, "--out", out]) == 0
    shutil.rmtree(os.path.join(out, "rank_3"))
    with pytest.raises(CheckpointError, match="rank_3"):
        merge_checkpoint(out, str(tmp_path / "m.safetensors"))
    assert main(["ckpt", "merge", "--dir", out, "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "rank_3" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "m.safetensors")


def test_split_refuses_bad_input_naming_the_key(full_ckpt, tmp_path, capsys):
    assert main(["ckpt", "split", "--ckpt", full_ckpt, "--config", run_yaml(tmp_path, model_parallel=3),
                 "--out", str(tmp_path / "d")]) == 2
    assert "num_attention_heads" in capsys.readouterr().err
    other = run_yaml(tmp_path, model_parallel=2)
    yaml = yaml_io.load_yaml(other)
    yaml["model"]["model_config"]["num_hidden_layers"] = 5
    yaml_io.dump_yaml(yaml, other)
    assert main(["ckpt", "split", "--ckpt", full_ckpt, "--config", other, "--out", str(tmp_path / "d")]) == 2
    assert "model.layers.4" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "d")


def test_llama_style_split_gives_each_rank_whole_query_groups(tmp_path):
    """GQA (4 heads, 2 groups), SwiGLU, RMSNorm, no biases, untied head: mp 2 x pp 2 shards load into the rank
    Cells, rank mp 1 holds key/value group 1 with its two query heads, and merge is bit-identical."""
    llama = dict(SMALL, position_embedding_type="rope", num_query_groups=2, hidden_act="swiglu",
                 normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True)
    model = GPTLocalForCausalLM(GPTLocalConfig(**llama))
    path = str(tmp_path / "full.safetensors")
    save_weights(model, path)
    config = {"model": {"model_config": dict(llama, model_type="gpt_local")},
              "parallel_config": {"model_parallel": 2, "pipeline_stage": 2, "micro_batch_num": 2}}
    yaml_path = yaml_io.dump_yaml(config, str(tmp_path / "run.yaml"))
    out = str(tmp_path / "dist")
    assert main(["ckpt", "split", "--ckpt", path, "--config", yaml_path, "--out", out]) == 0
    full = read_safetensors(path)
    ranks = [read_safetensors(os.path.join(out, f"rank_{i}", SHARD_NAME)) for i in range(4)]
    qkv = "model.layers.0.attention.linear_qkv.weight"  # rows [group, (q, q, k, v), 8]: group 1 = second half
    assert full[qkv].shape == ((4 + 2 * 2) * 8, H)
    np.testing.assert_array_equal(ranks[1][qkv], full[qkv][4 * 8:])
    assert "output_layer.weight" in ranks[3] and "output_layer.weight" not in ranks[1]  # untied head: last stage
    part = rank_block(GPTLocalConfig(**llama), 1, 2)
    for name, param in part.parameters_and_names():
        assert ranks[1][f"model.layers.0.{name}"].shape == tuple(param.shape), name
    merged = str(tmp_path / "merged.safetensors")
    assert main(["ckpt", "merge", "--dir", out, "--out", merged]) == 0
    back = read_safetensors(merged)
    assert sorted(back) == sorted(full) and all(np.array_equal(back[n], full[n]) for n in full)
