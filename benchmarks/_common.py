"""What every benchmark here shares: the workers' thread environment and its check inside each worker,
peak RSS (VmHWM), alternating rounds with median and min-max, the machine line, GEMM peaks, and the
PyTorch training loop (Hugging Face GPT-2 or Llama) the train and finetune benchmarks compare against.

Why workers get an explicit environment: ``import mindspore`` sets ``OMP_NUM_THREADS=1`` in the C
environment (``os.environ`` does not show it), and a child started without ``env=`` inherits it, so a
PyTorch worker would run on one thread. Every worker is started through :func:`run_worker` (or with
:func:`worker_env`), and calls :func:`check_threads` first: it reads the variables from the C
environment (what OpenMP, MKL and OpenBLAS read) and refuses to measure with other counts than asked.

This module imports neither MindSpore nor PyTorch at import time; the parent process of a benchmark
imports neither, so only workers carry them.
"""
import atexit
import ctypes
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
OFFLINE = dict(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
WORKER_TAG = "WORKER "

# The random Hugging Face models the inference benchmarks (generate, serve) make (``save_random_hf``): GPT2Config's
# tiny and small, and LlamaConfig's GPT-2 small width and depth with Llama's layers (an untied 32,000 head) and a tiny one
HF_GPT2_SHAPES = {"tiny": dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192),
                  "small": dict(n_layer=12, n_embd=768, n_head=12, vocab_size=50257)}
HF_LLAMA_SHAPES = {
    "llama": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                  intermediate_size=2048, vocab_size=32000),
    "llama-tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       intermediate_size=688, vocab_size=8192)}


def save_random_hf(shape, out):
    """A random HF model of ``shape`` saved in ``out``: a LlamaForCausalLM with an untied head for a
    ``HF_LLAMA_SHAPES`` shape, else a GPT2LMHeadModel of ``HF_GPT2_SHAPES`` (1,024 positions either way; the caller
    seeds torch)."""
    if shape in HF_LLAMA_SHAPES:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0,
                                             eos_token_id=0, **HF_LLAMA_SHAPES[shape]))
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_positions=1024, **HF_GPT2_SHAPES[shape]))
    model.save_pretrained(out)


# Model shapes the train and finetune benchmarks share (batch and seq are defaults; the scripts take flags). GPT-2's
# layout unless ``arch`` is "llama": Llama-style layers (rope, grouped-query attention over ``groups`` key/value heads,
# SwiGLU of width ``ffn``, RMSNorm, no biases, an untied head), against Hugging Face's LlamaForCausalLM.
SHAPES = {
    "tiny": dict(layers=4, hidden=256, heads=4, vocab=8192, batch=4, seq=256),
    "small": dict(layers=12, hidden=768, heads=12, vocab=50257, batch=2, seq=256),
    "llama": dict(arch="llama", layers=12, hidden=768, heads=12, groups=4, ffn=2048, vocab=8192, batch=2, seq=256),
    "llama-tiny": dict(arch="llama", layers=4, hidden=256, heads=8, groups=2, ffn=688, vocab=8192, batch=4, seq=256),
}
# model_config keys of the Llama-style layout (model_configs/pretrain_llama_style_tiny_cpu.yaml's)
LLAMA_KEYS = dict(position_embedding_type="rope", rotary_base=10000.0, hidden_act="swiglu", normalization="RMSNorm",
                  layernorm_epsilon=1e-5, add_bias_linear=False, untie_embeddings_and_output_weights=True)


# ---------------------------------------------------------------------------------------------- threads
def worker_env(threads, **extra):
    """The explicit environment of every worker: the three thread variables = ``threads``, this tree
    importable, quiet MindSpore logs, Hugging Face offline. Nothing thread-related is inherited."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    env.update({k: str(threads) for k in THREAD_VARS}, GLOG_v="3", **OFFLINE)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def c_getenv(name):
    """The C environment's value (what OpenMP/MKL/OpenBLAS read); ``os.environ`` misses a later setenv."""
    getenv = ctypes.CDLL(None).getenv
    getenv.restype = ctypes.c_char_p
    found = getenv(name.encode())
    return found.decode() if found else None


def check_threads(threads, who):
    """Call first thing in a worker (before importing MindSpore or PyTorch). Refuses to measure when the
    C environment's thread variables differ from ``threads``; returns them for the worker's report."""
    seen = {k: c_getenv(k) for k in THREAD_VARS}
    if any(v != str(threads) for v in seen.values()):
        raise SystemExit(f"{who}: thread variables in the C environment {seen} differ from --threads {threads}; "
                         "start workers with benchmarks/_common.worker_env")
    return seen


def torch_threads(threads, who):
    """Set and check PyTorch's intra-op threads; returns the count it runs with."""
    import torch
    torch.set_num_threads(threads)
    got = torch.get_num_threads()
    if got != threads:
        raise SystemExit(f"{who}: torch runs {got} threads, asked {threads}")
    return got


def mindspore_threads(threads, who):
    """Set and check MindSpore's runtime threads (its CPU kernels' pool); returns the count."""
    import mindspore as ms
    ms.set_context(runtime_num_threads=threads)
    got = ms.get_context("runtime_num_threads")
    if got != threads:
        raise SystemExit(f"{who}: MindSpore runtime_num_threads {got}, asked {threads}")
    return got


# ---------------------------------------------------------------------------------------------- memory
def status_mb(*fields):
    """{field: MB} of this process's ``/proc/self/status`` memory fields (VmRSS, VmHWM, RssAnon, RssFile...)."""
    found = {}
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            key = line.split(":")[0]
            if key in fields:
                found[key] = int(line.split()[1]) / 1024
    return found


def vm_hwm_mb():
    """This process's peak RSS: VmHWM (exec resets it; ``ru_maxrss`` would carry the parent's at fork)."""
    return status_mb("VmHWM")["VmHWM"]


def rss_mb():
    """This process's resident memory now: VmRSS."""
    return status_mb("VmRSS")["VmRSS"]


def reset_peak():
    """Reset this process's VmHWM to its current RSS (Linux >= 4.0: ``5`` into ``/proc/self/clear_refs``), so the
    next :func:`vm_hwm_mb` is the peak of what ran since: a phase's own peak in a worker that runs several.
    Returns False where the kernel refuses (VmHWM then stays the peak since the process started)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
            refs.write("5")
        return True
    except OSError:
        return False


class Phases:
    """Peak RSS per phase of one worker: ``with phases("load"): ...`` records the phase's own VmHWM (reset at its
    start, :func:`reset_peak`) and the RSS after it, in MB. ``peak(names)``: the worker's peak over those phases
    (the max of their peaks: the process's peak while they ran), e.g. generation without a later extra job."""

    def __init__(self):
        self.peaks, self.after = {}, {}
        self.resets = True

    def __call__(self, name):
        import contextlib

        @contextlib.contextmanager
        def phase():
            self.resets = reset_peak() and self.resets
            yield
            now = status_mb("VmHWM", "VmRSS")
            self.peaks[name], self.after[name] = now["VmHWM"], now["VmRSS"]
        return phase()

    def peak(self, names=None):
        return max(v for k, v in self.peaks.items() if names is None or k in names)


# ---------------------------------------------------------------------------------------------- workers
def emit(report):
    """A worker's one result line, read back by :func:`run_worker`."""
    print(WORKER_TAG + json.dumps(report), flush=True)


def run_worker(script, args, threads, timeout=7200, one_line=False, **extra_env):
    """Run ``python script args`` with :func:`worker_env`; return (its last WORKER report, its output). A failed
    worker stops the benchmark with its output's tail, or with ``one_line`` (a side that may not run here, e.g. a
    precision this tree or CPU lacks) gives ``({"failed": its last error line}, output)``."""
    out = subprocess.run([sys.executable, os.path.abspath(script), *args], capture_output=True, text=True,
                         env=worker_env(threads, **extra_env), cwd=tempfile.gettempdir(), timeout=timeout)
    text = out.stdout + out.stderr
    lines = [x for x in out.stdout.splitlines() if x.startswith(WORKER_TAG)]
    if (out.returncode or not lines) and one_line:
        return {"failed": last_error_line(out.stderr or out.stdout, out.returncode)}, text
    if out.returncode or not lines:
        raise SystemExit(f"worker {os.path.basename(script)} {' '.join(args[:2])} failed "
                         f"(exit {out.returncode}):\n{text[-4000:]}")
    return json.loads(lines[-1][len(WORKER_TAG):]), text


def last_error_line(text, code):
    """A failed process's error in one line: the last exception line of its output (``TypeError: ...``; MindSpore
    puts its C++ stack after it), else its last line, else its exit status."""
    import re
    found = [x.strip() for x in text.splitlines() if x.strip()]
    errors = [i for i, x in enumerate(found) if re.match(r"^[\w.]*(Error|Exception|Exit)\b", x)]
    if not errors:
        return (found or [f"exit status {code}, no output"])[-1][:400]
    line = found[errors[-1]]
    if line.endswith(":"):  # MindSpore: "TypeError:", its message on the lines after (between "----" rules)
        after = [x for x in found[errors[-1] + 1:] if not x.startswith("-")]
        line = f"{line} {after[0]}" if after else line
    return line[:400]


def error_line(err):
    """An exception in one line: its type and the first line of its message that says something (MindSpore's
    start with rules of dashes and headings)."""
    lines = [x.strip() for x in str(err).splitlines() if x.strip() and not x.strip().startswith("-")]
    return f"{type(err).__name__}: {lines[0][:300] if lines else ''}"


def alternate(sides, rounds, measure):
    """Run ``measure(side, round)`` for every side, ``rounds`` times, alternating the order
    (A B C, C B A, A B C, ...) so drift and neighbours hit every side alike; {side: [results]}."""
    results = {side: [] for side in sides}
    for index in range(rounds):
        for side in (sides if index % 2 == 0 else tuple(reversed(sides))):
            results[side].append(measure(side, index))
    return results


def spread(values, fmt="{:.0f}"):
    """``median [min-max]`` of a list of numbers."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    return f"{fmt.format(statistics.median(values))} [{fmt.format(min(values))}-{fmt.format(max(values))}]"


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def steady_median(step_times, warmup):
    """Median step time after the first ``warmup`` steps (all of them if there are not more)."""
    steady = step_times[warmup:] or step_times
    return statistics.median(steady)


def cpu_info(path="/proc/cpuinfo"):
    """The first processor's fields of ``/proc/cpuinfo`` ({"model name": ..., "cpu family": "25", "flags": ...});
    empty where there is none."""
    found = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as info:
            for line in info:
                if not line.strip():
                    if found:
                        break
                    continue
                key, _, value = line.partition(":")
                found.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return found


def cpu_model():
    found = cpu_info().get("model name")
    if found:
        return found
    import platform
    return platform.processor() or "unknown CPU"


# ``--keep`` on any benchmark's command line (``run.py`` passes it on) keeps the scratch folders; taken out of
# sys.argv here, before the script's own parser sees it, so every script accepts it without declaring it.
KEEP = "--keep" in sys.argv[1:]
if KEEP:
    sys.argv.remove("--keep")


def scratch_dir(prefix):
    """A temporary work folder removed when the benchmark exits (converted models and data run to GBs:
    17 generate runs filled the disk); ``--keep`` keeps it (its path is printed)."""
    path = tempfile.mkdtemp(prefix=prefix)
    if KEEP:
        print(f"work folder kept: {path}", flush=True)
    else:
        atexit.register(shutil.rmtree, path, True)
    return path


_MACHINE = {}


def usable_cpus():
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def load_average():
    """The 1-min load average (nan where the system has none)."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def busy_line():
    """The 1-min load above which ``machine_line`` calls the machine busy: half the usable CPUs."""
    return 0.5 * usable_cpus()


def isa_decision():
    """Our kernel library's CPU-ISA decision at ``cpu_kernels.isa: auto`` (``kernels/abi/build.py`` ``describe_isa``: the
    tier its loops run, oneDNN's, the CPU's), read in a worker (the parent imports no MindSpore): "isa auto: loops
    avx2, oneDNN avx2 (CPU: avx2, oneDNN's avx2)"; "isa unknown (...)" where the worker fails."""
    if "isa" not in _MACHINE:
        code = "from mindformers_gptlocal.kernels.abi import build; print('ISA ' + build.describe_isa())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=False,
                             env=dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", "")))
        lines = [x[4:] for x in out.stdout.splitlines() if x.startswith("ISA ")]
        last = (out.stderr.strip().splitlines() or ["no output"])[-1]
        _MACHINE["isa"] = lines[-1] if lines else f"isa unknown ({last[:120]})"
    return _MACHINE["isa"]


def machine_line(threads):
    """One line naming the machine (its model name, family / model / stepping numbers and the instruction sets
    that choose our kernels' paths: ``cpu_identity``) and the thread count every worker ran with. The load average
    is the one at the first call (before any worker ran: a later reading would count the benchmark's own
    workers)."""
    if threads in _MACHINE:
        return _MACHINE[threads]
    usable = usable_cpus()
    load = load_average()
    busy = "  BUSY MACHINE: speed numbers are not meaningful, peak RSS is" if load > busy_line() else ""
    _MACHINE[threads] = (f"machine: {cpu_model()} ({cpu_identity()}), kernels' {isa_decision()}, "
                         f"{os.cpu_count()} logical CPUs ({usable} "
                         f"usable), 1-min load average {load:.1f} before the first worker; every worker: "
                         f"{', '.join(f'{k}={threads}' for k in THREAD_VARS)}, checked inside the worker{busy}")
    return _MACHINE[threads]


def read_bandwidth_gbs(threads, megabytes=1024, repeats=5):
    """This machine's memory read rate, GB/s: ``threads`` threads each summing its part of a float32 array of
    ``megabytes`` MB (numpy releases the GIL in the sum), the best of ``repeats`` after one touch. What a decode step
    that streams its weights once a token can at most read (the bound ``bytes a token / this rate``)."""
    import concurrent.futures  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    data = np.ones(megabytes * (1 << 20) // 4, np.float32)
    parts = np.array_split(data, threads)
    best = float("inf")
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        list(pool.map(np.sum, parts))  # the touch: the pages mapped, not timed
        for _ in range(repeats):
            start = time.perf_counter()
            list(pool.map(np.sum, parts))
            best = min(best, time.perf_counter() - start)
    return data.nbytes / best / 1e9


CPU_PRECISION_FLAGS = {"bf16": ("avx512_bf16", "amx_bf16"), "int8": ("avx512_vnni", "avx_vnni", "amx_int8")}


def cpu_flags():
    """The CPU's feature flags (``/proc/cpuinfo``'s first ``flags`` line), as a set; empty where unknown."""
    return set(cpu_info().get("flags", "").split())


# the instruction sets that choose our kernels' paths: the C++ kernels' clones (avx512f, avx2, plain), oneDNN's
# bf16 GEMMs (avx512_bf16, AMX) and int8 GEMMs (VNNI, AMX). Two CPUs that both call themselves "AMD EPYC" (a Zen 3
# with AVX2 only, a Zen 4 with avx512_bf16) differ in every one of these paths.
ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")


def cpu_identity(info=None):
    """The CPU's vendor, family, model and stepping numbers and which of ``ISA_FLAGS`` it has, in one phrase:
    ``AuthenticAMD family 25 model 1 stepping 1, ISA: avx2 yes, avx512f no, ...`` (no ";": scripts cut the machine
    line at the first one)."""
    info = cpu_info() if info is None else info
    flags = set(info.get("flags", "").split())
    numbers = " ".join(f"{name} {info[key]}" for name, key in (("family", "cpu family"), ("model", "model"),
                                                                ("stepping", "stepping")) if info.get(key))
    ident = " ".join(x for x in (info.get("vendor_id", ""), numbers) if x) or "family/model unknown"
    isa = ", ".join(f"{name} {'yes' if name in flags else 'no'}" for name in ISA_FLAGS) if flags else "flags unknown"
    return f"{ident}, ISA: {isa}"


def precision_line(flags=None):
    """One line: which reduced-precision instructions this CPU has (bf16: avx512_bf16 / AMX; int8: VNNI / AMX),
    so a bf16 or int8 row on a CPU without them says so."""
    flags = cpu_flags() if flags is None else flags
    parts = []
    for precision, names in CPU_PRECISION_FLAGS.items():
        have = [name for name in names if name in flags]
        parts.append(f"{precision}: {', '.join(have)}" if have else
                     f"{precision}: none of {', '.join(names)} (emulated or plain fp32 paths: not this CPU's speed)")
    return "CPU precision support: " + "; ".join(parts)


# ---------------------------------------------------------------------------------------------- GEMM peaks
def torch_gemm_gflops(n=2048, repeats=7):
    """fp32 GEMM peak through PyTorch (MKL/oneDNN): best of ``repeats`` n^3 products."""
    import torch
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best = min(timed(lambda: a @ b) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def mindspore_gemm_gflops(n=2048, repeats=7):
    """fp32 GEMM peak through MindSpore's MatMul in a compiled graph: best of ``repeats`` n^3 products."""
    import numpy as np
    import mindspore as ms
    ms.set_context(mode=ms.GRAPH_MODE, device_target="CPU")
    net = mindspore_matmul()
    rng = np.random.default_rng(0)
    a = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    b = ms.Tensor(rng.standard_normal((n, n), dtype=np.float32))
    net(a, b).asnumpy()
    best = min(timed(lambda: net(a, b).asnumpy()) for _ in range(repeats))
    return 2 * n ** 3 / best / 1e9


def mindspore_matmul(transpose_a=False, transpose_b=False):
    """A GRAPH-mode Cell of one MindSpore MatMul with these transposes (imports MindSpore only when called)."""
    from mindspore import nn, ops

    class _MatMul(nn.Cell):
        def __init__(self):
            super().__init__()
            self.matmul = ops.MatMul(transpose_a=transpose_a, transpose_b=transpose_b)

        def construct(self, x, y):
            return self.matmul(x, y)

    return _MatMul()


def timed(fn):
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def gemm_worker(framework, threads):
    """Worker body: one framework's GEMM peak on ``threads`` threads."""
    env = check_threads(threads, f"{framework} GEMM worker")
    if framework == "torch":
        runtime = torch_threads(threads, "torch GEMM worker")
        gflops = torch_gemm_gflops()
    else:
        runtime = mindspore_threads(threads, "MindSpore GEMM worker")
        gflops = mindspore_gemm_gflops()
    emit({"framework": framework, "gflops": gflops, "env": env, "runtime_threads": runtime})


# ---------------------------------------------------------------------------------------------- model math
def params_count(s):
    """The model's parameters: GPT-2's (tied head, positions sized max(1024, seq)) or the Llama-style layout's
    (``arch`` llama: QKV of ``heads + 2 * groups`` heads, SwiGLU's three [ffn, hidden] weights, two RMSNorms a layer,
    a final one, the token table and an untied head; no biases, no position table)."""
    h, layers, v = s["hidden"], s["layers"], s["vocab"]
    if s.get("arch") == "llama":
        kv = 2 * s["groups"] * (h // s["heads"])
        return 2 * v * h + layers * (h * (h + kv) + h * h + 3 * h * s["ffn"] + 2 * h) + h
    return v * h + max(1024, s["seq"]) * h + layers * (12 * h * h + 13 * h) + 2 * h


def flops_per_token(s):
    """Training FLOPs per token: 6N (forward + backward of the weights; an untied model's token table is a lookup,
    not counted) + 12*L*H*S (attention scores)."""
    lookup = s["vocab"] * s["hidden"] if s.get("arch") == "llama" else 0
    return 6 * (params_count(s) - lookup) + 12 * s["layers"] * s["hidden"] * s["seq"]


def shape_with(shape, batch=None, seq=None):
    s = dict(SHAPES[shape])
    if batch:
        s["batch"] = batch
    if seq:
        s["seq"] = seq
    return s


# ---------------------------------------------------------------------------------------------- data
def prepare_windows(workdir, seq, threads, max_bytes=600_000):
    """`prepare-data` (in a worker: the parent never imports MindSpore) -> (train MindRecord path, .npy of
    token windows of seq + 1 for PyTorch: the same tokens both sides train on)."""
    data, windows = os.path.join(workdir, "data"), os.path.join(workdir, f"windows_{seq}.npy")
    code = (
        "import json, numpy as np; from mindformers_gptlocal.data.prepare import prepare; "
        "from mindspore.mindrecord import FileReader; "
        f"c = prepare(out={data!r}, seq_length={seq}, vocab_size=8192, max_bytes={max_bytes}); "
        "r = FileReader(c['train_mindrecord']); "
        "w = np.stack([np.append(x['input_ids'], x['labels'][-1]) for x in r.get_next()]); r.close(); "
        f"np.save({windows!r}, w); open(c['train_mindrecord'] + '.rows', 'w').write(str(len(w))); "
        "print('DATA ' + json.dumps([c['train_mindrecord'], len(w)]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=worker_env(threads),
                         cwd=workdir)
    lines = [x for x in out.stdout.splitlines() if x.startswith("DATA ")]
    if out.returncode or not lines:
        raise SystemExit(out.stdout[-2000:] + out.stderr[-2000:])
    corpus, count = json.loads(lines[-1][5:])
    return corpus, windows, count


def windows_in(corpus):
    """How many rows the prepared MindRecord holds (written beside it by :func:`prepare_windows`)."""
    with open(corpus + ".rows", encoding="ascii") as handle:
        return int(handle.read())


def ours_yaml(s, steps, corpus, workdir, name, threads, pet_config=None, model_extra=None):
    """The tiny pretrain YAML resized to shape ``s`` (dropout off; a Llama-style shape gets ``LLAMA_KEYS``, its query
    groups and SwiGLU width), ``steps`` steps on ``corpus``; ``model_extra``: more model_config keys (e.g.
    attention_block_size)."""
    from mindformers_gptlocal import yaml_io
    config = yaml_io.load_yaml(os.path.join(REPO, "model_configs", "pretrain_gpt_local_tiny_cpu.yaml"))
    config["model"]["model_config"].update(
        vocab_size=s["vocab"], hidden_size=s["hidden"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], seq_length=s["seq"], max_position_embeddings=max(1024, s["seq"]),
        hidden_dropout=0.0, attention_dropout=0.0, embedding_dropout=0.0)
    if s.get("arch") == "llama":
        config["model"]["model_config"].update(LLAMA_KEYS, num_query_groups=s["groups"], intermediate_size=s["ffn"])
    config["model"]["model_config"].update(model_extra or {})
    if pet_config:
        config["model"]["model_config"]["pet_config"] = pet_config
    config["context"]["runtime_num_threads"] = threads
    config["runner_config"]["batch_size"] = s["batch"]
    config["train_dataset"]["batch_size"] = s["batch"]
    rows, available = steps * s["batch"], windows_in(corpus)
    usable = available - available % s["batch"]
    if usable < s["batch"]:
        raise SystemExit(f"{available} windows of {s['seq']} tokens prepared, fewer than one batch of {s['batch']}")
    config["train_dataset"]["data_loader"].update(dataset_dir=corpus, shuffle=False, num_samples=min(rows, usable))
    config["train_dataset"]["repeat"] = -(-rows // usable)  # short data: read it again (PyTorch wraps around too)
    config["train_dataset_task"]["dataset_config"] = config["train_dataset"]
    config["callbacks"] = [{"type": "GPTLocalThroughputMonitor", "per_print_times": 1}]
    config["output_dir"] = os.path.join(workdir, name)
    return yaml_io.dump_yaml(config, os.path.join(workdir, name + ".yaml"))


def ms_train_worker(yaml_path, threads):
    """Worker body, our side: MindFormers' trainer through ``gptlocal run`` in this process. The parent
    reads the step times from GPTLocalThroughputMonitor's lines (:func:`ms_step_times`)."""
    env = check_threads(threads, "MindSpore worker")
    from mindformers_gptlocal.cli.launcher import main as launch
    started = time.perf_counter()
    if yaml_path == "-":  # a probe: the thread checks only, no training
        code, runtime = 0, mindspore_threads(threads, "MindSpore worker")
    else:
        code = launch(["--config", yaml_path])
        import mindspore as ms
        runtime = ms.get_context("runtime_num_threads")
        if runtime != threads:
            raise SystemExit(f"MindSpore worker: runtime_num_threads {runtime}, asked {threads}")
    wall = time.perf_counter() - started
    emit({"env": env, "c_env_after_import_mindspore": {k: c_getenv(k) for k in THREAD_VARS},
          "runtime_threads": runtime, "wall_s": wall, "peak_rss_mb": vm_hwm_mb(), "code": code})


def ms_step_times(text):
    """Step seconds from GPTLocalThroughputMonitor's lines (the first includes the graph compile), and the
    LoRA / prefix-tuning trainable count if the log states one."""
    import re
    steps = [float(x) / 1000 for x in re.findall(r"\[gptlocal\] step \d+/\d+ .* ([0-9.]+) ms/step", text)]
    found = re.search(r"(?:LoRA|prefixtuning|ptuning2): ([0-9,]+) trainable", text)
    return steps, (int(found.group(1).replace(",", "")) if found else None)


def ms_graph_compile_seconds(text):
    """The step graph's compile seconds as the run's first progress line gives them (``(step graph compiled in X
    s)``), or None (loaded from the compile cache, or no such line)."""
    import re
    found = re.search(r"\(step graph compiled in ([0-9.]+) s\)", text)
    return float(found.group(1)) if found else None


# ---------------------------------------------------------------------------------------------- PyTorch side
TORCH_VARIANTS = {
    # name: (attention implementation, fused AdamW, torch.compile)
    "eager": ("eager", False, False),
    "sdpa+fused": ("sdpa", True, False),
    "compile": ("sdpa", True, True),
}
# the same in bfloat16: torch.autocast("cpu", bfloat16) around the forward and loss (oneDNN's bf16 GEMMs), fp32
# weights, gradients and AdamW state, as PyTorch's mixed precision on CPU is used
TORCH_BF16_VARIANTS = {"sdpa+fused-bf16": "sdpa+fused", "compile-bf16": "compile"}  # name: its fp32 variant


def hf_model(s, attention):
    """Hugging Face's model of shape ``s``, dropout off, with ``attention`` ("eager" or "sdpa"): GPT2LMHeadModel (tied
    head), or for a Llama-style shape LlamaForCausalLM (its keys as ``LLAMA_KEYS``: rope 10000, RMSNorm eps 1e-5, no
    biases, untied head)."""
    if s.get("arch") == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM
        config = LlamaConfig(vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["ffn"],
                             num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
                             num_key_value_heads=s["groups"], max_position_embeddings=max(1024, s["seq"]),
                             rms_norm_eps=LLAMA_KEYS["layernorm_epsilon"], rope_theta=LLAMA_KEYS["rotary_base"],
                             tie_word_embeddings=False, attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                             bos_token_id=0, eos_token_id=0)
        cls = LlamaForCausalLM
    else:
        from transformers import GPT2Config, GPT2LMHeadModel
        config = GPT2Config(vocab_size=s["vocab"], n_positions=max(1024, s["seq"]), n_embd=s["hidden"],
                            n_layer=s["layers"], n_head=s["heads"], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cls = GPT2LMHeadModel
    config._attn_implementation = attention  # noqa: SLF001 (transformers reads it at build)
    model = cls(config)
    if model.config._attn_implementation != attention:  # noqa: SLF001
        raise SystemExit(f"torch worker: asked {attention} attention, model has {model.config._attn_implementation}")
    return model


def torch_train_worker(s, steps, windows_path, threads, variant="sdpa+fused", lora=None, prefix=None):
    """Worker body, PyTorch side: Hugging Face GPT2LMHeadModel (tied head, dropout off; LlamaForCausalLM for a
    Llama-style shape, ``hf_model``) trained with AdamW
    (betas 0.9/0.95, eps 1e-8, weight decay 0.01, as our YAML) and grad-norm clipping at 1.0 (as our
    wrapper) on the same token windows. ``variant`` picks the attention kernel, fused AdamW and
    torch.compile (TORCH_VARIANTS; a TORCH_BF16_VARIANTS name: its fp32 variant under bfloat16 autocast);
    ``lora`` (dict rank/alpha/dropout) wraps the model with peft LoRA on c_attn/c_proj/c_fc and trains the
    adapters only; ``prefix`` (virtual tokens) wraps it with peft prefix tuning (PrefixTuningConfig, no
    projection) and trains the prefix only. ``steps`` 0 reports the threads and exits."""
    env = check_threads(threads, "torch worker")
    runtime = torch_threads(threads, "torch worker")
    if steps == 0:
        return emit({"env": env, "runtime_threads": runtime, "step_times": [], "peak_rss_mb": vm_hwm_mb()})
    import numpy as np
    import torch
    autocast = variant in TORCH_BF16_VARIANTS
    attention, fused, compiled = TORCH_VARIANTS[TORCH_BF16_VARIANTS.get(variant, variant)]
    if (lora or prefix) and s.get("arch") == "llama":
        raise SystemExit("torch worker: the PEFT sides are GPT-2's (c_attn/c_proj/c_fc)")
    torch.manual_seed(0)
    model = hf_model(s, attention)
    if lora:
        from peft import LoraConfig, get_peft_model
        model = get_peft_model(model, LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                                                 target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True,
                                                 task_type="CAUSAL_LM"))
    if prefix:
        from peft import PrefixTuningConfig, get_peft_model
        model = get_peft_model(model, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=prefix))
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01,
                                  **({"fused": True} if fused else {}))
    forward = torch.compile(model) if compiled else model
    windows = np.load(windows_path)
    times = []
    for step in range(steps):
        start_row = (step * s["batch"]) % max(1, len(windows) - s["batch"] + 1)
        batch = torch.from_numpy(windows[start_row:start_row + s["batch"], :s["seq"]]).long()
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = forward(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    if autocast and any(p.dtype != torch.float32 for p in trainable):
        raise SystemExit("torch worker: bf16 autocast changed a master weight's dtype")
    emit({"env": env, "runtime_threads": runtime, "variant": variant, "step_times": times,
          "trainable": sum(p.numel() for p in trainable), "peak_rss_mb": vm_hwm_mb(), "last_loss": float(loss)})
