"""``gptlocal quantize`` (mindformers_gptlocal/quantize.py) and the int8 / bfloat16 model directories it writes:
the int8 model against the float one it came from (logits within int8 tolerance, greedy tokens), the kernel path
against the plain path at model level, the weights' size, the bfloat16 directory's weights exactly the rounded
float ones, the refusals (one line, exit 2, nothing written), and an int8 file refused by a float model."""
import json
import os

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal.cli.main import main
from mindformers_gptlocal.errors import CheckpointError, ConfigError
from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
from mindformers_gptlocal.model.quantization import QUANTIZATION, dequantize_rows
from mindformers_gptlocal.quantize import quantize_model
from mindformers_gptlocal.safetensors_io import SafetensorsReader, read_safetensors, to_bfloat16_bits, write_safetensors
from conftest import save_tiny_base

WIDER = dict(vocab_size=2048, hidden_size=128)  # the token table ~40% of the weights (GPT-2 small: 31%)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, corpus):
    root = tmp_path_factory.mktemp("quantize")
    base = save_tiny_base(root / "fp32", corpus, 3)
    quantize_model(base, str(root / "int8"), "int8", log=lambda line: None)
    quantize_model(base, str(root / "bf16"), "bfloat16", log=lambda line: None)
    return {"fp32": base, "int8": str(root / "int8"), "bf16": str(root / "bf16"), "root": root}


def _logits(model, ids):
    model.set_train(False)
    return model(Tensor(ids)).asnumpy()


def _ids(vocab, rows=2, seq=19, seed=0):
    return np.random.default_rng(seed).integers(1, vocab, (rows, seq)).astype(np.int32)


def test_int8_directory_format(dirs):
    config = json.load(open(os.path.join(dirs["int8"], "config.json"), encoding="utf-8"))
    assert config["quantization"] == QUANTIZATION and config["compute_dtype"] == "float32"
    tensors = read_safetensors(os.path.join(dirs["int8"], "model.safetensors"))
    floats = read_safetensors(os.path.join(dirs["fp32"], "model.safetensors"))
    name = "model.layers.1.mlp.linear_fc2.weight"
    assert tensors[name].dtype == np.int8 and tensors[name + "_scale"].shape == (floats[name].shape[0],)
    np.testing.assert_allclose(dequantize_rows(tensors[name], tensors[name + "_scale"]), floats[name],
                               atol=float(tensors[name + "_scale"].max()) / 2 + 1e-8, rtol=0)
    assert tensors["model.embedding.word_embeddings"].dtype == np.int8
    for kept in ("model.embedding.position_embeddings", "model.layers.0.mlp.linear_fc1.bias",
                 "model.layers.0.input_layernorm.weight"):
        assert tensors[kept].dtype == np.float32 and np.array_equal(tensors[kept], floats[kept]), kept
    for name in ("tokenizer.json", "tokenizer_id"):
        assert open(os.path.join(dirs["int8"], name), "rb").read() == open(os.path.join(dirs["fp32"], name),
                                                                           "rb").read()


LLAMA = dict(num_query_groups=2, intermediate_size=344, position_embedding_type="rope", hidden_act="swiglu",
             normalization="RMSNorm", add_bias_linear=False, untie_embeddings_and_output_weights=True)


@pytest.mark.parametrize("changes", [{}, {"untie_embeddings_and_output_weights": True}, LLAMA],
                         ids=["tied", "untied", "llama_style"])
def test_int8_logits_near_float_and_kernel_equals_plain(tmp_path, graph_mode, changes):
    """The int8 model's logits within int8 tolerance of the float model's (greedy choices mostly the same), and
    the kernel path equal to the plain MindSpore path of the same scheme (cpu_kernels: {int8_linear: plain})."""
    base = save_tiny_base(tmp_path / "fp32", None, 5, **dict(WIDER, **changes))
    quantize_model(base, str(tmp_path / "int8"), "int8", log=lambda line: None)
    ids = _ids(WIDER["vocab_size"])
    float_logits = _logits(GPTLocalForCausalLM.from_pretrained(base), ids)
    int8_model = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "int8"))
    assert int8_model.model.layers[0].mlp.linear_fc1.product.kernel is not None and int8_model.head_int8.use_kernel
    int8_logits = _logits(int8_model, ids)
    # only the int8 GEMM plain (the other kernels alike on both sides: a last-bit difference upstream may move an
    # activation across an int8 rounding boundary, a step of a whole quantum)
    plain = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "int8"), cpu_kernels={"int8_linear": "plain"})
    assert plain.head_int8.kernel is None
    plain_logits = _logits(plain, ids)
    spread = float(float_logits.max() - float_logits.min())
    assert spread > 1.0
    assert np.abs(int8_logits - float_logits).max() < 0.03 * spread
    assert np.abs(int8_logits - float_logits).max() > 0  # int8 indeed (not the float weights)
    np.testing.assert_allclose(int8_logits, plain_logits, atol=1e-5 * spread, rtol=0)
    assert (int8_logits.argmax(-1) == float_logits.argmax(-1)).mean() >= 0.9
    # every op plain (what other backends run): the same int8 tolerance of the float model
    all_plain = _logits(GPTLocalForCausalLM.from_pretrained(str(tmp_path / "int8"), cpu_kernels="plain"), ids)
    assert np.abs(all_plain - float_logits).max() < 0.03 * spread


def test_int8_generates_like_float(dirs, graph_mode):
    """Greedy 16 tokens from the quantized tiny model: mostly the float model's tokens."""
    prompt = _ids(512, rows=1, seq=5, seed=1).tolist()
    want = GPTLocalForCausalLM.from_pretrained(dirs["fp32"]).generate(prompt, max_new_tokens=16, do_sample=False)
    got = GPTLocalForCausalLM.from_pretrained(dirs["int8"]).generate(prompt, max_new_tokens=16, do_sample=False)
    want, got = np.asarray(want)[0, 5:], np.asarray(got)[0, 5:]
    assert len(got) == 16 and (got == want).mean() >= 0.75, (got, want)


def test_int8_weights_at_most_30_percent_of_float(tmp_path):
    """With the token table a realistic share of the weights (here ~40%; GPT-2 small 31%), the int8 file is at
    most 30% of the float32 one: the table is int8 too."""
    base = save_tiny_base(tmp_path / "fp32", None, 1, **WIDER)
    summary = quantize_model(base, str(tmp_path / "int8"), "int8", log=lambda line: None)
    assert summary["bytes_after"] == os.path.getsize(tmp_path / "int8" / "model.safetensors")
    assert summary["bytes_after"] <= 0.30 * os.path.getsize(os.path.join(base, "model.safetensors"))


def test_bfloat16_directory_holds_the_rounded_weights_and_generates(dirs, graph_mode):
    config = json.load(open(os.path.join(dirs["bf16"], "config.json"), encoding="utf-8"))
    assert config["compute_dtype"] == "bfloat16" and not config.get("quantization")
    reader = SafetensorsReader(os.path.join(dirs["bf16"], "model.safetensors"))
    assert {reader.header[name]["dtype"] for name in reader.names()} == {"BF16"}
    floats = read_safetensors(os.path.join(dirs["fp32"], "model.safetensors"))
    for name, value in floats.items():
        rounded = (to_bfloat16_bits(value).astype(np.uint32) << 16).view(np.float32)
        assert np.array_equal(reader.get(name), rounded), name
        assert np.abs(rounded - value).max() <= np.abs(value).max() * 2.0 ** -8
    # the loader widens the bf16 weights into the float32 Parameters (CPU: a bf16 model's Parameters are float32,
    # its GEMMs bf16) and the directory's own compute_dtype bfloat16 generates
    model = GPTLocalForCausalLM.from_pretrained(dirs["bf16"])
    assert model.model.kernels.gemm_dtype == "bfloat16"
    name = "model.layers.0.attention.linear_qkv.weight"
    param = dict((p.name, p) for p in model.get_parameters())[name]
    assert np.array_equal(param.asnumpy(), reader.get(name))
    prompt = _ids(512, rows=1, seq=5, seed=1).tolist()
    got = np.asarray(model.generate(prompt, max_new_tokens=16, do_sample=False))[0, 5:]
    assert len(got) == 16


def test_bfloat16_rounding_is_nearest_even():
    values = np.array([1.0, 1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, -2.5, 0.0, np.inf], np.float32)
    rounded = (to_bfloat16_bits(values).astype(np.uint32) << 16).view(np.float32)
    assert rounded.tolist() == [1.0, 1.0, 1.0 + 2 ** -6, -2.5, 0.0, np.inf]  # ties to even; exact stays exact
    assert np.isnan((to_bfloat16_bits(np.array([np.nan], np.float32)).astype(np.uint32) << 16).view(np.float32))[0]


def _refused(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, [line for line in err if line.startswith("gptlocal quantize: error:")]


@pytest.mark.parametrize("case", ["dtype", "no_weights", "out_not_empty", "int8_input", "bf16_input", "no_dir"])
def test_bad_input_one_line_exit_2_nothing_written(dirs, tmp_path, capsys, case):
    model, out, dtype = dirs["fp32"], tmp_path / "out", "int8"
    if case == "dtype":
        dtype = "int4"
    elif case == "no_weights":
        model = tmp_path / "bare"
        model.mkdir()
        for name in ("config.json", "tokenizer.json"):
            with open(os.path.join(dirs["fp32"], name), "rb") as handle:
                (model / name).write_bytes(handle.read())
    elif case == "out_not_empty":
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    elif case == "int8_input":
        model = dirs["int8"]
    elif case == "bf16_input":
        model = dirs["bf16"]
    elif case == "no_dir":
        model = tmp_path / "missing"
    before = sorted(os.listdir(tmp_path))
    code, lines = _refused(capsys, ["quantize", "--model", str(model), "--out", str(out), "--dtype", dtype])
    assert code == 2 and len(lines) == 1, lines
    assert {"dtype": "int4", "no_weights": "no weights", "out_not_empty": "already holds files",
            "int8_input": "already int8", "bf16_input": "already bfloat16",
            "no_dir": "config.json"}[case] in lines[0]
    assert sorted(os.listdir(tmp_path)) == before
    if case == "out_not_empty":
        assert os.listdir(out) == ["keep.txt"]


def test_cli_writes_a_directory(dirs, tmp_path, capsys):
    assert main(["quantize", "--model", dirs["fp32"], "--out", str(tmp_path / "q"), "--dtype", "int8"]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and "int8" in captured.out
    assert "quantize: layer 1" in captured.err  # progress on stderr
    assert sorted(os.listdir(tmp_path)) == ["q"]


def test_an_int8_file_is_refused_by_a_float_model_and_the_reverse(dirs):
    """Training from an int8 directory loads its weights into a float model: refused before anything is read (the
    shapes agree, the numbers would not); an int8 config with float weights too."""
    from mindformers_gptlocal.model.config import GPTLocalConfig
    float_model = GPTLocalForCausalLM(GPTLocalConfig.from_model_dir(dirs["fp32"]))
    with pytest.raises(CheckpointError, match="int8 weights.*inference only"):
        float_model.load_weights(dirs["int8"])
    int8_model = GPTLocalForCausalLM(GPTLocalConfig.from_model_dir(dirs["int8"]))
    with pytest.raises(CheckpointError, match="holds float weights but the model is int8"):
        int8_model.load_weights(dirs["fp32"])


def test_an_int8_weight_holding_minus_128_is_refused_naming_it(dirs, tmp_path):
    """The scheme is symmetric ([-127, 127]); a file with -128 (not made by quantize) would compute wrong products
    in the AVX2 int8 tiles: refused at load, naming the tensor."""
    import shutil
    folder = tmp_path / "edited"
    shutil.copytree(dirs["int8"], folder)
    tensors = read_safetensors(str(folder / "model.safetensors"))
    name = next(n for n, v in sorted(tensors.items()) if v.dtype == np.int8 and "linear_fc2" in n)
    tensors[name] = tensors[name].copy()
    tensors[name][1, 2] = -128
    write_safetensors(str(folder / "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=f"int8 tensor {name} holds -128.*gptlocal quantize --dtype int8"):
        GPTLocalForCausalLM.from_pretrained(str(folder))
    GPTLocalForCausalLM.from_pretrained(dirs["int8"])  # quantize's own directory loads


def test_quantization_key_is_checked():
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from conftest import TINY
    with pytest.raises(ConfigError, match="quantization"):
        GPTLocalConfig(**TINY, quantization={"dtype": "int4"})
    with pytest.raises(ConfigError, match="compute_dtype"):
        GPTLocalConfig(**TINY, quantization=dict(QUANTIZATION), compute_dtype="bfloat16")
    assert GPTLocalConfig(**TINY, quantization=dict(QUANTIZATION)).to_dict()["quantization"] == QUANTIZATION


def _greedy_text(model_dir, prompt, max_new):
    """model.generate's greedy text for ``prompt`` (what the CLI must print)."""
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    ids = tokenizer.encode(prompt).ids
    model = GPTLocalForCausalLM.from_pretrained(model_dir)
    eos = model.config.eos_token_id
    out = model.generate([ids], max_new_tokens=max_new, eos_token_id=eos, do_sample=False)[0][len(ids):]
    return tokenizer.decode([t for t in out if t != eos])


def test_generate_and_chat_cli_run_the_int8_directory(dirs, capsys, monkeypatch, graph_mode):
    """`gptlocal generate --model INT8` prints the int8 model's greedy text; `gptlocal chat` answers from it."""
    import io
    import sys
    prompt = "def main(args):\n    "
    expected = prompt + _greedy_text(dirs["int8"], prompt, 6) + "\n"
    assert main(["generate", "--model", dirs["int8"], "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "6", "--compile-cache", "off"]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setattr(sys, "stdin", io.StringIO("print hello\n"))
    assert main(["chat", "--model", dirs["int8"], "--temperature", "0", "--max-new-tokens", "4",
                 "--compile-cache", "off"]) == 0
    assert capsys.readouterr().out.endswith("\n")


def test_gpt2_small_int8_bytes_from_the_parameter_table():
    """GPT-2 small's int8 weights, counted from the parameter table and the format's rule (int8 + a float32 scale
    per row for the 2-D weights but the position table, float32 for the rest): 25.7% of float32's (the memory
    target is at most 30%); with a float32 token table it would be 49%."""
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.params import WORD_EMBEDDINGS, parameter_table
    from mindformers_gptlocal.model.quantization import is_quantized_name
    from mindformers_gptlocal.parallel.layout import Layout
    table = parameter_table(GPTLocalConfig(vocab_size=50257, hidden_size=768, num_hidden_layers=12,
                                           num_attention_heads=12, max_position_embeddings=1024), Layout())
    size = lambda shape: int(np.prod(shape))  # noqa: E731
    fp32 = sum(4 * size(spec.shape) for spec in table.values())
    int8 = sum(size(spec.shape) + 4 * spec.shape[0] if is_quantized_name(name, spec.shape) else 4 * size(spec.shape)
               for name, spec in table.items())
    table_fp32 = int8 + 3 * size(table[WORD_EMBEDDINGS].shape) - 4 * table[WORD_EMBEDDINGS].shape[0]
    assert round(int8 / fp32, 3) == 0.257 and 0.48 < table_fp32 / fp32 < 0.50


def test_converters_refuse_an_int8_directory(dirs, tmp_path, capsys):
    code, lines = _refused(capsys, ["quantize", "--model", dirs["int8"], "--out", str(tmp_path / "x"),
                                    "--dtype", "bfloat16"])
    assert code == 2 and "already int8" in lines[0]
    assert main(["convert", "ms2hf", "--ms-dir", dirs["int8"], "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "int8 model directory" in err and not (tmp_path / "hf").exists()
    assert main(["lora", "merge", "--base", dirs["int8"], "--adapter", dirs["fp32"], "--out", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert "int8 model directory" in err and "then quantize" in err and not (tmp_path / "m").exists()


def test_quantize_command_imports_no_mindspore(dirs, tmp_path):
    """`gptlocal quantize` is plain Python and numpy, as `gptlocal convert` (a lean process: no MindSpore loaded)."""
    import subprocess
    import sys
    from conftest import source_env
    script = ("import sys\nfrom mindformers_gptlocal.cli.main import main\n"
              f"code = main(['quantize', '--model', {dirs['fp32']!r}, '--out', {str(tmp_path / 'q')!r}, "
              "'--dtype', 'int8'])\n"
              "print('LOADED', [m for m in ('mindspore', 'mindformers', 'torch') if m in sys.modules], code)\n")
    proc = subprocess.run([sys.executable, "-c", script], env=source_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.strip().splitlines()[-1] == "LOADED [] 0", proc.stdout + proc.stderr
    assert os.path.isfile(tmp_path / "q" / "model.safetensors")


def test_an_int8_model_saves_and_loads_back(dirs, tmp_path):
    """save_pretrained of a loaded int8 model writes the same format (int8 tensors, scales, quantization)."""
    model = GPTLocalForCausalLM.from_pretrained(dirs["int8"])
    model.save_pretrained(str(tmp_path / "again"), tokenizer_dir=dirs["int8"])
    config = json.load(open(tmp_path / "again" / "config.json", encoding="utf-8"))
    assert config["quantization"] == QUANTIZATION
    saved = read_safetensors(str(tmp_path / "again" / "model.safetensors"))
    original = read_safetensors(os.path.join(dirs["int8"], "model.safetensors"))
    assert sorted(saved) == sorted(original)
    for name, value in original.items():
        assert saved[name].dtype == value.dtype and np.array_equal(saved[name], value), name


def test_lora_on_an_int8_model_is_refused():
    """pet_config or serve --lora's adapters on an int8 model: one ConfigError (its Linears hold no float weight)."""
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.layer_spec import model_layer_spec
    from conftest import TINY
    int8 = dict(TINY, quantization=dict(QUANTIZATION))
    lora = {"pet_type": "lora", "lora_rank": 4, "lora_alpha": 8, "target_modules": ".*linear_qkv",
            "freeze_include": ["*"], "freeze_exclude": ["*lora*"]}
    with pytest.raises(ConfigError, match="int8 model .* no pet_config and no --lora"):
        model_layer_spec(GPTLocalConfig(**int8, pet_config=lora))
    with pytest.raises(ConfigError, match="int8 model"):
        model_layer_spec(GPTLocalConfig(**int8), given=lambda index: {})
    spec = model_layer_spec(GPTLocalConfig(**int8))(0)
    assert {cls.__name__ for cls in spec.values()} == {"QuantLinear"} and len(spec) == 5
