"""Prefix tuning / P-Tuning v2 (``pet_config.pet_type: prefixtuning | ptuning2``, peft/prefix*.py) against peft
on the same prefix weights: forward logits and the prefix's gradient, a GQA (Llama-style) model too; the KV-cache
path equals the uncached forward; training moves only the prefix (base bit-identical); a model directory saves
and loads its prefix and `convert ms2hf --peft` writes a PrefixTuningConfig adapter peft loads with equal logits;
bad settings are one clear error."""
import json
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import ConfigError
from conftest import TINY

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

PTUNING2 = dict(pet_type="ptuning2", pre_seq_len=5, prefix_projection=False, dropout_prob=0.0)
PREFIXTUNING = dict(pet_type="prefixtuning", prefix_token_num=3, mid_dim=24, dropout_rate=0.0)
LLAMA_GQA = dict(position_embedding_type="rope", num_query_groups=2, gated_linear_unit=True, hidden_act="swiglu",
                 normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=False,
                 untie_embeddings_and_output_weights=True, intermediate_size=96)


@pytest.fixture(scope="module", autouse=True)
def pynative():
    ms.set_context(mode=ms.PYNATIVE_MODE)


def build(pet, seed=3, **arch):
    ms.set_seed(seed)
    return GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, seq_length=48, **arch), pet_config=dict(pet)))


def to_hf(model, out):
    """The base weights through `gptlocal convert ms2hf` -> a transformers model (fp32, eval)."""
    from transformers import AutoModelForCausalLM
    from mindformers_gptlocal.cli.main import main
    model.save_pretrained(str(out / "ms"))
    assert main(["convert", "ms2hf", "--ms-dir", str(out / "ms"), "--out", str(out / "hf")]) == 0
    return AutoModelForCausalLM.from_pretrained(str(out / "hf"), torch_dtype=torch.float32).eval()


def peft_twin(model, hf):
    """peft's PrefixTuning model on ``hf`` with our prefix weights copied in."""
    spec = model.config.prefix_spec()
    config = peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=spec.tokens,
                                     prefix_projection=spec.projection,
                                     encoder_hidden_size=spec.hidden if spec.projection else None)
    twin = peft.get_peft_model(hf, config)
    ours = {name.split("prefix_encoder.", 1)[1]: p.asnumpy() for name, p in model.parameters_and_names()
            if "prefix_encoder." in name}
    encoder = twin.prompt_encoder["default"]
    with torch.no_grad():
        encoder.embedding.weight.copy_(torch.from_numpy(ours["embedding"]))
        if spec.projection:
            for i, part in ((0, "transform_in"), (2, "transform_out")):
                encoder.transform[i].weight.copy_(torch.from_numpy(ours[f"{part}.weight"]))
                encoder.transform[i].bias.copy_(torch.from_numpy(ours[f"{part}.bias"]))
    return twin


def ours_logits_and_grad(model, ids, probe):
    """Our logits [B, S, V] and d(sum(logits * probe))/d(prefix embedding)."""
    model.set_train(False)
    embedding = [p for n, p in model.parameters_and_names() if n == "model.prefix_encoder.embedding"][0]
    weights = ms.ParameterTuple([embedding])

    def loss(x):
        return (model(x) * Tensor(probe)).sum()
    logits = model(Tensor(ids)).asnumpy()
    grad = ms.grad(loss, grad_position=None, weights=weights)(Tensor(ids))[0].asnumpy()
    return logits, grad


@pytest.mark.parametrize("pet,arch", [(PTUNING2, {}), (PREFIXTUNING, {}), (PTUNING2, LLAMA_GQA)],
                         ids=["ptuning2-gpt2", "prefixtuning-mlp-gpt2", "ptuning2-llama-gqa"])
def test_logits_and_prefix_gradient_equal_peft(tmp_path, pet, arch):
    model = build(pet, **arch)
    twin = peft_twin(model, to_hf(model, tmp_path)).eval()
    rng = np.random.default_rng(0)
    ids = rng.integers(0, TINY["vocab_size"], (2, 11)).astype(np.int32)
    probe = rng.standard_normal((2, 11, TINY["vocab_size"])).astype(np.float32)
    logits, grad = ours_logits_and_grad(model, ids, probe)
    out = twin(input_ids=torch.from_numpy(ids.astype(np.int64))).logits
    (out * torch.from_numpy(probe)).sum().backward()
    np.testing.assert_allclose(logits, out.detach().numpy(), atol=1e-4, rtol=0)
    reference = twin.prompt_encoder["default"].embedding.weight.grad.numpy()
    np.testing.assert_allclose(grad, reference, atol=1e-4 * max(1.0, np.abs(reference).max()), rtol=1e-4)
    base = twin.get_base_model()(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.detach().numpy()
    assert np.abs(base - logits).max() > 1e-2  # the prefix matters


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A P-Tuning v2 model (its prefix as initialised: N(0, 1), as peft's) saved as a model directory; the
    parameter table sizes it. Training through MindFormers' trainer: test_mindformers_yaml_run_..."""
    from mindformers_gptlocal.model.params import parameter_table
    out = tmp_path_factory.mktemp("prefix")
    model = build(dict(PTUNING2, pre_seq_len=4), seed=7)
    table = parameter_table(model.config)
    assert {n: s.shape for n, s in table.items()} == {n: tuple(p.shape) for n, p in model.parameters_and_names()}
    assert [p.name for p in model.trainable_params()] == ["model.prefix_encoder.embedding"]
    model.set_train(False)
    model.save_pretrained(str(out / "tuned"))
    ids = np.random.default_rng(1).integers(0, TINY["vocab_size"], (2, 9)).astype(np.int32)
    return dict(model=model, dir=str(out / "tuned"), root=out, ids=ids, logits=model(Tensor(ids)).asnumpy())


def test_kv_cache_equals_the_uncached_forward(tuned):
    """Prefill then one-token decodes through the KV cache give the uncached forward's logits at each
    position (the prefix in front of the cached rows, positions after it)."""
    model, ids = tuned["model"], tuned["ids"]
    full = model(Tensor(ids)).asnumpy()
    cache = model.kv_cache(2, 32)
    prompt = 7
    logits = cache.prefill([list(r[:prompt]) for r in ids])
    np.testing.assert_allclose(logits, full[:, prompt - 1], atol=1e-4, rtol=0)
    for pos in range(prompt, ids.shape[1]):
        logits = cache.decode(ids[:, pos], [pos, pos])
        np.testing.assert_allclose(logits, full[:, pos], atol=1e-4, rtol=0)


def test_model_dir_loads_its_prefix_and_a_base_dir_refuses_it(tuned):
    from mindformers_gptlocal.errors import CheckpointError
    loaded = GPTLocalForCausalLM.from_pretrained(tuned["dir"])
    loaded.set_train(False)
    np.testing.assert_array_equal(loaded(Tensor(tuned["ids"])).asnumpy(), tuned["logits"])
    plain = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    with pytest.raises(CheckpointError, match="prefix-tuning prefix .* but the model has none.*pet_config"):
        plain.load_weights(tuned["dir"])


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """`gptlocal run` of MindFormers' finetune YAML with pet_type ptuning2 on a saved base (max positions = the
    data's 64 tokens + the 4 prefix tokens): the base directory, the run's folder and its log."""
    from conftest import run_launcher
    from conftest import write_yaml
    root = tmp_path_factory.mktemp("prefix_run")
    ms.set_seed(5)
    base = root / "base"
    positions = TINY["seq_length"] + 4  # the real tokens' positions follow the 4 prefix tokens
    GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, max_position_embeddings=positions))).save_pretrained(
        str(base), tokenizer_dir=corpus["model_dir"])
    pet = dict(PTUNING2, pre_seq_len=4)
    changes = dict(train_dataset__data_loader__num_samples=4 * 8, model__model_config__pet_config=pet,
                   model__model_config__max_position_embeddings=positions,
                   load_checkpoint=str(base), lr_schedule__learning_rate=5e-2, lr_schedule__lr_end=5e-2)
    yaml = write_yaml(root / "run", corpus, "finetune_gpt_local_tiny_cpu.yaml", **changes)
    code, out = run_launcher(["--config", yaml], cwd=str(root / "run"))
    assert code == 0, out[-3000:]
    return dict(base=base, model=root / "run" / "output" / "model", log=out)


def test_mindformers_yaml_run_trains_only_the_prefix(run):
    """The log states the trainable count, MindFormers' own PetModel does not wrap the model, only the prefix
    moves and the loss falls."""
    from safetensors.numpy import load_file
    from conftest import step_losses
    count = 4 * TINY["num_hidden_layers"] * 2 * TINY["hidden_size"]
    assert f"ptuning2: {count:,} trainable parameters" in run["log"], run["log"][-3000:]
    before = load_file(str(run["base"] / "model.safetensors"))
    after = load_file(str(run["model"] / "model.safetensors"))
    assert set(after) - set(before) == {"model.prefix_encoder.embedding"}
    for name, value in before.items():
        assert np.array_equal(after[name], value), f"{name} changed: a frozen base weight was trained"
    losses = step_losses(run["log"])
    assert len(losses) == 8 and np.mean(losses[-2:]) < np.mean(losses[:2]), losses


def test_serve_and_eval_read_the_prefix(run):
    """The run's model directory under `gptlocal serve`'s engine (greedy) and the lm-eval model
    (loglikelihood_rolling) gives what the uncached forward of the prefix model gives; the context they
    offer is max_position_embeddings less the prefix."""
    import threading
    from lm_eval.api.instance import Instance
    from mindformers_gptlocal.evaluation.harness import GPTLocalLM
    from mindformers_gptlocal.serve.engine import Engine
    from mindformers_gptlocal.serve.scheduler import Request
    model_dir = str(run["model"])
    model = GPTLocalForCausalLM.from_pretrained(model_dir)
    model.set_train(False)
    assert model.token_positions == TINY["seq_length"]

    def forward(ids):
        return model(Tensor(np.asarray([ids], np.int32))).asnumpy()[0]
    prompt, new = [5, 17, 42, 7, 99, 3], 4
    expected = list(prompt)
    for _ in range(new):
        expected.append(int(forward(expected)[-1].argmax()))

    lm = GPTLocalLM(pretrained=model_dir, batch_size=1, progress=False, mode="pynative")
    assert lm.max_length == TINY["seq_length"]
    text = "def main():\n    return 0\n"
    ids = lm.tok_encode(text)
    logits = forward([lm.prefix_token_id] + ids[:-1])
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (text,), 0)])[0]
    np.testing.assert_allclose(rolling, logp[np.arange(len(ids)), ids].sum(), rtol=1e-4)

    engine = Engine(model_dir, max_batch_size=1, max_model_len=32, prompt_buckets=[16], batch_buckets=[1])
    done, tokens = threading.Event(), []

    def emit(event):
        if event[0] == "token":
            tokens.append(event[2])
        else:
            done.set()
    try:
        engine.start()
        assert engine.ready.wait(600) and not engine.failed, engine.failed
        engine.submit(Request(prompt, new, emit, temperature=0.0))
        assert done.wait(120)
    finally:
        engine.stop()
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert tokens == expected[len(prompt):]


@pytest.mark.parametrize("pet,pattern", [
    (dict(PTUNING2, lora_rank=8), r"pet_config.lora_rank is not a ptuning2 setting; ptuning2 takes pre_seq_len"),
    (dict(PTUNING2, pre_seq_len=0), r"pet_config.pre_seq_len must be a positive integer, got 0"),
    (dict(PTUNING2, prefix_projection="yes"), r"pet_config.prefix_projection must be true or false"),
    (dict(PREFIXTUNING, dropout_rate=1.0), r"pet_config.dropout_rate must be in \[0, 1\), got 1.0"),
    (dict(PREFIXTUNING, mid_dim=-2), r"pet_config.mid_dim must be a positive integer"),
    (dict(PTUNING2, pre_seq_len=64), r"pet_config.pre_seq_len 64 leaves no room in max_position_embeddings \(64\)"),
    (dict(PTUNING2, pre_seq_len=20), r"prefix of 20 tokens \+ model_config.seq_length 48 is more than "
                                     r"max_position_embeddings \(64\).*seq_length: 44"),
])
def test_bad_prefix_config_is_one_clear_error(pet, pattern):
    with pytest.raises(ConfigError, match=pattern):
        GPTLocalConfig(**dict(TINY, seq_length=48), pet_config=pet)


def test_mindformers_defaults_and_table():
    """MindFormers' defaults (pet_config.py) when only pet_type is given; the table sizes the prefix."""
    from mindformers_gptlocal.peft.prefix import read as read_prefix_config
    from mindformers_gptlocal.model.params import parameter_table
    assert tuple(read_prefix_config({"pet_type": "ptuning2"})) == ("ptuning2", 128, False, 128, 0.01)
    assert tuple(read_prefix_config({"pet_type": "prefixtuning"})) == ("prefixtuning", 128, True, 512, 0.1)
    config = dict(TINY, seq_length=48, num_query_groups=2, pet_config=PREFIXTUNING)
    table = {n: s.shape for n, s in parameter_table(config).items() if "prefix" in n}
    kv = 2 * TINY["hidden_size"] // TINY["num_attention_heads"]
    assert table == {"model.prefix_encoder.embedding": (3, kv), "model.prefix_encoder.transform_in.weight": (24, kv),
                     "model.prefix_encoder.transform_in.bias": (24,),
                     "model.prefix_encoder.transform_out.weight": (2 * 2 * kv, 24),
                     "model.prefix_encoder.transform_out.bias": (2 * 2 * kv,)}


def test_peft_export_loads_in_peft_with_equal_logits(tuned):
    """ms2hf of the tuned directory (the base weights) + ms2hf --peft (the prefix): transformers' model with
    peft.PeftModel.from_pretrained gives our prefix model's logits; the MLP form exports its output."""
    from transformers import AutoModelForCausalLM
    from mindformers_gptlocal.cli.main import main
    root = tuned["root"]
    hf_base, adapter = str(root / "hf_base"), str(root / "peft")
    assert main(["convert", "ms2hf", "--ms-dir", tuned["dir"], "--out", hf_base]) == 0
    assert main(["convert", "ms2hf", "--ms-dir", tuned["dir"], "--out", adapter, "--peft"]) == 0
    config = json.load(open(os.path.join(adapter, "adapter_config.json"), encoding="utf-8"))
    assert config["peft_type"] == "PREFIX_TUNING" and config["num_virtual_tokens"] == 4
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(hf_base), adapter).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.from_numpy(tuned["ids"].astype(np.int64))).logits.numpy()
    np.testing.assert_allclose(logits, tuned["logits"], atol=1e-4, rtol=0)
    # the MLP form: the exported table is the MLP's output, peft's get_prompt_embedding_to_save
    mlp = build(PREFIXTUNING, seed=11)
    mlp.save_pretrained(str(root / "mlp"))
    assert main(["convert", "ms2hf", "--ms-dir", str(root / "mlp"), "--out", str(root / "mlp_peft"), "--peft"]) == 0
    from safetensors.numpy import load_file
    from mindformers_gptlocal.model.prefix_cells import prefix_table
    exported = load_file(str(root / "mlp_peft" / "adapter_model.safetensors"))["prompt_embeddings"]
    rows = prefix_table(mlp)  # [layers*2, G, P, D] -> peft's [P, layers*2*G*D]
    np.testing.assert_allclose(exported, rows.transpose(2, 0, 1, 3).reshape(rows.shape[2], -1), atol=1e-5, rtol=0)


def test_migrate_yaml_keeps_a_prefix_pet_config():
    from mindformers_gptlocal.migrate.mf_yaml import _pet_config
    notes = []
    assert _pet_config({"pet_type": "ptuning2", "pre_seq_len": 8, "prefix_projection": True}, notes) == \
        {"pet_type": "ptuning2", "pre_seq_len": 8, "prefix_projection": True}
    assert "seq_length + the prefix must fit max_position_embeddings" in notes[0]
    with pytest.raises(ConfigError, match="'slora': gpt_local has LoRA, prefixtuning and ptuning2"):
        _pet_config({"pet_type": "slora"}, [])


def test_prefix_dropout_is_counter_based():
    """The prefix's dropout (``dropout_prob`` > 0) draws its masks from the counter stream (model/dropout.py,
    site ``dropout_site(part="prefix")``): each element is 0 or the eval value / (1 - p), the same step gives
    the same mask, another step another, about p of the rows dropped; at eval it is the identity."""
    from mindformers_gptlocal.model.dropout import CounterDropout, PREFIX_SITE, dropout_site
    p = 0.3
    model = build(dict(PTUNING2, pre_seq_len=6, dropout_prob=p))
    encoder = model.model.prefix_encoder
    assert isinstance(encoder.dropout, CounterDropout) and encoder.dropout.site == dropout_site(part="prefix")
    assert PREFIX_SITE not in {dropout_site(1, part) for part in ("attention_probs", "attention_output",
                                                                 "mlp_output")}
    encoder.set_train(False)
    plain = np.stack([r.asnumpy() for r in encoder(Tensor(3, ms.int32))])
    encoder.set_train(True)
    drawn = {step: np.stack([r.asnumpy() for r in encoder(Tensor(step, ms.int32))]) for step in (3, 4)}
    again = np.stack([r.asnumpy() for r in encoder(Tensor(3, ms.int32))])
    np.testing.assert_array_equal(again, drawn[3])
    for rows in drawn.values():
        kept = rows != 0
        np.testing.assert_allclose(rows[kept], plain[kept] / (1 - p), rtol=1e-6)
        assert abs(1 - kept.mean() - p) < 0.05, kept.mean()
    assert (drawn[3] != drawn[4]).mean() > 0.2


def test_prefix_dropout_run_resumes_exactly(tmp_path, corpus):
    """A new run resumed from the step-3 checkpoint of a 6-step P-Tuning v2 run with dropout_prob 0.2
    (``--resume_training <file>``) repeats the uninterrupted run's losses bit for bit (the pattern of
    test_lora.py's resume test): the prefix's dropout masks follow the saved forward counter."""
    from conftest import finetune_resumes_exactly, save_tiny_base
    steps, half = 6, 3
    positions = TINY["seq_length"] + 4
    base = save_tiny_base(tmp_path / "base", corpus, seed=5, max_position_embeddings=positions)
    finetune_resumes_exactly(tmp_path, corpus, steps, half, train_dataset__data_loader__num_samples=4 * steps,
                             model__model_config__pet_config=dict(PTUNING2, pre_seq_len=4, dropout_prob=0.2),
                             model__model_config__max_position_embeddings=positions,
                             load_checkpoint=base, lr_schedule__learning_rate=5e-2, lr_schedule__lr_end=5e-2)
