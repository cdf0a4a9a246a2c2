"""`gptlocal serve --lora NAME=DIR ...`: several LoRA adapters on one base model. Greedy tokens of each adapter
equal those of the model `gptlocal lora merge` makes of it (alone and when requests of different adapters share
decode steps), through the official `openai` client; `/v1/models` lists them; an unknown name is a 404 naming
'model'; adapters that do not fit the base are refused before anything is built. One server for the module."""
import json
import os
import shutil
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")

from conftest import TINY, source_env  # noqa: E402

BASE = "tiny-base"
START_TIMEOUT = 300
PROMPTS = [[5, 17, 42, 7, 99, 3, 11], [8, 1], [300, 301, 302, 303, 304], [77, 78, 79]]
# two finetunes of the base that differ in rank, alpha and target Linears
ALL = ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2"
ADAPTERS = {"sql": dict(lora_rank=4, lora_alpha=8, target_modules=ALL),
            "poem": dict(lora_rank=2, lora_alpha=16, target_modules=".*linear_qkv|.*linear_fc2")}


def _lora_dir(base, out, seed, **pet):
    """What a LoRA finetune of ``base`` writes: config.json with pet_config, the base weights + trained A/B."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.peft.lora import is_lora_name
    pet_config = dict(pet_type="lora", lora_dropout=0.0, freeze_include=["*"], freeze_exclude=["*lora*"], **pet)
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, pet_config=pet_config)))
    model.load_weights(base)
    rng = np.random.default_rng(seed)
    for param in model.get_parameters():
        if is_lora_name(param.name):  # "trained": B is no longer zero
            param.set_data(ms.Tensor(rng.normal(0, 0.15, param.shape).astype(np.float32)))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """The base, the two adapter directories and their merged models (`gptlocal lora merge`)."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.checkpoint.lora import merge
    root = tmp_path_factory.mktemp("serve_lora")
    base = str(root / BASE)
    ms.set_seed(0)
    GPTLocalForCausalLM(GPTLocalConfig(**TINY)).save_pretrained(base)
    out = {BASE: base}
    for seed, (name, pet) in enumerate(ADAPTERS.items(), start=1):
        out[name] = _lora_dir(base, str(root / name), seed, **pet)
        merge(base, out[name], str(root / f"{name}-merged"))
        out[name + "-merged"] = str(root / f"{name}-merged")
    return out


@pytest.fixture(scope="module")
def started(dirs, tmp_path_factory):
    """The server process, loading and warming up (while ``expected`` computes the reference)."""
    from conftest import free_port as _free_port
    port = _free_port()
    log_path = tmp_path_factory.mktemp("serve_lora_log") / "server.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "mindformers_gptlocal.cli", "serve", "--model", dirs[BASE],
                             "--port", str(port), "--max-batch-size", "4", "--prompt-buckets", "16",
                             "--batch-buckets", "4", "--log-level", "warning",
                             *[f"--lora={name}={dirs[name]}" for name in ADAPTERS]],
                            stdout=log, stderr=subprocess.STDOUT, env=source_env(GLOG_v="3"))
    try:
        yield proc, f"http://127.0.0.1:{port}", log_path
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(15)
        log.close()


@pytest.fixture(scope="module")
def expected(dirs, started):
    """Greedy tokens of the base and of each merged model (model.generate in this process), per prompt: one
    model, the merged weights loaded into it in turn (one compile)."""
    import mindspore as ms
    from mindformers_gptlocal import GPTLocalForCausalLM
    ms.set_context(mode=ms.GRAPH_MODE)
    out = {}
    model = GPTLocalForCausalLM.from_pretrained(dirs[BASE])
    for name in [BASE, *ADAPTERS]:
        if name != BASE:
            model.load_weights(dirs[name + "-merged"])
        seqs = model.generate(PROMPTS, max_new_tokens=12, do_sample=False, eos_token_id=-1)
        out[name] = [list(seq[len(p):]) for seq, p in zip(seqs, PROMPTS)]
        # a greedy generate once renamed them 'cache.lm.*', and the next load_weights failed
        assert all(p.name.startswith("model.") for p in model.get_parameters())
    ms.set_context(mode=ms.PYNATIVE_MODE)
    assert out["sql"] != out[BASE] and out["poem"] != out[BASE] and out["sql"] != out["poem"]  # the adapters matter
    return out


@pytest.fixture(scope="module")
def server(started, expected):
    proc, base, log_path = started
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        assert proc.poll() is None, f"server exited: {open(log_path).read()[-3000:]}"
        assert time.monotonic() < deadline, f"server not ready in {START_TIMEOUT} s: {open(log_path).read()[-3000:]}"
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return base
        except httpx.HTTPError:
            pass
        time.sleep(0.3)


def _client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)


def _ids(api, model, prompt, max_tokens=12):
    resp = api.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"return_token_ids": True})
    assert resp.model == model
    return resp.choices[0].model_extra["token_ids"]


def test_models_list_and_unknown_name(server):
    api = _client(server)
    models = api.models.list().data
    assert [m.id for m in models] == [BASE, *ADAPTERS]
    assert [m.model_extra.get("parent") for m in models] == [None, BASE, BASE]
    with pytest.raises(openai.NotFoundError) as caught:
        api.completions.create(model="sql2", prompt=[1, 2], max_tokens=2)
    assert caught.value.status_code == 404 and caught.value.param == "model"
    assert caught.value.body["code"] == "model_not_found" and "'sql'" in caught.value.body["message"]


def test_each_adapter_alone_equals_its_merged_model(server, expected):
    api = _client(server)
    for name in [BASE, *ADAPTERS]:
        for i, prompt in enumerate(PROMPTS[:2]):
            assert _ids(api, name, prompt) == expected[name][i], (name, i)


def test_adapters_mixed_in_one_step_equal_their_merged_models(server, expected):
    """Four requests of three models at once: decode steps hold rows of different adapters, each row gets
    exactly its own merged model's tokens."""
    api = _client(server)
    before = httpx.get(server + "/health", timeout=10).json()
    jobs = [("sql", 0), ("poem", 1), (BASE, 2), ("sql", 3), ("poem", 2)]
    results, barrier = {}, threading.Barrier(len(jobs))

    def run(k, name, i):
        barrier.wait(10)
        results[k] = _ids(api, name, PROMPTS[i])

    threads = [threading.Thread(target=run, args=(k, *job)) for k, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for k, (name, i) in enumerate(jobs):
        assert results[k] == expected[name][i], (name, i)
    after = httpx.get(server + "/health", timeout=10).json()
    assert after["adapters"] == list(ADAPTERS)
    assert after["mixed_adapter_steps"] - before["mixed_adapter_steps"] >= 6  # shared, not serialised


def test_multi_lora_linear_equals_per_row_merged_weights():
    """The fast path (base GEMM once, per-row low-rank part) against x (W + s B A)^T + b row by row, with
    ranks 3 and 1 padded to 3, odd sizes, rows of each adapter and of the base, index changes between calls
    of one compiled Cell."""
    import mindspore as ms
    from mindspore import Parameter, Tensor
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.layers import Linear
    from mindformers_gptlocal.model.lora_cells import MultiLoRA, MultiLoRALinear
    rng = np.random.default_rng(3)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        pairs = [(rng.normal(size=(r, 5)).astype(np.float32), rng.normal(size=(7, r)).astype(np.float32), s)
                 for r, s in ((3, 0.7), (1, 2.5))]
        a_stack, b_stack, scales = np.zeros((3, 3, 5), np.float32), np.zeros((3, 7, 3), np.float32), [0.0]
        for k, (a, b, s) in enumerate(pairs, start=1):
            a_stack[k, :len(a)], b_stack[k, :, :b.shape[1]] = a, b
            scales.append(s)
        index = Parameter(Tensor(np.zeros(5, np.int32)), name="index", requires_grad=False)
        cell = MultiLoRALinear(5, 7, 0.5, ms.float32, ms.float32, kernels=KernelProvider(), stacks=(a_stack, b_stack,
                                                                                               scales), index=index)
        assert isinstance(cell, Linear) and cell.weight.name == "weight"  # built as a Linear: the base is its own
        cell.bias.set_data(Tensor(rng.normal(size=7).astype(np.float32)))
        weight, bias = cell.weight.asnumpy().copy(), cell.bias.asnumpy().copy()
        lora = MultiLoRA(["x", "y"], index, 5)
        x = rng.normal(size=(3, 3, 5)).astype(np.float32)
        for rows in ([2, 0, 1], [1, 1, 2], [0, 0, 0]):
            lora.select(rows)
            got = cell(Tensor(x)).asnumpy()
            merged = [weight] + [weight + s * b.astype(np.float64) @ a for a, b, s in pairs]
            want = np.stack([x[r] @ merged[i].T + bias for r, i in enumerate(rows)])
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_adapters_that_do_not_fit_are_refused_at_start(dirs, tmp_path):
    from mindformers_gptlocal.errors import ConfigError
    from mindformers_gptlocal.safetensors_io import resolve_weights_file, tensor_shapes
    from mindformers_gptlocal.serve.adapters import parse_lora_options, read_adapters
    shapes = tensor_shapes(resolve_weights_file(dirs[BASE]))
    other = str(tmp_path / "other")
    shutil.copytree(dirs["sql"], other)
    config = json.load(open(os.path.join(other, "config.json")))
    config["num_attention_heads"] = 8  # same tensor shapes, another model
    json.dump(config, open(os.path.join(other, "config.json"), "w"))
    with pytest.raises(ConfigError, match=r"--lora bad=.*num_attention_heads 8.*has 4"):
        read_adapters(dirs[BASE], [("bad", other)], shapes)
    with pytest.raises(ConfigError, match="is itself a LoRA finetune"):
        read_adapters(dirs["sql"], [("poem", dirs["poem"])], shapes)
    with pytest.raises(ConfigError, match="holds no LoRA adapter tensors"):
        read_adapters(dirs[BASE], [("plain", dirs[BASE])], shapes)
    for value, match in ((f"sql{dirs['sql']}", "must be NAME=DIR"), (f"{BASE}={dirs['sql']}", "base model's served"),
                         (f"x={tmp_path / 'none'}", "not a directory")):
        with pytest.raises(ConfigError, match=match):
            parse_lora_options([value], BASE)
    with pytest.raises(ConfigError, match="another --lora"):
        parse_lora_options([f"a={dirs['sql']}", f"a={dirs['poem']}"], BASE)
    adapters, lines = read_adapters(dirs[BASE], parse_lora_options([f"p={dirs['poem']}"], BASE), shapes)
    assert adapters[0][2] == 16 / 2 and "rank 2, alpha 16, 4 Linears" in lines[0]
