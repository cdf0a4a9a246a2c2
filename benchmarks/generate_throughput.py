"""Generation speed of gpt_local's KV cache against Hugging Face `generate` (PyTorch, with its cache), CTranslate2 and
llama.cpp, same weights, same prompts, same machine, same run; GPT-2 and Llama-style models.

    python benchmarks/generate_throughput.py                      # tiny and GPT-2 small, batch 1 and 8
    python benchmarks/generate_throughput.py --shapes tiny --batches 1
    python benchmarks/generate_throughput.py --shapes llama --batches 1,8 --forward   # Llama-style ~124M, + forward

Shapes: tiny (GPT-2 layout, 4 x 256, vocab 8,192), small (GPT-2 small), llama (Llama-style ~124M: 12 x 768, 12 heads
over 4 key/value groups, SwiGLU 2,048, RMSNorm, rope, no biases, untied 32,000 head; HF ``LlamaForCausalLM``),
llama-tiny (the same layout at 4 x 256, 8 heads over 2 groups, vocab 8,192). For each shape a random HF model is saved
and converted with `gptlocal convert hf2ms` (``checkpoint/hf_models.py``). Prompts are
32 random tokens, 128 new tokens, greedy (no EOS). Time to first token (TTFT) = the prefill call;
decode tokens/s = batch x (new tokens - 1) / time after the first token; the TTFT is the median of TTFT_CALLS
calls. Each side gets one warm-up generation first (ours compiles its prefill and decode graphs there; the
compile time is printed). Also reported: our cache against our own recomputation of the whole sequence per token.
``--forward``: also one forward over [batch, 256] (tokens/s after a warm-up call, median of FORWARD_REPEATS calls, and
its own peak RSS: a worker of its own per side), ours and HF sides.

Each measurement is its own worker process, started with an explicit environment (OMP_NUM_THREADS =
MKL_NUM_THREADS = OPENBLAS_NUM_THREADS = --threads) that it checks in its C environment before importing
anything; torch.set_num_threads / MindSpore's runtime_num_threads get the same count, and each worker
reports them and its peak RSS (benchmarks/_common.py). The sides run alternately (ours, HF, HF, ours, ...)
for --rounds rounds per shape and batch; the table gives the median over rounds and [min-max].

    python benchmarks/generate_throughput.py --kernels-vs-plain --shapes small --batches 1,8 --cache-lengths 256,2048

``--kernels-vs-plain``: in ONE worker, the same random model twice (same seed, so the same weights): once as
``generate`` runs it (the prefill through the fused CPU attention kernel, ``KVCache.prefill``) and once plain
(``KVCache.step`` for the prefill, model_config.cpu_kernels {linear: plain}); the calls alternate for --rounds
rounds. Prints the prefill (32-token prompts, cache of 160 rows) and one decode step at each --cache-lengths (at the
last row and at the middle one, to show that masked rows are not read), wall (median [min]) and the process's CPU
time (median), plain / kernels, and the largest logit difference. The kernels side runs its Linears and head as
``generate`` does by default (cpu_kernels {linear: auto}: the GEMM kernel in graphs of at least
``kernels.provider.LINEAR_GEMM_ROWS`` rows: the prefill, not the decode step), the plain side through MatMul;
``--linear-kernel always``: the kernels side's in every graph ({linear: kernel}), ``off``: MatMul too
({linear: plain}).

The ours sides run as ``gptlocal generate`` does: on CPU the native runner (``runtime/native.py``: one C++ call a
step, no graph; ``cpu_kernels`` op ``runner``). ``ours-compiled`` (and ``ours-int8-compiled``, ``ours-bf16-compiled``)
is the same model on the compiled graphs (``cpu_kernels: {runner: plain}``: the prefill / decode / greedy graphs with
the decode-layer node), for an A/B of the runners in one run; the sides that choose a kernel of the compiled graphs
(``ours-matmul``, ``ours-plain-decode``, ``ours-decode-kernel``, ``ours-bf16-decode-kernel``,
``ours-int8-plain-decode``, ``ours-plain-rms-swiglu``) run the compiled runner too, as does ``--kernels-vs-plain``.

``--sides ours,ours-matmul,hf``: ours-matmul is ours-compiled with model_config.cpu_kernels {linear: plain} (every
Linear and the head on MindSpore's MatMul, the path before the GEMM kernel by row count), alternating with the others
in the same run; ours-plain-rms-swiglu (a Llama-style shape) {rms_norm: plain, swiglu: plain}: MindSpore's RMSNorm and
SiLU * up ops instead of the kernels.

Precision sides (``python benchmarks/run.py generate``):

    python benchmarks/generate_throughput.py --sides ours,ours-bf16,ours-int8,ct2-fp32,ct2-int8,ct2-bf16,hf

``ours-bf16``: ours with ``from_pretrained(dir, compute_dtype="bfloat16")``, built for inference as every ours side
(``inference=True``, as ``gptlocal generate`` builds it: the Linears' weights held as bfloat16 once);
``ours-bf16-per-call``: the same built as training builds it (float32 Parameters, the weight rounded to bf16 at every
GEMM: the path before bf16 weights, for an A/B); ``ours-int8``: the model directory
``mindformers_gptlocal.quantize.quantize_model(dir, out, "int8")`` writes (``gptlocal quantize``). ``ct2-*``:
CTranslate2 (the ``bench`` extra: ``ctranslate2==4.8.5``) on the same random HF GPT-2, converted per precision with
its own ``TransformersConverter`` (a word-level tokenizer of the model's vocabulary is saved beside a link to the HF
weights: the converter reads the vocabulary from a tokenizer) and run by ``ctranslate2.Generator`` with
``compute_type`` float32 / int8 / bfloat16 and ``intra_threads`` = --threads, greedy, 128 new tokens, no end token
before them; its TTFT is a generation of one token. A CTranslate2 precision this CPU does not support
(``ctranslate2.get_supported_compute_types("cpu")``) is left out with a note; a side whose setup or worker fails is
given as one line and left out of the table (the other sides still run). The table gives each side's precision and
its speed, TTFT and peak RSS against the CTranslate2 side of the same precision, and a line per shape and batch:
our best precision against CTranslate2's best.

llama.cpp (``python benchmarks/run.py generate --part llamacpp --llamacpp-converter DIR``):

    python benchmarks/generate_throughput.py --shapes llama,small --sides ours,ours-int8,ours-bf16,llamacpp-f32,\
        llamacpp-q8_0,llamacpp-bf16 --llamacpp-converter DIR

``llamacpp-f32`` / ``llamacpp-q8_0`` / ``llamacpp-bf16``: llama.cpp on the GGUF its own converter writes from the same
random HF model (``--outtype`` f32 / q8_0 / bf16), against ours fp32 / int8 / bf16. An optional build, never in
setup.cfg's extras (it compiles for minutes):

    CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python==0.3.36   # builds llama.cpp: 6+ min on 2 cores
    pip download --no-binary :all: --no-deps llama-cpp-python==0.3.36    # the sdist, for its converter
    tar xzf llama_cpp_python-0.3.36.tar.gz       # DIR: llama_cpp_python-0.3.36/vendor/llama.cpp

``--llamacpp-converter DIR``: the folder holding ``convert_hf_to_gguf.py``, ``conversion/`` and ``gguf-py/`` (run
with ``PYTHONPATH=gguf-py:DIR``; it needs torch, transformers and sentencepiece). A random model has no tokenizer
and the converter refuses a word-level one, so a SentencePiece ``tokenizer.model`` is trained on README.md beside
the HF files (seconds; the converter pads its vocabulary to the model's); GPT-2's converter asks for a recognized BPE
tokenizer instead, so there it is given the same SentencePiece vocabulary (``LLAMACPP_CONVERT``): the benchmark hands
llama.cpp token ids, never text. The worker runs llama.cpp through llama-cpp-python's bindings of its C API (the
high-level ``Llama`` runs one sequence): one context of ``batch`` sequences, n_threads = n_threads_batch = --threads
(read back from the context and printed), the prompts decoded in one llama_batch, then a token per sequence a step,
greedy = the argmax of llama.cpp's logits; the KV cache is float32 beside F32 weights (float32 end to end, as ours
fp32), llama.cpp's default f16 beside Q8_0 and BF16. Without llama_cpp, sentencepiece or the converter's folder, the
run stops with one line naming what to install (exit 2). The table compares each side with the llama.cpp side of
the same precision (decode / TTFT / peak RSS), and every run ends with each side's greedy tokens against ours fp32
(how many of the 128 new tokens equal ours before the first difference, per sequence).
"""
import argparse
import os
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
import _common as C  # noqa: E402  (benchmarks/ is not a package)

SHAPES = C.HF_GPT2_SHAPES
LLAMA_SHAPES = C.HF_LLAMA_SHAPES
PROMPT, NEW = 32, 128
FORWARD_SEQ, FORWARD_REPEATS = 256, 3  # --forward: [batch, FORWARD_SEQ], the median of this many timed calls
TTFT_CALLS = 5  # TTFT: the median of this many calls on each side (one call swung 2x on a loaded machine)
CT2_SIDES = {"ct2-fp32": "float32", "ct2-int8": "int8", "ct2-bf16": "bfloat16"}  # side -> compute_type
LLAMACPP_SIDES = {"llamacpp-f32": "f32", "llamacpp-q8_0": "q8_0", "llamacpp-bf16": "bf16"}  # side -> GGUF --outtype
# the llama.cpp KV cache's type by side: float32 beside F32 weights (float32 end to end, as ours fp32), else
# llama.cpp's default (f16)
LLAMACPP_KV = {"llamacpp-f32": "f32", "llamacpp-q8_0": "f16", "llamacpp-bf16": "f16"}
LLAMACPP_VERSION = "0.3.36"  # the llama-cpp-python release the sides were written against (its C API bindings)
LLAMACPP_INSTALL = (f'CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python=={LLAMACPP_VERSION} (it builds '
                    "llama.cpp from the sdist: 6+ minutes on 2 cores)")
LLAMACPP_CONVERTER = (f"pip download --no-binary :all: --no-deps llama-cpp-python=={LLAMACPP_VERSION}, unpack it and "
                      "give its vendor/llama.cpp folder (convert_hf_to_gguf.py, conversion/, gguf-py/)")
SIDES = ("ours", "ours-compiled", "ours-mf", "ours-matmul", "ours-plain-decode", "ours-decode-kernel", "ours-cached",
         "ours-bf16", "ours-bf16-compiled", "ours-bf16-per-call", "ours-bf16-decode-kernel", "ours-plain-rms-swiglu",
         "ours-int8", "ours-int8-compiled", "ours-int8-plain-decode", "hf", *CT2_SIDES, *LLAMACPP_SIDES)
ENGINES = (*CT2_SIDES, *LLAMACPP_SIDES)  # the peers that are not PyTorch (no --forward job, their own threads)
# model_config.cpu_kernels given to from_pretrained (ours-matmul: every Linear and the head on MatMul;
# ours-plain-decode: the decode step's plain graph, not the decode-layer kernel; ours-decode-kernel: the decode-layer
# kernel, which auto gives float32 and int8 models; ours-bf16-decode-kernel: a bf16 model's, kernel only); the other
# sides keep the converted
# folder's (auto), as gptlocal generate runs it
COMPILED = {"runner": "plain"}  # the compiled runner's graphs (on CPU the default runner is the native one)
SIDE_KERNELS = {"ours-compiled": COMPILED, "ours-bf16-compiled": COMPILED, "ours-int8-compiled": COMPILED,
                "ours-matmul": {"linear": "plain", **COMPILED},
                "ours-plain-decode": {"decode_layer": "plain", **COMPILED},
                "ours-decode-kernel": {"decode_layer": "kernel", **COMPILED},
                "ours-bf16-decode-kernel": {"decode_layer": "kernel", **COMPILED},
                "ours-int8-plain-decode": {"decode_layer": "plain", **COMPILED},
                "ours-plain-rms-swiglu": {"rms_norm": "plain", "swiglu": "plain", **COMPILED}}
# more from_pretrained overrides by side (ours-bf16: the GEMMs in bfloat16, model_config.compute_dtype)
SIDE_OVERRIDES = {side: {"compute_dtype": "bfloat16"}
                  for side in ("ours-bf16", "ours-bf16-compiled", "ours-bf16-per-call", "ours-bf16-decode-kernel")}
# the ours sides not built for inference (from_pretrained's inference=False: float32 Parameters); the others as
# gptlocal generate builds them (model/loader.py load_model: inference=True)
TRAINING_BUILD = ("ours-bf16-per-call",)
# each side's precision: the ratio columns compare a side with the CTranslate2 side of the same precision
PRECISION = {"ours-bf16": "bf16", "ours-bf16-compiled": "bf16", "ours-bf16-per-call": "bf16",
             "ours-bf16-decode-kernel": "bf16", "ours-int8": "int8", "ours-int8-compiled": "int8",
             "ours-int8-plain-decode": "int8", "ct2-int8": "int8", "ct2-bf16": "bf16", "llamacpp-q8_0": "int8",
             "llamacpp-bf16": "bf16"}  # else fp32
CT2_VERSION = "4.8.5"  # the bench extra's pin (setup.cfg)
# --linear-kernel -> the kernels side's cpu_kernels of kernels_vs_plain (the plain side: {linear: plain})
LINEAR_KERNEL = {"rows": "auto", "always": "kernel", "off": "plain"}


def vocab(shape):
    return {**SHAPES, **LLAMA_SHAPES}[shape]["vocab_size"]


def no_eos(shape):
    """Our generate's keywords for ``shape``: a Llama-style model's end token (0) is one a random model can pick, so
    none stops it (the peers' ``min_new_tokens`` / ``min_length`` do the same)."""
    return {"eos_token_id": -1} if shape in LLAMA_SHAPES else {}


def new_tokens(sequences):
    """The generated tokens of each sequence (prompt dropped) as lists of ints: what the greedy agreement compares."""
    return [[int(t) for t in sequence[PROMPT:]] for sequence in sequences]


def timed_ours(model, prompts, use_past, **options):
    """(ttft, total) seconds of one greedy generation (after a warm-up call of the same shape), and its new tokens."""
    model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past, **options)
    start = time.perf_counter()
    out = model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past, **options)
    total = time.perf_counter() - start
    if use_past:  # TTFT: the prefill call of the cache that generation used (compiled by the warm-up)
        cache = model.kv_cache(len(prompts), PROMPT + NEW)
        return C.median([C.timed(lambda: cache.prefill(prompts)) for _ in range(TTFT_CALLS)]), total, new_tokens(out)
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, do_sample=False, use_past=use_past, **options)
    return time.perf_counter() - start, total, new_tokens(out)


def timed_hf(model, prompts):
    import torch
    ids = torch.tensor(prompts)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ttft = C.median([C.timed(lambda: model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False,
                                                         pad_token_id=0)) for _ in range(TTFT_CALLS)])
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, use_cache=True)
        total = time.perf_counter() - start
    assert out.shape[1] == PROMPT + NEW
    return ttft, total, new_tokens(out.tolist())


def timed_ct2(generator, prompts):
    """(ttft, total) seconds of CTranslate2's greedy generation of NEW tokens (TTFT: the median of TTFT_CALLS
    generations of one token), and the tokens; ``prompts`` are token strings (its Generator takes no ids)."""
    options = dict(include_prompt_in_result=False, sampling_topk=1, beam_size=1)
    ttft = C.median([C.timed(lambda: generator.generate_batch(prompts, max_length=1, **options))
                     for _ in range(TTFT_CALLS)])
    start = time.perf_counter()
    out = generator.generate_batch(prompts, max_length=NEW, min_length=NEW, **options)
    total = time.perf_counter() - start
    assert all(len(r.sequences_ids[0]) == NEW for r in out), [len(r.sequences_ids[0]) for r in out]
    return ttft, total, [list(r.sequences_ids[0]) for r in out]


def timed_llamacpp(runner, prompts):
    """(ttft, total) seconds of llama.cpp's greedy generation of NEW tokens (TTFT: the median of TTFT_CALLS
    generations of one token: the prompt's decode and its argmax), and the tokens."""
    ttft = C.median([C.timed(lambda: runner.generate(prompts, 1)) for _ in range(TTFT_CALLS)])
    start = time.perf_counter()
    tokens = runner.generate(prompts, NEW)
    total = time.perf_counter() - start
    return ttft, total, tokens


def decode_rate(batch, ttft, total):
    return batch * (NEW - 1) / max(total - ttft, 1e-9)


def setup(work, shape, sides=(), converter=None):
    """A random HF model of ``shape`` (GPT-2, or LlamaForCausalLM with an untied head for a Llama-style shape) saved
    under work/shape, converted to ours under work/shape_ms (``gptlocal convert hf2ms``'s ``hf_to_ms``); for the
    precision sides among ``sides`` also ours quantized to int8 (work/shape_int8), CTranslate2's conversions
    (work/shape_ct2-*) and llama.cpp's GGUF files (work/shape_llamacpp-*.gguf, by llama.cpp's converter in the folder
    ``converter``). Writes work/shape_setup.json: {"skipped": {side: one-line reason}, "ct2": version and the
    compute types it supports on this CPU, "llamacpp": llama-cpp-python's version and llama.cpp's build}."""
    import json
    import torch
    from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms
    torch.manual_seed(0)
    C.save_random_hf(shape, os.path.join(work, shape))
    hf_to_ms(os.path.join(work, shape), os.path.join(work, shape + "_ms"))
    notes = {"skipped": {}}
    if any(side.startswith("ours-int8") for side in sides):
        try:
            from mindformers_gptlocal.quantize import quantize_model
            quantize_model(os.path.join(work, shape + "_ms"), os.path.join(work, shape + "_int8"), "int8")
        except Exception as err:  # pylint: disable=broad-except  (one line for the table, the other sides run)
            for side in ("ours-int8", "ours-int8-compiled", "ours-int8-plain-decode"):
                notes["skipped"][side] = f"quantize_model(dir, out, 'int8') failed: {C.error_line(err)}"
    ct2 = [side for side in sides if side in CT2_SIDES]
    if ct2:
        notes["ct2"] = ct2_convert(work, shape, ct2, notes["skipped"])
    gguf = [side for side in sides if side in LLAMACPP_SIDES]
    if gguf:
        notes["llamacpp"] = llamacpp_convert(work, shape, gguf, converter, notes["skipped"])
    with open(os.path.join(work, shape + "_setup.json"), "w", encoding="utf-8") as handle:
        json.dump(notes, handle)


def ct2_convert(work, shape, sides, skipped):
    """CTranslate2's own converter (``TransformersConverter``) on the HF model of work/shape, once per precision
    of ``sides`` into work/shape_ct2-*; a precision CTranslate2 does not run on this CPU goes to ``skipped``. The
    converter reads the vocabulary from a tokenizer: a word-level one of the model's size (token i is ``t<i>``, 0
    is ``<|endoftext|>``) is saved in work/shape_ct2src beside links to the HF files."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter
    source = os.path.join(work, shape + "_ct2src")
    os.makedirs(source, exist_ok=True)
    for name in os.listdir(os.path.join(work, shape)):
        if not os.path.exists(os.path.join(source, name)):
            os.symlink(os.path.join(work, shape, name), os.path.join(source, name))
    ct2_tokenizer(vocab(shape)).save_pretrained(source)
    supported = sorted(ctranslate2.get_supported_compute_types("cpu"))
    for side in sides:
        compute = CT2_SIDES[side]
        if compute not in supported:
            skipped[side] = (f"CTranslate2 {ctranslate2.__version__} runs no compute_type {compute} on this CPU "
                             f"(it supports {', '.join(supported)})")
            continue
        try:
            TransformersConverter(source).convert(os.path.join(work, f"{shape}_{side}"), quantization=compute,
                                                  force=True)
        except Exception as err:  # pylint: disable=broad-except  (one line for the table, the other sides run)
            skipped[side] = f"CTranslate2's converter failed: {C.error_line(err)}"
    return {"version": ctranslate2.__version__, "compute_types": supported}


def ct2_tokenizer(vocab_size):
    """A word-level tokenizer of ``vocab_size`` tokens (``t<i>``, 0 = ``<|endoftext|>``): the vocabulary
    CTranslate2's converter reads for a model saved without one."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    vocab = {ct2_token(i): i for i in range(vocab_size)}
    end = ct2_token(0)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token=end)),
                                   bos_token=end, eos_token=end, unk_token=end)


def ct2_token(index):
    return "<|endoftext|>" if index == 0 else f"t{index}"


# llama.cpp's converter run as its own script, with one change: its GPT-2 class reads a BPE tokenizer.json whose
# pre-tokenizer it must recognize by a hash of known models' (a random model's is none of them), so there it takes the
# SentencePiece vocabulary its Llama class reads (a GGUF's tokenizer does not depend on its architecture, and the
# benchmark gives llama.cpp token ids, never text)
LLAMACPP_CONVERT = ("from conversion.gpt2 import GPT2Model\n"
                    "GPT2Model.set_vocab = lambda self: self._set_vocab_sentencepiece()\n"
                    "import convert_hf_to_gguf\n"
                    "convert_hf_to_gguf.main()\n")


def llamacpp_source(work, shape):
    """The folder llama.cpp's converter reads for the HF model of work/shape, work/shape_gguf-src: links to its files,
    its config (GPT-2's with the ``n_ctx`` that converter reads: n_positions), and a SentencePiece ``tokenizer.model``
    trained on README.md (a random model has no tokenizer, and a word-level tokenizer.json is refused; the converter
    pads SentencePiece's vocabulary to the model's with unused tokens). Returns its path."""
    import io
    import json
    import sentencepiece
    source = os.path.join(work, shape + "_gguf-src")
    os.makedirs(source, exist_ok=True)
    for name in os.listdir(os.path.join(work, shape)):
        if name != "config.json" and not os.path.exists(os.path.join(source, name)):
            os.symlink(os.path.join(work, shape, name), os.path.join(source, name))
    with open(os.path.join(work, shape, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    if "n_positions" in config:
        config.setdefault("n_ctx", config["n_positions"])
    with open(os.path.join(source, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(config, handle, indent=2)
    with open(os.path.join(C.REPO, "README.md"), encoding="utf-8") as handle:
        lines = [line for line in handle.read().splitlines() if line.strip()]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_writer=model,
                                             vocab_size=vocab(shape), hard_vocab_limit=False, minloglevel=2)
    with open(os.path.join(source, "tokenizer.model"), "wb") as handle:
        handle.write(model.getvalue())
    return source


def llamacpp_convert(work, shape, sides, converter, skipped):
    """llama.cpp's own converter (``convert_hf_to_gguf.py`` of the folder ``converter``, :data:`LLAMACPP_CONVERT`) on
    the HF model of work/shape (:func:`llamacpp_source`), once per side into work/shape_<side>.gguf with the side's
    ``--outtype``; a conversion that fails goes to ``skipped`` as its error line. Returns llama-cpp-python's version
    and llama.cpp's build line (the instruction sets it was compiled for)."""
    import subprocess
    import llama_cpp
    source = llamacpp_source(work, shape)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((os.path.join(converter, "gguf-py"), converter)))
    for side in sides:
        out = subprocess.run([sys.executable, "-c", LLAMACPP_CONVERT, source, "--outtype", LLAMACPP_SIDES[side],
                              "--outfile", os.path.join(work, f"{shape}_{side}.gguf")],
                             capture_output=True, text=True, env=env, cwd=work, check=False)
        if out.returncode:
            error = C.last_error_line(out.stderr or out.stdout, out.returncode)
            skipped[side] = f"llama.cpp's converter failed: {error}"
    return {"version": llama_cpp.__version__, "build": llama_cpp.llama_print_system_info().decode().strip(" |")}


_LLAMACPP_LOG = []  # the log callback handed to llama.cpp, kept alive here (llama.cpp calls it later)


def llamacpp_context_params(llama_cpp, batch, threads, kv):
    """llama.cpp's context for ``batch`` sequences of PROMPT + NEW tokens (n_seq_max = batch; llama.cpp rounds each
    sequence's share of n_ctx up to 256), the prompts decoded in one batch, n_threads = n_threads_batch =
    ``threads``, the KV cache of type ``kv`` (f32 or f16); the rest llama.cpp's defaults (flash attention: auto)."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = batch * (PROMPT + NEW)
    params.n_batch = params.n_ubatch = batch * PROMPT
    params.n_seq_max = batch
    params.n_threads = params.n_threads_batch = threads
    params.type_k = params.type_v = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[kv]
    return params


class LlamaCpp:
    """A GGUF model in llama.cpp through llama-cpp-python's bindings of its C API (the high-level ``Llama`` runs one
    sequence): one context of ``batch`` sequences (:func:`llamacpp_context_params`), the prompts decoded in one
    llama_batch, then one llama_batch of a token per sequence a step; greedy = the argmax of the logits llama.cpp
    returns for each sequence's last token. llama.cpp's log is cut to its errors."""

    def __init__(self, path, batch, threads, kv):
        import ctypes
        import llama_cpp
        self.api, self.batch = llama_cpp, batch

        @llama_cpp.llama_log_callback
        def errors_only(level, text, _):
            if level == 3:  # GGML_LOG_LEVEL_ERROR
                sys.stderr.write(text.decode("utf-8", "replace"))
        _LLAMACPP_LOG.append(errors_only)
        llama_cpp.llama_log_set(errors_only, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {path}")
        self.vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.ctx = llama_cpp.llama_init_from_model(self.model, llamacpp_context_params(llama_cpp, batch, threads, kv))
        if not self.ctx:
            raise SystemExit(f"llama.cpp could not make a context of {batch} sequences for {path}")
        self.threads = (llama_cpp.llama_n_threads(self.ctx), llama_cpp.llama_n_threads_batch(self.ctx))
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        rows = np.arange(batch * PROMPT)  # the prompts: sequence s at rows s * PROMPT ..., its last row's logits
        self.prompt = self.llama_batch(rows // PROMPT, rows % PROMPT, rows % PROMPT == PROMPT - 1)
        self.step = self.llama_batch(np.arange(batch), np.full(batch, PROMPT), np.ones(batch, bool))

    def llama_batch(self, seqs, positions, outputs):
        """(llama_batch, its tokens, its positions as numpy views): one sequence id a row, the rows ``outputs`` marks
        give logits."""
        batch = self.api.llama_batch_init(len(seqs), 0, 1)
        batch.n_tokens = len(seqs)
        for row, (seq, out) in enumerate(zip(seqs, outputs)):
            batch.n_seq_id[row], batch.seq_id[row][0], batch.logits[row] = 1, int(seq), int(out)
        tokens = np.ctypeslib.as_array(batch.token, shape=(len(seqs),))
        where = np.ctypeslib.as_array(batch.pos, shape=(len(seqs),))
        where[:] = positions
        return batch, tokens, where

    def decode(self, batch):
        """Decode one llama_batch; the argmax of each sequence's logits."""
        code = self.api.llama_decode(self.ctx, batch)
        if code:
            raise SystemExit(f"llama_decode returned {code}")
        logits = np.ctypeslib.as_array(self.api.llama_get_logits(self.ctx), shape=(self.batch, self.vocab))
        return logits.argmax(axis=1)

    def generate(self, prompts, new):
        """``new`` greedy tokens after each of ``prompts`` (batch x PROMPT ids), from an emptied KV cache."""
        self.api.llama_memory_clear(self.api.llama_get_memory(self.ctx), False)
        batch, tokens, _ = self.prompt
        tokens[:] = np.asarray(prompts, np.int32).reshape(-1)
        out = np.empty((self.batch, new), np.int32)
        out[:, 0] = self.decode(batch)
        batch, tokens, where = self.step
        for index in range(1, new):
            tokens[:], where[:] = out[:, index - 1], PROMPT + index - 1
            out[:, index] = self.decode(batch)
        return out.tolist()


def worker(side, work, shape, batch, threads, recompute, job="generate"):
    """One side's numbers for one shape and batch; prints a WORKER line. ``phases``: each phase's own peak RSS
    (MB; VmHWM reset at the phase's start): import, build + load, the first generation (our compiles), the timed
    generations, and (``recompute``) our no-cache path; ``peak_rss_mb`` is generate's peak, without the no-cache
    path's full-width compiles (before, they counted in the tiny rows' peak). ``tokens``: the new greedy tokens of
    each sequence (the agreement line compares them with ours'). ``job`` "forward": ``forward_worker``; ``work`` "-":
    the threads checked, nothing measured."""
    env = C.check_threads(threads, f"{side} generate worker")
    if work == "-":
        if side in LLAMACPP_SIDES:  # no model to make a context of: the threads of the context it would ask for
            import llama_cpp
            params = llamacpp_context_params(llama_cpp, 1, threads, LLAMACPP_KV[side])
            return C.emit({"env": env, "runtime_threads": params.n_threads, "threads_batch": params.n_threads_batch,
                           "llamacpp_version": llama_cpp.__version__})
        runtime = C.torch_threads(threads, "hf worker") if side == "hf" else C.mindspore_threads(threads, "worker")
        return C.emit({"env": env, "runtime_threads": runtime})
    if job == "forward":
        return forward_worker(side, work, shape, batch, threads, env)
    # PyTorch only where it runs: importing it into our side would add its ~180 MB to our peak RSS
    report = {"env": env, "torch_threads": C.torch_threads(threads, f"{side} generate worker") if side == "hf"
              else "not loaded", "precision": PRECISION.get(side, "fp32")}
    prompts = np.random.default_rng(batch).integers(0, vocab(shape), (batch, PROMPT)).tolist()
    phases = C.Phases()  # each phase's own peak RSS (VmHWM reset at its start) and the RSS after it
    if side == "hf":
        with phases("import"):
            from transformers import AutoModelForCausalLM
        with phases("load"):
            model = AutoModelForCausalLM.from_pretrained(os.path.join(work, shape)).eval()
        with phases("first_call"):
            timed_hf(model, prompts)  # warm-up
        with phases("timed"):
            ttft, total, tokens = timed_hf(model, prompts)
    elif side in CT2_SIDES:  # CTranslate2's Generator on its conversion of the same HF weights (setup)
        with phases("import"):
            import ctranslate2
        report["ct2_version"] = ctranslate2.__version__
        with phases("load"):
            model = ctranslate2.Generator(os.path.join(work, f"{shape}_{side}"), device="cpu",
                                          compute_type=CT2_SIDES[side], intra_threads=threads, inter_threads=1)
        report["runtime_threads"] = threads  # intra_threads (CTranslate2 has no getter); OMP_NUM_THREADS checked
        words = [[ct2_token(t) for t in prompt] for prompt in prompts]
        with phases("first_call"):
            timed_ct2(model, words)  # warm-up
        with phases("timed"):
            ttft, total, tokens = timed_ct2(model, words)
    elif side in LLAMACPP_SIDES:  # llama.cpp on its converter's GGUF of the same HF weights (setup)
        with phases("import"):
            import llama_cpp
        report.update(llamacpp_version=llama_cpp.__version__, kv_cache=LLAMACPP_KV[side])
        with phases("load"):
            model = LlamaCpp(os.path.join(work, f"{shape}_{side}.gguf"), batch, threads, LLAMACPP_KV[side])
        if model.threads != (threads, threads):
            raise SystemExit(f"{side} generate worker: llama.cpp n_threads, n_threads_batch {model.threads}, "
                             f"asked {threads}")
        report.update(runtime_threads=model.threads[0], threads_batch=model.threads[1], n_ctx=model.n_ctx)
        with phases("first_call"):
            timed_llamacpp(model, prompts)  # warm-up
        with phases("timed"):
            ttft, total, tokens = timed_llamacpp(model, prompts)
    else:  # ours: the model's own classes (gptlocal generate's: no MindFormers); ours-mf: MindFormers' classes
        report["runtime_threads"] = C.mindspore_threads(threads, "ours generate worker")
        model = ours_model(side, work, shape, batch, phases, report)
        with phases("first_call"):
            start = time.perf_counter()
            model.generate(prompts, max_new_tokens=NEW, do_sample=False, **no_eos(shape))  # compiles prefill + decode
            report["first_call_s"] = time.perf_counter() - start
        with phases("timed"):
            ttft, total, tokens = timed_ours(model, prompts, True, **no_eos(shape))
        report["host"] = host_share(model, prompts, shape)
        if recompute:  # our no-cache path compiles full-width forwards: its own phase, not generate's peak
            with phases("recompute"):
                n_ttft, n_total, _ = timed_ours(model, prompts, False, **no_eos(shape))
            report["nocache_rate"] = decode_rate(batch, n_ttft, n_total)
            report["recompute_peak_rss_mb"] = phases.peaks["recompute"]
    if side != "hf" and "torch" in sys.modules:
        raise SystemExit(f"{side} generate worker: PyTorch was imported (it would count in its peak RSS)")
    report.update(ttft=ttft, rate=decode_rate(batch, ttft, total), tokens=tokens, phases=phases.peaks,
                  rss_after=phases.after,
                  peak_rss_mb=phases.peak(("import", "load", "first_call", "timed")), peak_resets=phases.resets)
    C.emit(report)


SAMPLED = dict(do_sample=True, top_k=50, top_p=0.9, temperature=0.8)  # host_share's sampled generation


def host_share(model, prompts, shape):
    """Where the native runner runs: {"greedy" / "sampled": (ms a step, share)}, the time a greedy and a sampled
    (SAMPLED) generation spend outside the library's calls (the generate loop, host-side sampling and bookkeeping)
    per step and as a share of the whole; None for the compiled runner."""
    from mindformers_gptlocal.runtime import native
    if not isinstance(model.kv_cache(len(prompts), PROMPT + NEW), native.NativeRunner):
        return None
    spent, call = [0.0], native.NativeRunner._call

    def timed_call(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return call(self, *args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - start
    native.NativeRunner._call = timed_call
    try:
        shares = {}
        for name, options in (("greedy", dict(do_sample=False)), ("sampled", SAMPLED)):
            model.generate(prompts, max_new_tokens=8, **options, **no_eos(shape))
            spent[0] = 0.0
            start = time.perf_counter()
            model.generate(prompts, max_new_tokens=NEW, **options, **no_eos(shape))
            total = time.perf_counter() - start
            shares[name] = (1e3 * (total - spent[0]) / NEW, (total - spent[0]) / total)
        return shares
    finally:
        native.NativeRunner._call = call


def ours_model(side, work, shape, batch, phases, report, **build):
    """Our side's model as ``gptlocal generate`` loads it (``side``'s cpu_kernels and overrides; ours-mf: the model on
    MindFormers' bases), its import and load as ``phases``; ours-cached attaches the compile cache of this run."""
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE)
    with phases("import"):
        if side == "ours-mf":
            from mindformers_gptlocal import GPTLocalForCausalLM
        else:
            from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    report["mindformers_loaded"] = "mindformers" in sys.modules
    with phases("load"):
        model_dir = os.path.join(work, shape + ("_int8" if side.startswith("ours-int8") else "_ms"))
        kernels = {"cpu_kernels": SIDE_KERNELS[side]} if side in SIDE_KERNELS else {}
        model = GPTLocalForCausalLM.from_pretrained(model_dir, max_batch_size=max(8, batch), **kernels,
                                                    inference=side not in TRAINING_BUILD,
                                                    **SIDE_OVERRIDES.get(side, {}), **build)
    if side == "ours-cached":  # as gptlocal generate's --compile-cache: round 1 stores, later rounds load
        from mindformers_gptlocal.runtime.graph_cache import attach
        attach(model, os.path.join(work, "compile-cache"), model_dir)
    return model


def forward_worker(side, work, shape, batch, threads, env):
    """``--forward``: one forward over [batch, FORWARD_SEQ] random tokens, tokens/s of the median of FORWARD_REPEATS
    calls after a warm-up (our compile), the first call's seconds, and this job's peak RSS per phase."""
    report = {"env": env, "precision": PRECISION.get(side, "fp32"), "job": "forward"}
    ids = np.random.default_rng(batch).integers(0, vocab(shape), (batch, FORWARD_SEQ))
    phases = C.Phases()
    if side == "hf":
        report["runtime_threads"] = C.torch_threads(threads, "hf forward worker")
        import torch
        with phases("import"):
            from transformers import AutoModelForCausalLM
        with phases("load"):
            model = AutoModelForCausalLM.from_pretrained(os.path.join(work, shape)).eval()
        tensor = torch.from_numpy(ids)

        def call():
            with torch.no_grad():
                model(tensor)
    else:
        from mindspore import Tensor
        report["runtime_threads"] = C.mindspore_threads(threads, "ours forward worker")
        model = ours_model(side, work, shape, batch, phases, report, seq_length=FORWARD_SEQ)
        model.set_train(False)
        tensor = Tensor(ids.astype(np.int32))

        def call():
            model(tensor).asnumpy()
    with phases("first_call"):
        report["first_call_s"] = C.timed(call)
    with phases("timed"):
        seconds = C.median([C.timed(call) for _ in range(FORWARD_REPEATS)])
    report.update(rate=batch * FORWARD_SEQ / seconds, phases=phases.peaks, peak_rss_mb=phases.peak(),
                  peak_resets=phases.resets)
    C.emit(report)


def kernels_vs_plain(shape, batch, lengths, rounds, threads, linear_kernel="rows"):
    """Prints kernels vs plain for the prefill and the decode step, in this process (``--kernels-vs-plain``)."""
    import mindspore as ms
    from mindformers_gptlocal.runtime.buckets import bucket_of
    from mindformers_gptlocal.model.config import GPTLocalConfig
    from mindformers_gptlocal.model.gpt import GPTLocalForCausalLM
    from mindformers_gptlocal.runtime.runner import prefill_inputs
    C.mindspore_threads(threads, "kernels-vs-plain worker")
    ms.set_context(mode=ms.GRAPH_MODE)
    sizes = SHAPES[shape]
    config = dict(vocab_size=sizes["vocab_size"], hidden_size=sizes["n_embd"], num_hidden_layers=sizes["n_layer"],
                  num_attention_heads=sizes["n_head"], max_position_embeddings=max(1024, *lengths),
                  seq_length=max(1024, *lengths), hidden_dropout=0.0, attention_dropout=0.0, max_batch_size=8)

    def built(plain):  # the plain prefill is KVCache.step (below); the plain side's Linears and head on MatMul
        linear = "plain" if plain else LINEAR_KERNEL[linear_kernel]
        ms.set_seed(0)
        model = GPTLocalForCausalLM(GPTLocalConfig(**config, cpu_kernels={"linear": linear, **COMPILED}))
        model.set_train(False)
        return model

    models = {"kernels": built(False), "plain": built(True)}

    def compare(what, calls):
        outputs = {side: call() for side, call in calls.items()}  # compiles
        times = {side: [] for side in calls}
        for index in range(rounds):
            for side in (("kernels", "plain") if index % 2 == 0 else ("plain", "kernels")):
                wall, cpu = time.perf_counter(), time.process_time()
                calls[side]()
                times[side].append((time.perf_counter() - wall, time.process_time() - cpu))
        k, p = np.array(times["kernels"]) * 1e3, np.array(times["plain"]) * 1e3
        print(f"| {shape} | {batch} | {what} | {np.median(k[:, 0]):.1f} [{k[:, 0].min():.1f}] | "
              f"{np.median(p[:, 0]):.1f} [{p[:, 0].min():.1f}] | {np.median(k[:, 1]):.1f} | {np.median(p[:, 1]):.1f} | "
              f"{p[:, 0].min() / k[:, 0].min():.2f}x, {np.median(p[:, 1]) / np.median(k[:, 1]):.2f}x | "
              f"{np.abs(outputs['kernels'] - outputs['plain']).max():.1e} | {os.getloadavg()[0]:.1f} |", flush=True)

    prompts = np.random.default_rng(batch).integers(0, sizes["vocab_size"], (batch, PROMPT)).tolist()
    caches = {side: model.kv_cache(batch, PROMPT + NEW) for side, model in models.items()}
    width = bucket_of(PROMPT, caches["plain"].widths)
    ids, positions, lengths_ = prefill_inputs(prompts, batch, 0, width)
    compare(f"prefill {PROMPT} tokens, cache {caches['plain'].max_length}",
            {"kernels": lambda: caches["kernels"].prefill(prompts),
             "plain": lambda: caches["plain"].step(ids, positions, lengths_ - 1)})
    tokens = np.ones(batch, np.int32)
    for length in lengths:
        caches = {side: model.kv_cache(batch, length) for side, model in models.items()}
        for at in (length - 1, length // 2):
            where = np.full(batch, at, np.int32)
            compare(f"decode step, cache {length}, position {at}",
                    {side: (lambda c=cache: c.decode(tokens, where)) for side, cache in caches.items()})


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="tiny,small")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--recompute-shapes", default="tiny",
                        help="shapes that also time our no-cache path (slow: a full forward per token)")
    parser.add_argument("--sides", default="ours,hf",
                        help="ours (the model's own classes, as gptlocal generate: no MindFormers; on CPU the "
                             "native runner), ours-compiled / ours-int8-compiled / ours-bf16-compiled (the same on the "
                             "compiled graphs: cpu_kernels {runner: plain}), ours-mf (the "
                             "model on MindFormers' bases, mindformers_gptlocal.GPTLocalForCausalLM), ours-matmul "
                             "(ours-compiled with model_config.cpu_kernels {linear: plain}: MatMul in every Linear), "
                             "ours-plain-decode (cpu_kernels {decode_layer: plain}), ours-decode-kernel (cpu_kernels "
                             "{decode_layer: kernel}; auto runs it too), ours-cached (ours through a compile-cache "
                             "folder of this run, as gptlocal generate's default --compile-cache: round 1 compiles and "
                             "stores, later rounds load), ours-bf16 (compute_dtype bfloat16), ours-bf16-per-call (the "
                             "same, float32 weights rounded at every GEMM), ours-bf16-decode-kernel (ours-bf16 with "
                             "cpu_kernels {decode_layer: kernel}), ours-int8 (a quantize_model int8 directory), "
                             "ours-int8-plain-decode, ours-plain-rms-swiglu (a Llama-style shape: cpu_kernels "
                             "{rms_norm: plain, swiglu: plain}), hf, ct2-fp32, ct2-int8, ct2-bf16 (CTranslate2, the "
                             "bench extra), llamacpp-f32, llamacpp-q8_0, llamacpp-bf16 (llama.cpp through "
                             "llama-cpp-python, an optional build; needs --llamacpp-converter)")
    parser.add_argument("--llamacpp-converter", metavar="DIR",
                        help="the llama.cpp sides: the vendor/llama.cpp folder of llama-cpp-python's sdist "
                             "(convert_hf_to_gguf.py, conversion/, gguf-py/), whose converter writes the GGUF files")
    parser.add_argument("--forward", action="store_true",
                        help=f"also one forward over [batch, {FORWARD_SEQ}] per side (ours and hf), a worker each")
    parser.add_argument("--kernels-vs-plain", action="store_true",
                        help="in one worker: prefill and decode step through the CPU kernels vs plain")
    parser.add_argument("--cache-lengths", default="256,1024,2048", help="decode cache lengths (--kernels-vs-plain)")
    parser.add_argument("--linear-kernel", choices=("rows", "always", "off"), default="rows",
                        help="--kernels-vs-plain: the kernels side's Linears and head on the GEMM kernel in graphs of "
                             "many rows (rows: cpu_kernels {linear: auto}, the default), in every graph (always: "
                             "{linear: kernel}) or never (off: {linear: plain}); the plain side's always on MatMul")
    parser.add_argument("--kvp-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--recompute", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--job", choices=("generate", "forward"), default="generate", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.work, args.shape, args.batch, args.threads, args.recompute, args.job)
    shapes = args.shapes.split(",")
    known = list(SHAPES) if args.kernels_vs_plain or args.kvp_worker else [*SHAPES, *LLAMA_SHAPES]
    if any(shape not in known for shape in shapes):
        print(f"--shapes {args.shapes}: choose from {', '.join(known)}", file=sys.stderr)
        raise SystemExit(2)
    lengths = [int(x) for x in args.cache_lengths.split(",")]
    if args.kvp_worker:
        C.check_threads(args.threads, "kernels-vs-plain worker")
        return kernels_vs_plain(args.shape, args.batch, lengths, args.rounds, args.threads, args.linear_kernel)
    if args.kernels_vs_plain:
        print(C.machine_line(args.threads), flush=True)
        print("| shape | batch | call | kernels wall ms | plain wall ms | kernels CPU ms | plain CPU ms | "
              "plain / kernels (wall min, CPU) | max abs logit diff | 1-min load |")
        print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |", flush=True)
        import subprocess
        for shape in shapes:
            for batch in (int(b) for b in args.batches.split(",")):
                subprocess.run([sys.executable, __file__, "--kvp-worker", "--shapes", shape, "--shape", shape,
                                "--batch", str(batch), "--rounds", str(args.rounds), "--threads", str(args.threads),
                                "--cache-lengths", args.cache_lengths,
                                "--linear-kernel", args.linear_kernel],
                               env=C.worker_env(args.threads), cwd=tempfile.gettempdir(), check=True)
        return None
    sides = tuple(args.sides.split(","))
    check_sides(sides, args.llamacpp_converter)
    converter = args.llamacpp_converter and os.path.abspath(args.llamacpp_converter)
    work = C.scratch_dir("gptlocal-gen-")
    print(C.machine_line(args.threads), flush=True)
    if any(PRECISION.get(side) for side in sides):
        print(C.precision_line(), flush=True)
    rows, forward_rows, skipped, ct2, gguf = [], [], {}, None, None
    for shape in shapes:
        import json
        import subprocess
        made = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); "
                               f"from generate_throughput import setup; "
                               f"setup({work!r}, {shape!r}, {sides!r}, {converter!r})"],
                              env=C.worker_env(args.threads), cwd=tempfile.gettempdir(), check=False,
                              capture_output=True, text=True)
        if made.returncode:
            raise SystemExit(f"setup of {shape} failed (exit {made.returncode}):\n"
                             f"{(made.stdout + made.stderr)[-4000:]}")
        with open(os.path.join(work, shape + "_setup.json"), encoding="utf-8") as handle:
            notes = json.load(handle)
        ct2, gguf = notes.get("ct2", ct2), notes.get("llamacpp", gguf)
        for side, reason in notes["skipped"].items():
            print(f"{shape}: {side} left out: {reason}", flush=True)
            skipped.setdefault(side, reason)
        for batch in (int(b) for b in args.batches.split(",")):
            def one(side, index, shape=shape, batch=batch, skip=notes["skipped"]):
                if side in skip:
                    return None
                extra = ["--recompute"] if side.startswith("ours") and shape in args.recompute_shapes.split(",") else []
                report, _ = C.run_worker(__file__, ["--worker", side, "--work", work, "--shape", shape, "--batch",
                                                    str(batch), "--threads", str(args.threads), *extra], args.threads,
                                         one_line=side in PRECISION or side in ENGINES)
                if "failed" in report:  # a precision side's worker failed: its one line, the other sides run
                    print(f"{shape} batch {batch} round {index + 1} {side}: failed: {report['failed']}", flush=True)
                    skip[side] = f"its worker failed: {report['failed']}"
                    skipped.setdefault(side, skip[side])
                    return None
                phases = ", ".join(f"{k} {v:.0f}" for k, v in report["phases"].items())
                print(f"{shape} batch {batch} round {index + 1} {side:7}: {report['rate']:.1f} tok/s, TTFT "
                      f"{report['ttft']:.3f} s, peak RSS {report['peak_rss_mb']:.0f} MB (each phase's own peak: "
                      f"{phases}"
                      f"{'' if report['peak_resets'] else '; VmHWM not resettable here: cumulative'}), "
                      f"threads: C env "
                      f"{report['env']}, torch {report['torch_threads']}"
                      + (f", MindSpore {report['runtime_threads']}, first call {report['first_call_s']:.1f} s"
                         if side.startswith("ours") else "")
                      + ("".join(f", outside the library {name} {ms:.2f} ms a step ({100 * share:.1f}%)"
                                 for name, (ms, share) in report["host"].items()) if report.get("host") else "")
                      + (f", CTranslate2 {report['ct2_version']} intra_threads {report['runtime_threads']}"
                         if side in CT2_SIDES else "")
                      + (f", llama.cpp (llama-cpp-python {report['llamacpp_version']}) n_threads "
                         f"{report['runtime_threads']} n_threads_batch {report['threads_batch']}, KV cache "
                         f"{report['kv_cache']}, n_ctx {report['n_ctx']}" if side in LLAMACPP_SIDES else ""),
                      flush=True)
                return report
            runs = C.alternate(sides, args.rounds, one)
            rows.append((shape, batch, {side: [r for r in reports if r] for side, reports in runs.items()}))
            if args.forward:
                def forward(side, index, shape=shape, batch=batch, skip=notes["skipped"]):
                    if side in skip:
                        return None
                    report, _ = C.run_worker(__file__, ["--worker", side, "--job", "forward", "--work", work,
                                                        "--shape", shape, "--batch", str(batch), "--threads",
                                                        str(args.threads)], args.threads, one_line=side in PRECISION)
                    if "failed" in report:
                        print(f"{shape} batch {batch} round {index + 1} {side} forward: failed: {report['failed']}")
                        return None
                    print(f"{shape} batch {batch} round {index + 1} {side} forward: {report['rate']:.0f} tok/s, first "
                          f"call {report['first_call_s']:.1f} s, peak RSS {report['peak_rss_mb']:.0f} MB", flush=True)
                    return report
                runs = C.alternate(tuple(x for x in sides if x not in ENGINES), args.rounds, forward)
                forward_rows.append((shape, batch, {side: [r for r in reports if r] for side, reports in runs.items()}))
    print(f"\n{C.machine_line(args.threads)}")
    if any(PRECISION.get(side) for side in sides):
        print(C.precision_line())
    print(f"memory read rate: {C.read_bandwidth_gbs(args.threads):.1f} GB/s ({args.threads} threads summing 1 GiB, "
          "best of 5): a decode step that reads its weights once a token runs at most this / its bytes a token")
    if ct2:
        print(f"CTranslate2 {ct2['version']}, compute types on this CPU: {', '.join(ct2['compute_types'])}")
    if gguf:
        print(f"llama.cpp: llama-cpp-python {gguf['version']}, built for {gguf['build']}; KV cache "
              + ", ".join(f"{side} {LLAMACPP_KV[side]}" for side in LLAMACPP_SIDES if side in sides)
              + "; one llama_batch of every prompt, then a token per sequence a step (its C API), greedy = argmax")
    for side, reason in skipped.items():
        print(f"{side}: not in the table: {reason}")
    print(f"{PROMPT}-token prompts, {NEW} new tokens, greedy; {args.rounds} rounds, sides alternating, each "
          f"in its own worker; median [min-max] over rounds; peak RSS = generate's (import, load, first call, timed "
          f"calls), without our no-cache path's compiles (given apart where it ran)\n")
    print_table(rows)
    agreement = list(agreement_lines(rows))
    if agreement:
        print(f"\ngreedy tokens against ours (fp32), the same prompts: per side, how many of the {NEW} new tokens "
              "equal ours before the first difference, min / median / max over the sequences (random weights: "
              "near-ties can flip a token, after which the sequences part)")
        print("\n".join(agreement))
    if forward_rows:
        print_forward(forward_rows)
    for shape in shapes:
        if shape in LLAMA_SHAPES:
            print(kv_cache_line(shape))


def print_forward(rows):
    """The --forward table: each side's tokens/s over [batch, FORWARD_SEQ], against HF, its first call and peak."""
    print(f"\nforward over [batch, {FORWARD_SEQ}], median of {FORWARD_REPEATS} calls after a warm-up; a worker per "
          "side and round (its peak RSS is the forward's alone)\n")
    print("| shape | batch | side | forward tok/s | vs HF | first call s | peak RSS MB | RSS vs HF |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for shape, batch, runs in rows:
        hf = runs.get("hf") or []
        hf_rate, hf_rss = (C.median([r[k] for r in hf]) for k in ("rate", "peak_rss_mb")) if hf else (None, None)
        for side, reports in runs.items():
            if not reports:
                continue
            rate, rss = (C.median([r[k] for r in reports]) for k in ("rate", "peak_rss_mb"))
            print(f"| {shape} | {batch} | {side} | {C.spread([r['rate'] for r in reports])} | "
                  f"{f'{rate / hf_rate:.2f}x' if hf_rate else '-'} | "
                  f"{C.median([r['first_call_s'] for r in reports]):.1f} | {rss:.0f} | "
                  f"{f'{rss / hf_rss:.2f}x' if hf_rss else '-'} |")


def kv_cache_line(shape, length=1024):
    """What grouped-query attention saves: the decode KV cache of one ``length``-token sequence, fp32, with the
    shape's key/value groups against one per head (arithmetic)."""
    s = LLAMA_SHAPES[shape]
    per_head = 2 * s["num_hidden_layers"] * length * (s["hidden_size"] // s["num_attention_heads"]) * 4

    def mib(heads):
        return per_head * heads / 2 ** 20
    return (f"{shape}: decode KV cache per {length}-token sequence (fp32) {mib(s['num_key_value_heads']):.1f} MiB with "
            f"{s['num_key_value_heads']} key/value heads, {mib(s['num_attention_heads']):.1f} MiB with "
            f"{s['num_attention_heads']} ({s['num_attention_heads'] // s['num_key_value_heads']}x)")


def check_sides(sides, converter=None):
    """--sides: known names, at least two, one of them a peer (hf, a CTranslate2 or a llama.cpp side); the CTranslate2
    sides need ``ctranslate2`` importable (the bench extra), the llama.cpp sides ``llama_cpp`` and ``sentencepiece``
    importable and ``converter`` a folder holding llama.cpp's converter. A bad list: one line, exit 2."""
    import importlib.util
    unknown = [x for x in sides if x not in SIDES]
    peers = [x for x in sides if x == "hf" or x in ENGINES]
    if unknown or not peers or len(sides) < 2:
        print(f"--sides {','.join(sides)}: give a peer (hf, {', '.join(ENGINES)}) and one or more of "
              f"{', '.join(x for x in SIDES if x.startswith('ours'))}", file=sys.stderr)
        raise SystemExit(2)
    if any(x in CT2_SIDES for x in sides) and importlib.util.find_spec("ctranslate2") is None:
        print(f"--sides {','.join(sides)}: the CTranslate2 sides need ctranslate2=={CT2_VERSION}, not importable here "
              f"(pip install 'mindformers-gptlocal[bench]', or leave the ct2-* sides out)", file=sys.stderr)
        raise SystemExit(2)
    if not any(x in LLAMACPP_SIDES for x in sides):
        return
    missing = [name for name in ("llama_cpp", "sentencepiece") if importlib.util.find_spec(name) is None]
    if missing:
        print(f"--sides {','.join(sides)}: the llama.cpp sides need {' and '.join(missing)}, not importable here "
              f"({LLAMACPP_INSTALL if 'llama_cpp' in missing else ''}"
              f"{'; ' if len(missing) == 2 else ''}{'pip install sentencepiece' if 'sentencepiece' in missing else ''}"
              ", or leave the llamacpp-* sides out)", file=sys.stderr)
        raise SystemExit(2)
    parts = ("convert_hf_to_gguf.py", "conversion", "gguf-py")
    if not converter or not all(os.path.exists(os.path.join(converter, part)) for part in parts):
        print(f"--llamacpp-converter {converter or '(not given)'}: the llama.cpp sides need llama.cpp's converter: "
              f"{LLAMACPP_CONVERTER}", file=sys.stderr)
        raise SystemExit(2)


def best_peer(runs, peers, precision=None):
    """(side, median decode rate) of the fastest side among ``peers`` measured (of ``precision`` if given), or
    None."""
    found = [(side, C.median([r["rate"] for r in reports])) for side, reports in runs.items()
             if side in peers and reports and (precision is None or PRECISION.get(side, "fp32") == precision)]
    return max(found, key=lambda x: x[1]) if found else None


def leading_equal(ours, theirs):
    """How many tokens two greedy sequences share before their first difference."""
    return next((index for index, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))


def agreement_lines(rows, reference="ours"):
    """Per shape and batch: every side's greedy tokens against ``reference``'s (the same prompts), as the number of
    leading new tokens equal, min / median / max over the sequences (the last round's tokens)."""
    for shape, batch, runs in rows:
        ours = (runs.get(reference) or [{}])[-1].get("tokens")
        if not ours:
            continue
        found = []
        for side, reports in runs.items():
            if side != reference and reports and reports[-1].get("tokens"):
                equal = [leading_equal(a, b) for a, b in zip(ours, reports[-1]["tokens"])]
                found.append(f"{side} {min(equal)} / {C.median(equal):.0f} / {max(equal)}")
        if found:
            yield f"{shape}, batch {batch}: " + ", ".join(found)


def print_table(rows):
    """The markdown table: every side against HF (where it ran), against the CTranslate2 side of the same precision
    and against the llama.cpp side of the same precision (where one ran: fp32 / F32, int8 / Q8_0, bf16 / BF16); then
    our best precision against CTranslate2's best and llama.cpp's best, per shape and batch."""
    print("| shape | batch | side | precision | decode tok/s | vs HF | vs CT2 same precision | TTFT s | TTFT vs HF "
          "| TTFT vs CT2 | vs llama.cpp same precision: decode / TTFT / RSS | cache/no-cache | first call s "
          "| peak RSS MB | RSS vs HF | RSS vs CT2 | each phase's peak MB: import / load / first call / timed |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | --- |")
    bests = []

    def ratio(value, reference, fmt="{:.2f}x"):
        return fmt.format(value / reference) if value is not None and reference else "-"

    for shape, batch, runs in rows:
        def medians(side):
            reports = runs.get(side) or []
            return tuple(C.median([r[k] for r in reports]) for k in ("rate", "ttft", "peak_rss_mb"))

        def same_precision(side, peers):
            peer = best_peer(runs, peers, PRECISION.get(side, "fp32"))
            return medians(peer[0]) if peer and peer[0] != side else (None, None, None)
        hf = medians("hf") if runs.get("hf") else (None, None, None)
        for side, reports in runs.items():
            if not reports:
                continue
            rate, ttft, rss = medians(side)
            precision = PRECISION.get(side, "fp32")
            peer, gguf = same_precision(side, CT2_SIDES), same_precision(side, LLAMACPP_SIDES)
            nocache = C.median([r.get("nocache_rate") for r in reports])
            first = C.median([r.get("first_call_s") for r in reports])
            nocache_rss = C.median([r.get("recompute_peak_rss_mb") for r in reports])
            phases = " / ".join(f"{C.median([r['phases'][k] for r in reports]):.0f}"
                                for k in ("import", "load", "first_call", "timed"))
            print(f"| {shape} | {batch} | {side} | {precision} | {C.spread([r['rate'] for r in reports], '{:.1f}')} | "
                  f"{ratio(rate, hf[0])} | {ratio(rate, peer[0])} | {ttft:.3f} | {ratio(ttft, hf[1])} | "
                  f"{ratio(ttft, peer[1])} | "
                  f"{' / '.join(ratio(x, y) for x, y in zip((rate, ttft, rss), gguf)) if gguf[0] else '-'} | "
                  f"{f'{rate / nocache:.1f}x (its peak {nocache_rss:.0f} MB)' if nocache else '-'} | "
                  f"{f'{first:.1f}' if first else '-'} | "
                  f"{rss:.0f} | {ratio(rss, hf[2])} | {ratio(rss, peer[2])} | {phases} |")
        ours = [(side, medians(side)[0]) for side, reports in runs.items() if side.startswith("ours") and reports]
        for name, peers in (("CTranslate2", CT2_SIDES), ("llama.cpp", LLAMACPP_SIDES)):
            theirs = best_peer(runs, peers)
            if ours and theirs:
                side, rate = max(ours, key=lambda x: x[1])
                bests.append(f"{shape}, batch {batch}: our best {side} {rate:.1f} tok/s, {name}'s best {theirs[0]} "
                             f"{theirs[1]:.1f} tok/s: {rate / theirs[1]:.2f}x")
    if bests:
        print("\n'vs' columns: this side / the other (above 1.00x: this side is faster, or for TTFT and RSS, "
              "slower / larger).")
        print("\n".join(bests))


if __name__ == "__main__":
    main()
