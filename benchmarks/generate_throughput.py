"""Generation speed of gpt_local's KV cache against Hugging Face `generate` (PyTorch, with its cache) and CTranslate2,
same weights, same prompts, same machine, same run; GPT-2 and Llama-style models.

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

``--sides ours,ours-matmul,hf``: ours-matmul is ours with model_config.cpu_kernels {linear: plain} (every Linear and
the head on MindSpore's MatMul, the path before the GEMM kernel by row count), alternating with the others in the
same run; ours-plain-rms-swiglu (a Llama-style shape) {rms_norm: plain, swiglu: plain}: MindSpore's RMSNorm and
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

SHAPES = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),  # GPT2Config's
          "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)}
LLAMA_SHAPES = {  # LlamaConfig's: GPT-2 small's width and depth with Llama's layers, and a tiny one
    "llama": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000),
    "llama-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=688, vocab_size=8192)}
PROMPT, NEW = 32, 128
FORWARD_SEQ, FORWARD_REPEATS = 256, 3  # --forward: [batch, FORWARD_SEQ], the median of this many timed calls
TTFT_CALLS = 5  # TTFT: the median of this many calls on each side (one call swung 2x on a loaded machine)
CT2_SIDES = {"ct2-fp32": "float32", "ct2-int8": "int8", "ct2-bf16": "bfloat16"}  # side -> compute_type
SIDES = ("ours", "ours-mf", "ours-matmul", "ours-plain-decode", "ours-decode-kernel", "ours-cached", "ours-bf16",
         "ours-bf16-per-call", "ours-bf16-decode-kernel", "ours-plain-rms-swiglu",
         "ours-int8", "ours-int8-plain-decode", "hf", *CT2_SIDES)
# model_config.cpu_kernels given to from_pretrained (ours-matmul: every Linear and the head on MatMul;
# ours-plain-decode: the decode step's plain graph, not the decode-layer kernel; ours-decode-kernel: the decode-layer
# kernel, which auto gives float32 and int8 models; ours-bf16-decode-kernel: a bf16 model's, kernel only); the other
# sides keep the converted
# folder's (auto), as gptlocal generate runs it
SIDE_KERNELS = {"ours-matmul": {"linear": "plain"}, "ours-plain-decode": {"decode_layer": "plain"},
                "ours-decode-kernel": {"decode_layer": "kernel"}, "ours-bf16-decode-kernel": {"decode_layer": "kernel"},
                "ours-int8-plain-decode": {"decode_layer": "plain"},
                "ours-plain-rms-swiglu": {"rms_norm": "plain", "swiglu": "plain"}}
# more from_pretrained overrides by side (ours-bf16: the GEMMs in bfloat16, model_config.compute_dtype)
SIDE_OVERRIDES = {side: {"compute_dtype": "bfloat16"}
                  for side in ("ours-bf16", "ours-bf16-per-call", "ours-bf16-decode-kernel")}
# the ours sides not built for inference (from_pretrained's inference=False: float32 Parameters); the others as
# gptlocal generate builds them (runtime/loader.py load_model: inference=True)
TRAINING_BUILD = ("ours-bf16-per-call",)
# each side's precision: the ratio columns compare a side with the CTranslate2 side of the same precision
PRECISION = {"ours-bf16": "bf16", "ours-bf16-per-call": "bf16", "ours-bf16-decode-kernel": "bf16", "ours-int8": "int8",
             "ours-int8-plain-decode": "int8", "ct2-int8": "int8", "ct2-bf16": "bf16"}  # else fp32
CT2_VERSION = "4.8.5"  # the bench extra's pin (setup.cfg)
# --linear-kernel -> the kernels side's cpu_kernels of kernels_vs_plain (the plain side: {linear: plain})
LINEAR_KERNEL = {"rows": "auto", "always": "kernel", "off": "plain"}


def vocab(shape):
    return {**SHAPES, **LLAMA_SHAPES}[shape]["vocab_size"]


def no_eos(shape):
    """Our generate's keywords for ``shape``: a Llama-style model's end token (0) is one a random model can pick, so
    none stops it (the peers' ``min_new_tokens`` / ``min_length`` do the same)."""
    return {"eos_token_id": -1} if shape in LLAMA_SHAPES else {}


def timed_ours(model, prompts, use_past, **options):
    """(ttft, total) seconds of one greedy generation (after a warm-up call of the same shape)."""
    model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past, **options)
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=NEW, do_sample=False, use_past=use_past, **options)
    total = time.perf_counter() - start
    if use_past:  # TTFT: the prefill call of the cache that generation used (compiled by the warm-up)
        cache = model.kv_cache(len(prompts), PROMPT + NEW)
        return C.median([C.timed(lambda: cache.prefill(prompts)) for _ in range(TTFT_CALLS)]), total
    start = time.perf_counter()
    model.generate(prompts, max_new_tokens=1, do_sample=False, use_past=use_past, **options)
    return time.perf_counter() - start, total


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
    return ttft, total


def timed_ct2(generator, prompts):
    """(ttft, total) seconds of CTranslate2's greedy generation of NEW tokens (TTFT: the median of TTFT_CALLS
    generations of one token); ``prompts`` are token strings (its Generator takes no ids)."""
    options = dict(include_prompt_in_result=False, sampling_topk=1, beam_size=1)
    ttft = C.median([C.timed(lambda: generator.generate_batch(prompts, max_length=1, **options))
                     for _ in range(TTFT_CALLS)])
    start = time.perf_counter()
    out = generator.generate_batch(prompts, max_length=NEW, min_length=NEW, **options)
    total = time.perf_counter() - start
    assert all(len(r.sequences_ids[0]) == NEW for r in out), [len(r.sequences_ids[0]) for r in out]
    return ttft, total


def decode_rate(batch, ttft, total):
    return batch * (NEW - 1) / max(total - ttft, 1e-9)


def setup(work, shape, sides=()):
    """A random HF model of ``shape`` (GPT-2, or LlamaForCausalLM with an untied head for a Llama-style shape) saved
    under work/shape, converted to ours under work/shape_ms (``gptlocal convert hf2ms``'s ``hf_to_ms``); for the
    precision sides among ``sides`` also ours quantized to int8 (work/shape_int8) and CTranslate2's conversions
    (work/shape_ct2-*). Writes work/shape_setup.json: {"skipped": {side: one-line reason}, "ct2": version and the
    compute types it supports on this CPU}."""
    import json
    import torch
    from mindformers_gptlocal.checkpoint.hf_models import hf_to_ms
    torch.manual_seed(0)
    if shape in LLAMA_SHAPES:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0,
                                             eos_token_id=0, **LLAMA_SHAPES[shape]))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_positions=1024, **SHAPES[shape]))
    model.save_pretrained(os.path.join(work, shape))
    del model
    hf_to_ms(os.path.join(work, shape), os.path.join(work, shape + "_ms"))
    notes = {"skipped": {}}
    if any(side.startswith("ours-int8") for side in sides):
        try:
            from mindformers_gptlocal.quantize import quantize_model
            quantize_model(os.path.join(work, shape + "_ms"), os.path.join(work, shape + "_int8"), "int8")
        except Exception as err:  # pylint: disable=broad-except  (one line for the table, the other sides run)
            for side in ("ours-int8", "ours-int8-plain-decode"):
                notes["skipped"][side] = f"quantize_model(dir, out, 'int8') failed: {C.error_line(err)}"
    ct2 = [side for side in sides if side in CT2_SIDES]
    if ct2:
        notes["ct2"] = ct2_convert(work, shape, ct2, notes["skipped"])
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


def worker(side, work, shape, batch, threads, recompute, job="generate"):
    """One side's numbers for one shape and batch; prints a WORKER line. ``phases``: each phase's own peak RSS
    (MB; VmHWM reset at the phase's start): import, build + load, the first generation (our compiles), the timed
    generations, and (``recompute``) our no-cache path; ``peak_rss_mb`` is generate's peak, without the no-cache
    path's full-width compiles (before, they counted in the tiny rows' peak). ``job`` "forward": ``forward_worker``;
    ``work`` "-": the threads checked, nothing measured."""
    env = C.check_threads(threads, f"{side} generate worker")
    if work == "-":
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
            ttft, total = timed_hf(model, prompts)
    elif side in CT2_SIDES:  # CTranslate2's Generator on its conversion of the same HF weights (setup)
        with phases("import"):
            import ctranslate2
        report["ct2_version"] = ctranslate2.__version__
        with phases("load"):
            model = ctranslate2.Generator(os.path.join(work, f"{shape}_{side}"), device="cpu",
                                          compute_type=CT2_SIDES[side], intra_threads=threads, inter_threads=1)
        report["runtime_threads"] = threads  # intra_threads (CTranslate2 has no getter); OMP_NUM_THREADS checked
        tokens = [[ct2_token(t) for t in prompt] for prompt in prompts]
        with phases("first_call"):
            timed_ct2(model, tokens)  # warm-up
        with phases("timed"):
            ttft, total = timed_ct2(model, tokens)
    else:  # ours: the model's own classes (gptlocal generate's: no MindFormers); ours-mf: MindFormers' classes
        report["runtime_threads"] = C.mindspore_threads(threads, "ours generate worker")
        model = ours_model(side, work, shape, batch, phases, report)
        with phases("first_call"):
            start = time.perf_counter()
            model.generate(prompts, max_new_tokens=NEW, do_sample=False, **no_eos(shape))  # compiles prefill + decode
            report["first_call_s"] = time.perf_counter() - start
        with phases("timed"):
            ttft, total = timed_ours(model, prompts, True, **no_eos(shape))
        if recompute:  # our no-cache path compiles full-width forwards: its own phase, not generate's peak
            with phases("recompute"):
                n_ttft, n_total = timed_ours(model, prompts, False, **no_eos(shape))
            report["nocache_rate"] = decode_rate(batch, n_ttft, n_total)
            report["recompute_peak_rss_mb"] = phases.peaks["recompute"]
    if side != "hf" and "torch" in sys.modules:
        raise SystemExit(f"{side} generate worker: PyTorch was imported (it would count in its peak RSS)")
    report.update(ttft=ttft, rate=decode_rate(batch, ttft, total), phases=phases.peaks, rss_after=phases.after,
                  peak_rss_mb=phases.peak(("import", "load", "first_call", "timed")), peak_resets=phases.resets)
    C.emit(report)


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
        model = GPTLocalForCausalLM(GPTLocalConfig(**config, cpu_kernels={"linear": linear}))
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
                        help="ours (the model's own classes, as gptlocal generate: no MindFormers), ours-mf (the "
                             "model on MindFormers' bases, mindformers_gptlocal.GPTLocalForCausalLM), ours-matmul "
                             "(ours with model_config.cpu_kernels {linear: plain}: MatMul in every Linear), "
                             "ours-plain-decode (cpu_kernels {decode_layer: plain}), ours-decode-kernel (cpu_kernels "
                             "{decode_layer: kernel}; auto runs it too), ours-cached (ours through a compile-cache "
                             "folder of this run, as gptlocal generate's default --compile-cache: round 1 compiles and "
                             "stores, later rounds load), ours-bf16 (compute_dtype bfloat16), ours-bf16-per-call (the "
                             "same, float32 weights rounded at every GEMM), ours-bf16-decode-kernel (ours-bf16 with "
                             "cpu_kernels {decode_layer: kernel}), ours-int8 (a quantize_model int8 directory), "
                             "ours-int8-plain-decode, ours-plain-rms-swiglu (a Llama-style shape: cpu_kernels "
                             "{rms_norm: plain, swiglu: plain}), hf, ct2-fp32, ct2-int8, ct2-bf16 (CTranslate2, the "
                             "bench extra)")
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
    check_sides(sides)
    work = C.scratch_dir("gptlocal-gen-")
    print(C.machine_line(args.threads), flush=True)
    if any(PRECISION.get(side) for side in sides):
        print(C.precision_line(), flush=True)
    rows, forward_rows, skipped, ct2 = [], [], {}, None
    for shape in shapes:
        import json
        import subprocess
        made = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {HERE!r}); "
                               f"from generate_throughput import setup; setup({work!r}, {shape!r}, {sides!r})"],
                              env=C.worker_env(args.threads), cwd=tempfile.gettempdir(), check=False,
                              capture_output=True, text=True)
        if made.returncode:
            raise SystemExit(f"setup of {shape} failed (exit {made.returncode}):\n"
                             f"{(made.stdout + made.stderr)[-4000:]}")
        with open(os.path.join(work, shape + "_setup.json"), encoding="utf-8") as handle:
            notes = json.load(handle)
        ct2 = notes.get("ct2", ct2)
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
                                         one_line=side in PRECISION or side in CT2_SIDES)
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
                      + (f", CTranslate2 {report['ct2_version']} intra_threads {report['runtime_threads']}"
                         if side in CT2_SIDES else ""), flush=True)
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
                runs = C.alternate(tuple(x for x in sides if x not in CT2_SIDES), args.rounds, forward)
                forward_rows.append((shape, batch, {side: [r for r in reports if r] for side, reports in runs.items()}))
    print(f"\n{C.machine_line(args.threads)}")
    if any(PRECISION.get(side) for side in sides):
        print(C.precision_line())
    if ct2:
        print(f"CTranslate2 {ct2['version']}, compute types on this CPU: {', '.join(ct2['compute_types'])}")
    for side, reason in skipped.items():
        print(f"{side}: not in the table: {reason}")
    print(f"{PROMPT}-token prompts, {NEW} new tokens, greedy; {args.rounds} rounds, sides alternating, each "
          f"in its own worker; median [min-max] over rounds; peak RSS = generate's (import, load, first call, timed "
          f"calls), without our no-cache path's compiles (given apart where it ran)\n")
    print_table(rows)
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


def check_sides(sides):
    """--sides: known names, at least two, one of them a peer (hf or a CTranslate2 side); the CTranslate2 sides
    need ``ctranslate2`` importable (the bench extra). A bad list: one line, exit 2."""
    import importlib.util
    unknown = [x for x in sides if x not in SIDES]
    peers = [x for x in sides if x == "hf" or x in CT2_SIDES]
    if unknown or not peers or len(sides) < 2:
        print(f"--sides {','.join(sides)}: give a peer (hf, {', '.join(CT2_SIDES)}) and one or more of "
              f"{', '.join(x for x in SIDES if x.startswith('ours'))}", file=sys.stderr)
        raise SystemExit(2)
    if any(x in CT2_SIDES for x in sides) and importlib.util.find_spec("ctranslate2") is None:
        print(f"--sides {','.join(sides)}: the CTranslate2 sides need ctranslate2=={CT2_VERSION}, not importable here "
              f"(pip install 'mindformers-gptlocal[bench]', or leave the ct2-* sides out)", file=sys.stderr)
        raise SystemExit(2)


def best_ct2(runs, precision=None):
    """(side, median decode rate) of the fastest CTranslate2 side measured (of ``precision`` if given), or None."""
    found = [(side, C.median([r["rate"] for r in reports])) for side, reports in runs.items()
             if side in CT2_SIDES and reports and (precision is None or PRECISION.get(side, "fp32") == precision)]
    return max(found, key=lambda x: x[1]) if found else None


def print_table(rows):
    """The markdown table: every side against HF (where it ran) and against the CTranslate2 side of the same
    precision (where one ran); then our best precision against CTranslate2's best, per shape and batch."""
    print("| shape | batch | side | precision | decode tok/s | vs HF | vs CT2 same precision | TTFT s | TTFT vs HF "
          "| TTFT vs CT2 | cache/no-cache | first call s | peak RSS MB | RSS vs HF | RSS vs CT2 | each phase's peak MB: "
          "import / load / first call / timed |")
    print("| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| --- |")
    bests = []

    def ratio(value, reference, fmt="{:.2f}x"):
        return fmt.format(value / reference) if value is not None and reference else "-"

    for shape, batch, runs in rows:
        def medians(side):
            reports = runs.get(side) or []
            return tuple(C.median([r[k] for r in reports]) for k in ("rate", "ttft", "peak_rss_mb"))
        hf = medians("hf") if runs.get("hf") else (None, None, None)
        for side, reports in runs.items():
            if not reports:
                continue
            rate, ttft, rss = medians(side)
            precision = PRECISION.get(side, "fp32")
            peer = best_ct2(runs, precision)
            peer = medians(peer[0]) if peer and peer[0] != side else (None, None, None)
            nocache = C.median([r.get("nocache_rate") for r in reports])
            first = C.median([r.get("first_call_s") for r in reports])
            nocache_rss = C.median([r.get("recompute_peak_rss_mb") for r in reports])
            phases = " / ".join(f"{C.median([r['phases'][k] for r in reports]):.0f}"
                                for k in ("import", "load", "first_call", "timed"))
            print(f"| {shape} | {batch} | {side} | {precision} | {C.spread([r['rate'] for r in reports], '{:.1f}')} | "
                  f"{ratio(rate, hf[0])} | {ratio(rate, peer[0])} | {ttft:.3f} | {ratio(ttft, hf[1])} | "
                  f"{ratio(ttft, peer[1])} | "
                  f"{f'{rate / nocache:.1f}x (its peak {nocache_rss:.0f} MB)' if nocache else '-'} | "
                  f"{f'{first:.1f}' if first else '-'} | "
                  f"{rss:.0f} | {ratio(rss, hf[2])} | {ratio(rss, peer[2])} | {phases} |")
        ours = [(side, medians(side)[0]) for side, reports in runs.items() if side.startswith("ours") and reports]
        theirs = best_ct2(runs)
        if ours and theirs:
            side, rate = max(ours, key=lambda x: x[1])
            bests.append(f"{shape}, batch {batch}: our best {side} {rate:.1f} tok/s, CTranslate2's best {theirs[0]} "
                         f"{theirs[1]:.1f} tok/s: {rate / theirs[1]:.2f}x")
    if bests:
        print("\n'vs' columns: this side / the other (above 1.00x: this side is faster, or for TTFT and RSS, "
              "slower / larger).")
        print("\n".join(bests))

if __name__ == "__main__":
    main()
