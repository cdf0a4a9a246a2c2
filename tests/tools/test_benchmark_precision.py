"""The precision benchmarks' plumbing: CTranslate2's conversion of the same random HF GPT-2 runs what HF runs (only
where ctranslate2, the bench extra, is importable), the sides a run cannot have are refused or left out with one
line, PyTorch's bf16 autocast variant really computes in bf16, ours_bf16's YAML asks for bfloat16, and the accuracy
script's figures are the ones their definitions give."""
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import REPO

BENCH = os.path.join(REPO, "benchmarks")
sys.path.insert(0, BENCH)
import _common as C  # noqa: E402
import generate_throughput as G  # noqa: E402
import precision_accuracy as A  # noqa: E402

THREADS = 2
needs_ct2 = pytest.mark.skipif(importlib.util.find_spec("ctranslate2") is None,
                               reason="ctranslate2 (the bench extra) is not installed")


@pytest.fixture(scope="module")
def ct2_work(tmp_path_factory):
    """The tiny random HF GPT-2 as generate_throughput's setup saves it, and CTranslate2's conversions of it."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    work = str(tmp_path_factory.mktemp("ct2"))
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_positions=1024, **G.SHAPES["tiny"])).save_pretrained(os.path.join(work, "tiny"))
    skipped = {}
    info = G.ct2_convert(work, "tiny", list(G.CT2_SIDES), skipped)
    return work, info, skipped


@needs_ct2
def test_ct2_conversion_computes_what_hf_computes(ct2_work):
    """CTranslate2's fp32 conversion (its own converter, our word-level vocabulary) gives HF's logits and HF's greedy
    tokens on the same prompts; int8 generates the asked number of tokens; bf16 is converted exactly when
    CTranslate2 runs it on this CPU, else left out with its line."""
    import ctranslate2
    import torch
    from transformers import GPT2LMHeadModel
    work, info, skipped = ct2_work
    assert info["version"] == ctranslate2.__version__ and "float32" in info["compute_types"]
    hf = GPT2LMHeadModel.from_pretrained(os.path.join(work, "tiny")).eval()
    prompts = np.random.default_rng(3).integers(1, G.SHAPES["tiny"]["vocab_size"], (3, 7)).tolist()
    tokens = [[G.ct2_token(t) for t in p] for p in prompts]
    fp32 = ctranslate2.Generator(os.path.join(work, "tiny_ct2-fp32"), device="cpu", compute_type="float32",
                                 intra_threads=THREADS)
    logits = np.asarray(fp32.forward_batch(tokens))
    with torch.no_grad():
        expected = hf(torch.tensor(prompts)).logits.numpy()
        greedy = hf.generate(torch.tensor(prompts), attention_mask=torch.ones(3, 7, dtype=torch.long),
                             max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)[:, 7:].tolist()
    np.testing.assert_allclose(logits, expected, atol=2e-4, rtol=1e-4)
    options = dict(max_length=12, min_length=12, include_prompt_in_result=False, sampling_topk=1)
    assert [r.sequences_ids[0] for r in fp32.generate_batch(tokens, **options)] == greedy
    int8 = ctranslate2.Generator(os.path.join(work, "tiny_ct2-int8"), device="cpu", compute_type="int8",
                                 intra_threads=THREADS)
    assert all(len(r.sequences_ids[0]) == 12 for r in int8.generate_batch(tokens, **options))
    if "bfloat16" in info["compute_types"]:
        assert os.path.isdir(os.path.join(work, "tiny_ct2-bf16")) and "ct2-bf16" not in skipped
    else:
        assert not os.path.exists(os.path.join(work, "tiny_ct2-bf16"))
        assert "runs no compute_type bfloat16 on this CPU" in skipped["ct2-bf16"]


@needs_ct2
def test_ct2_worker_runs_with_the_threads_asked(ct2_work):
    """The ct2-int8 worker: threads checked in its C environment, intra_threads as asked, no PyTorch loaded (its
    peak RSS is its own), a decode rate and TTFT from NEW tokens."""
    work = ct2_work[0]
    report, _ = C.run_worker(os.path.join(BENCH, "generate_throughput.py"),
                             ["--worker", "ct2-int8", "--work", work, "--shape", "tiny", "--batch", "2",
                              "--threads", str(THREADS)], THREADS)
    assert report["env"] == {k: str(THREADS) for k in C.THREAD_VARS}
    assert report["runtime_threads"] == THREADS and report["torch_threads"] == "not loaded"
    assert report["precision"] == "int8" and report["rate"] > 0 and 0 < report["ttft"]
    assert report["peak_rss_mb"] > 0 and set(report["phases"]) == {"import", "load", "first_call", "timed"}


def test_sides_a_run_cannot_have_are_refused_in_one_line(monkeypatch, capsys):
    """--sides: an unknown name, or no peer, or a CTranslate2 side without ctranslate2: one line, exit 2."""
    for sides, line in ((("ours", "ct3-fp32"), "give a peer"), (("ours", "ours-bf16"), "give a peer"),
                        (("ours",), "give a peer")):
        with pytest.raises(SystemExit) as exit_:
            G.check_sides(sides)
        assert exit_.value.code == 2 and line in capsys.readouterr().err
    G.check_sides(("ours", "ours-bf16", "ours-int8", "hf"))  # no CTranslate2 side: ctranslate2 not needed
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ctranslate2" else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        G.check_sides(("ours", "ct2-fp32"))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "need ctranslate2==4.8.5" in err and "[bench]" in err and err.count("\n") == 1
    assert G.PRECISION["ours-bf16"] == "bf16" and G.PRECISION["ours-int8"] == G.PRECISION["ct2-int8"] == "int8"
    assert G.SIDE_OVERRIDES == {"ours-bf16": {"compute_dtype": "bfloat16"},
                                "ours-bf16-per-call": {"compute_dtype": "bfloat16"},
                                "ours-bf16-decode-kernel": {"compute_dtype": "bfloat16"},
                                "ours-bf16-compiled": {"compute_dtype": "bfloat16"}}
    assert G.PRECISION["ours-bf16-decode-kernel"] == "bf16"
    assert G.TRAINING_BUILD == ("ours-bf16-per-call",) and G.PRECISION["ours-bf16-per-call"] == "bf16"


def test_llamacpp_sides_without_their_build_are_refused_in_one_line(monkeypatch, capsys, tmp_path):
    """The llama.cpp sides: a peer on their own; without the converter's folder (not given, or a folder without
    convert_hf_to_gguf.py, conversion/, gguf-py/) or without llama_cpp: one line naming what to get, exit 2; with
    them, accepted. Their precisions pair F32 / Q8_0 / BF16 with ours fp32 / int8 / bf16."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name in ("llama_cpp", "sentencepiece") else real(name, *a))
    converter = tmp_path / "vendor" / "llama.cpp"
    for folder in (None, str(tmp_path)):
        with pytest.raises(SystemExit) as exit_:
            G.check_sides(("ours", "llamacpp-f32"), folder)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.count("\n") == 1 and "--llamacpp-converter" in err
        assert "pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36" in err
    for part in ("conversion", "gguf-py"):
        (converter / part).mkdir(parents=True)
    (converter / "convert_hf_to_gguf.py").write_text("")
    G.check_sides(("ours", "llamacpp-f32"), str(converter))  # a peer on its own, its build and converter present
    G.check_sides(("ours", "ours-int8", "hf"))  # no llama.cpp side: nothing of it needed
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(SystemExit) as exit_:
        G.check_sides(("ours", "llamacpp-q8_0"), str(converter))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert 'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36' in err
    assert [G.PRECISION.get(side, "fp32") for side in G.LLAMACPP_SIDES] == ["fp32", "int8", "bf16"]
    assert G.LLAMACPP_KV == {"llamacpp-f32": "f32", "llamacpp-q8_0": "f16", "llamacpp-bf16": "f16"}


@pytest.mark.skipif(importlib.util.find_spec("sentencepiece") is None, reason="sentencepiece is not installed")
def test_llamacpp_source_gives_the_converter_what_it_reads(tmp_path):
    """The folder llama.cpp's converter reads: the HF files linked, GPT-2's config with n_ctx = n_positions (its
    converter's key), a Llama config as saved, and a SentencePiece tokenizer.model of at most the model's vocabulary
    that encodes text to ids within it."""
    import sentencepiece
    from transformers import GPT2Config, LlamaConfig
    GPT2Config(n_positions=1024, **G.SHAPES["tiny"]).save_pretrained(tmp_path / "tiny")
    (tmp_path / "tiny" / "model.safetensors").write_bytes(b"weights")
    LlamaConfig(**G.LLAMA_SHAPES["llama-tiny"]).save_pretrained(tmp_path / "llama-tiny")
    source = G.llamacpp_source(str(tmp_path), "tiny")
    assert os.path.realpath(os.path.join(source, "model.safetensors")) == str(tmp_path / "tiny" / "model.safetensors")
    config = json.load(open(os.path.join(source, "config.json"), encoding="utf-8"))
    assert config["n_ctx"] == config["n_positions"] == 1024 and config["model_type"] == "gpt2"
    tokenizer = sentencepiece.SentencePieceProcessor(model_file=os.path.join(source, "tokenizer.model"))
    assert 100 < tokenizer.vocab_size() <= G.SHAPES["tiny"]["vocab_size"]
    ids = tokenizer.encode("gpt_local runs on the CPU")
    assert ids and max(ids) < tokenizer.vocab_size()
    llama = G.llamacpp_source(str(tmp_path), "llama-tiny")
    assert json.load(open(os.path.join(llama, "config.json"), encoding="utf-8")) == \
        json.load(open(tmp_path / "llama-tiny" / "config.json", encoding="utf-8"))


def test_greedy_agreement_counts_leading_equal_tokens():
    """The agreement line: per side, the leading new tokens equal to ours, min / median / max over sequences; a shape
    without ours' tokens gives no line."""
    assert G.leading_equal([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert G.leading_equal([1, 2], [1, 2]) == 2 and G.leading_equal([5], [6]) == 0
    rows = [("llama-tiny", 2, {"ours": [{"tokens": [[1, 2, 3], [4, 5, 6]]}],
                               "llamacpp-f32": [{"tokens": [[1, 2, 3], [4, 0, 6]]}],
                               "llamacpp-q8_0": [{"tokens": [[0, 2, 3], [4, 5, 0]]}], "hf": []}),
            ("tiny", 1, {"llamacpp-f32": [{"tokens": [[1]]}]})]
    assert list(G.agreement_lines(rows)) == ["llama-tiny, batch 2: llamacpp-f32 1 / 2 / 3, llamacpp-q8_0 0 / 1 / 2"]


def test_machine_line_tells_cpus_apart(tmp_path):
    """The machine line's CPU: vendor, family / model / stepping and the instruction sets that choose our kernels'
    paths, read from the first processor of /proc/cpuinfo; a Zen 3 and a Zen 4 that both say "AMD EPYC" differ."""
    def identity(model, flags):
        info = tmp_path / f"cpuinfo{model}"
        info.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: {model}\n"
                        f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu {flags}\n\nprocessor\t: 1\n"
                        "model\t\t: 99\nflags\t\t: amx_bf16\n")
        return C.cpu_identity(C.cpu_info(str(info)))
    zen3 = identity(1, "avx2 fma")
    assert zen3 == ("AuthenticAMD family 25 model 1 stepping 1, ISA: avx2 yes, avx512f no, avx512_bf16 no, "
                    "avx512_vnni no, avx_vnni no, amx_bf16 no, amx_int8 no")
    assert identity(17, "avx2 avx512f avx512_bf16 avx512_vnni") == (
        "AuthenticAMD family 25 model 17 stepping 1, ISA: avx2 yes, avx512f yes, avx512_bf16 yes, avx512_vnni yes, "
        "avx_vnni no, amx_bf16 no, amx_int8 no")
    assert C.cpu_identity({}) == "family/model unknown, ISA: flags unknown"
    assert C.cpu_info(str(tmp_path / "none")) == {}
    line = C.machine_line(THREADS)
    assert line.startswith(f"machine: {C.cpu_model()} ({C.cpu_identity()}), kernels' isa auto: loops ")
    assert "logical CPUs" in line.split(";")[0]  # serve_throughput quotes the line up to its first ";"


def test_torch_bf16_autocast_variant_computes_in_bf16(tmp_path):
    """sdpa+fused-bf16 trains the same model on the same tokens as sdpa+fused, under bf16 autocast: its loss is
    close to fp32's and not equal to it (fp32 would give the same bits)."""
    windows = tmp_path / "windows.npy"
    np.save(windows, np.random.default_rng(0).integers(0, 8192, (4, 33)))
    shape = json.dumps(dict(C.SHAPES["tiny"], seq=32, batch=2))
    losses = {}
    for variant in ("sdpa+fused", "sdpa+fused-bf16"):
        report, _ = C.run_worker(os.path.join(BENCH, "train_throughput.py"),
                                 ["--torch-worker", shape, "--variant", variant, "--steps", "2", "--data",
                                  str(windows), "--threads", str(THREADS)], THREADS)
        assert report["variant"] == variant and len(report["step_times"]) == 2
        losses[variant] = report["last_loss"]
    assert np.isfinite(list(losses.values())).all()
    assert 0 < abs(losses["sdpa+fused-bf16"] - losses["sdpa+fused"]) < 0.05, losses


def test_ours_bf16_side_asks_for_bfloat16(tmp_path):
    import train_throughput
    from mindformers_gptlocal import yaml_io
    corpus = tmp_path / "train.mindrecord"
    (tmp_path / "train.mindrecord.rows").write_text("8")
    shape = dict(C.SHAPES["tiny"], seq=32, batch=1)

    def model_config(side):
        path = train_throughput.side_yaml(side, shape, 2, str(corpus), str(tmp_path), side, THREADS)
        return yaml_io.load_yaml(path)["model"]["model_config"]
    assert model_config("ours_bf16")["compute_dtype"] == "bfloat16"
    assert model_config("ours")["compute_dtype"] == "float32"
    assert model_config("ours_layer_bf16")["compute_dtype"] == "bfloat16"
    assert set(train_throughput.BF16_SIDES) == {"ours_bf16", "ours_layer_bf16", "sdpa+fused-bf16", "compile-bf16"}


def test_accuracy_figures_are_their_definitions():
    """token_nll is the masked cross-entropy of the shifted labels, greedy_agreement counts equal generated tokens,
    the common start and identical continuations (the prompt left out), step_losses reads the monitor's lines."""
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((2, 5, 11)).astype(np.float32) * 4
    labels = rng.integers(0, 11, (2, 5))
    labels[1, 4] = -100
    mask = np.ones((2, 5), np.int64)
    mask[0, 0] = 0
    nll, count = A.token_nll(logits, labels, mask)
    log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum(-1, keepdims=True))
    keep = [(b, t) for b in range(2) for t in range(5) if mask[b, t] and labels[b, t] >= 0]
    assert count == len(keep) == 8
    assert nll == pytest.approx(-sum(log_probs[b, t, labels[b, t]] for b, t in keep), rel=1e-5)
    reference = [[9, 9, 1, 2, 3, 4], [9, 9, 5, 6, 7, 8]]
    other = [[9, 9, 1, 2, 3, 4], [9, 9, 5, 0, 7, 8]]
    assert A.greedy_agreement(reference, other, 2) == (7 / 8, (4 + 1) / 2, 1)
    log = ("[gptlocal] step 1/40  loss 9.0123  100 tokens/s  5 ms/step  skipped 0\n"
           "[gptlocal] step 40/40  loss 6.5  100 tokens/s  5 ms/step  skipped 0\n")
    assert A.step_losses(log) == {1: 9.0123, 40: 6.5}


def test_accuracy_script_refuses_a_missing_quickstart(tmp_path):
    out = subprocess.run([sys.executable, os.path.join(BENCH, "precision_accuracy.py"), "--quickstart",
                          str(tmp_path / "none"), "--what", "train"], capture_output=True, text=True, check=False,
                         env=C.worker_env(THREADS))
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "train.yaml is missing: run the quickstart first" in out.stderr and "--make" in out.stderr
    bad = subprocess.run([sys.executable, os.path.join(BENCH, "precision_accuracy.py"), "--precisions", "fp8"],
                         capture_output=True, text=True, check=False, env=C.worker_env(THREADS))
    assert bad.returncode == 2 and "fp8 is not one of" in bad.stderr


def test_a_failed_side_is_one_line():
    """A worker's failure as the one line the tables print: the exception line (MindSpore's message after its
    rules), and an exception's first line that says something."""
    mindspore_text = ("Traceback (most recent call last):\n  File \"x.py\", line 1\nTypeError:\n" + "-" * 40 +
                      "\n- Kernel select failed:\n" + "-" * 40 + "\nSelect CPU operator[BroadcastTo] fail! Unsupported "
                      "data type!\n- C++ Call Stack:\nmindspore/ccsrc/plugin/cpu/cpu_device_context.cc:469 X\n")
    assert C.last_error_line(mindspore_text, 1) == ("TypeError: Select CPU operator[BroadcastTo] fail! Unsupported "
                                                    "data type!")
    assert C.last_error_line("ValueError: bad\nmore\n", 1) == "ValueError: bad"
    assert C.last_error_line("", 3) == "exit status 3, no output"
    assert C.error_line(TypeError("\n----\n- Kernel select failed:\n----\nSelect CPU fail!\n")) == \
        "TypeError: Select CPU fail!"
    assert C.precision_line({"avx512_bf16", "avx512_vnni"}) == "CPU precision support: bf16: avx512_bf16; int8: " \
                                                               "avx512_vnni"
    assert "bf16: none of avx512_bf16, amx_bf16" in C.precision_line(set())
    report, _ = C.run_worker(os.path.join(BENCH, "train_throughput.py"), ["--gemm-worker", "nothing"], THREADS,
                             one_line=True)
    assert "invalid choice" in report["failed"] and "\n" not in report["failed"]


def test_host_share_splits_a_generation_at_the_library_calls():
    """generate_throughput's host_share on a tiny model (the native runner): greedy and sampled generations' time
    outside the library's step calls, per step and as a share of the whole; the runner's call is restored."""
    from mindformers_gptlocal.model.gpt import GPTLocalConfig, GPTLocalForCausalLM
    from mindformers_gptlocal.runtime import native
    from conftest import TINY
    call = native.NativeRunner._call
    model = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, max_position_embeddings=256, seq_length=256)),
                                inference=True)
    prompts = np.random.default_rng(0).integers(1, 512, (2, G.PROMPT)).tolist()
    shares = G.host_share(model, prompts, next(iter(G.LLAMA_SHAPES)))  # a Llama shape's keywords: no end token
    assert set(shares) == {"greedy", "sampled"} and native.NativeRunner._call is call
    assert all(ms > 0 and 0 < share < 1 for ms, share in shares.values()), shares
    assert shares["sampled"][0] > shares["greedy"][0]  # the host-side draw, on top of the same loop
