"""The fused CPU attention kernel (mindformers_gptlocal/kernels): outputs and dQ, dK, dV as accurate as the plain
matmul + softmax path (fp32; their errors against float64, ``_compare``) for the causal mask, packed documents, counter dropout, GQA and odd sizes;
a tiny model trains with the plain path's losses step for step; the build cache reuses, rebuilds and falls
back as documented."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.kernels.abi import build, codegen
from mindformers_gptlocal.kernels.cells import attention as kernel_attention
from mindformers_gptlocal.model.attention import MASK_VALUE, BlockwiseCore, FusedCPUAttention
from references import (causal_bias, float64_weights, gpt_float64_steps, keep_reference, sum_error_bound,
                        trains_like_plain)
from mindformers_gptlocal.model.dropout import CounterDropout
from conftest import TINY, source_env


def _plain(q, k, v, bias, scale, keep=None, keep_scale=1.0):
    """The reference: GQA repeat, matmul, scale, additive bias, softmax, (dropout), matmul."""
    batch, heads, seq, dim = q.shape
    groups = k.shape[1]
    if groups != heads:
        shape = (batch, groups, heads // groups, seq, dim)
        k = ops.reshape(ops.broadcast_to(ops.expand_dims(k, 2), shape), q.shape)
        v = ops.reshape(ops.broadcast_to(ops.expand_dims(v, 2), shape), q.shape)
    probs = ops.softmax(ops.matmul(q, k.swapaxes(-1, -2)) * scale + bias, -1)
    if keep is not None:
        probs = probs * keep * keep_scale
    return ops.matmul(probs, v)


def _exact(bias, scale, keep=None, keep_scale=1.0):
    """The reference in float64 (numpy), for ``_compare``: (q, k, v, w) -> the output and d(sum(out * w)) / dq, dk,
    dv, as ``_plain`` computes them (``keep``: the dropout's 0/1 mask, times ``keep_scale``)."""
    bias = np.asarray(bias.asnumpy() if isinstance(bias, Tensor) else bias, np.float64)
    mask = None if keep is None else np.asarray(keep.asnumpy(), np.float64) * keep_scale

    def exact(q, k, v, w, magnitude=False):
        """``magnitude``: the same chain on the inputs' absolute values (the softmax's p as is, ds's difference as a
        sum): each element's sum of |terms|, what its float32 rounding error scales with (``sum_error_bound``)."""
        q, k, v, w = (np.asarray(a, np.float64) for a in (q, k, v, w))
        batch, heads, seq, dim = q.shape
        group = heads // k.shape[1]
        kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = scale * q @ kk.swapaxes(-1, -2) + bias
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        if magnitude:
            q, kk, vv, w = np.abs(q), np.abs(kk), np.abs(vv), np.abs(w)
        dropped = p if mask is None else p * mask
        dp = w @ vv.swapaxes(-1, -2) * (1 if mask is None else mask)
        ds = p * (dp + (1 if magnitude else -1) * (dp * p).sum(-1, keepdims=True))
        fold = lambda a: a.reshape(batch, heads // group, group, seq, dim).sum(2)  # noqa: E731
        return (dropped @ vv, scale * ds @ kk, fold(scale * ds.swapaxes(-1, -2) @ q),
                fold(dropped.swapaxes(-1, -2) @ w))
    return exact


def _compare(kernel_fn, plain_fn, shapes, exact, seed=0):
    """Output and every input gradient of a weighted sum, kernel vs plain, each against ``exact`` (float64): the
    kernel's float32 error (largest over a tensor) is at most twice the plain path's, plus the rounding of one sum
    of the longest length (head_dim or the keys) over the tensor's largest sum of |terms| (``sum_error_bound``,
    ``exact(..., magnitude=True)``). Both compute the same sums in float32 in different orders and blockings (the
    AVX2 and AVX-512 clones of the kernel's loops too), so their errors are of one size but not of one value: a
    bound on their difference in absolute terms (1e-5 here before) holds or not by chance and by the values'
    magnitude (dq reaches 8 at head_dim 64, where one float32 ulp is 1e-6); one relative to the result, not to its
    terms, fails where the result cancels to 0 (dq at one key: plain exactly 0, AVX-512's order 6e-8). Returns the
    largest gradient."""
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    weights = rng.standard_normal(shapes[0]).astype(np.float32)
    q, k, v = (Tensor(a) for a in arrays)
    w = Tensor(weights)
    _, got_grads = ms.value_and_grad(lambda q, k, v: (kernel_fn(q, k, v) * w).sum(), (0, 1, 2))(q, k, v)
    _, want_grads = ms.value_and_grad(lambda q, k, v: (plain_fn(q, k, v) * w).sum(), (0, 1, 2))(q, k, v)
    got = [kernel_fn(q, k, v).asnumpy()] + [g.asnumpy() for g in got_grads]
    want = [plain_fn(q, k, v).asnumpy()] + [g.asnumpy() for g in want_grads]
    length = max(shapes[0][-2], shapes[0][-1])  # the longest sum: over the keys or over head_dim
    for name, actual, plain, precise, magnitude in zip(("out", "dq", "dk", "dv"), got, want, exact(*arrays, weights),
                                                       exact(*arrays, weights, magnitude=True)):
        rounding = float(sum_error_bound(magnitude, length).max())
        error, plain_error = float(np.abs(actual - precise).max()), float(np.abs(plain - precise).max())
        assert error <= 2 * plain_error + rounding, (name, error, plain_error, rounding)
    return max(float(np.abs(g).max()) for g in want[1:])


def _packed_bias(batch, seq, ends):
    """The additive [B, 1, S, S] mask of packed rows: causal inside each document (as document_mask)."""
    bias = np.full((batch, 1, seq, seq), MASK_VALUE, np.float32)
    for row, row_ends in enumerate(ends):
        start = 0
        for end in row_ends:
            block = np.tril(np.ones((end - start, end - start), np.float32))
            bias[row, 0, start:end, start:end] = (1 - block) * MASK_VALUE
            start = end
    return Tensor(bias)


# (batch, heads, groups, seq, head_dim, query block, key block): odd sizes (S not a multiple of either block,
# head_dim not a multiple of the vector width), S = 1, GQA, MHA, GPT-2-like head_dim 64 with the default blocks
CASES = {
    "causal_odd": (2, 4, 4, 37, 24, 16, 8),
    "gqa": (2, 6, 2, 29, 13, 8, 16),
    "seq_1": (1, 2, 1, 1, 8, 16, 8),
    "head_dim_64": (1, 2, 2, 70, 64, kernel_attention.QUERY_BLOCK, kernel_attention.KEY_BLOCK),
}


@pytest.mark.parametrize("case", CASES)
def test_kernel_matches_plain_causal(library, pynative_mode, case, isa_tier):
    batch, heads, groups, seq, dim, bq, bk = CASES[case]
    scale = 0.37  # not 1/sqrt(d): as with scale_attn_by_inverse_layer_idx
    cell = kernel_attention.CPUAttention(library, scale, query_block=bq, key_block=bk)
    bias = causal_bias(seq)
    shapes = ((batch, heads, seq, dim), (batch, groups, seq, dim), (batch, groups, seq, dim))
    assert _compare(lambda q, k, v: cell(q, k, v, bias), lambda q, k, v: _plain(q, k, v, bias, scale), shapes,
                    _exact(bias, scale)) > 0.1


def test_kernel_matches_plain_packed_documents(library, pynative_mode):
    """A per-row [B, 1, S, S] document mask (packed rows); key blocks wholly outside a row's document."""
    seq = 45
    bias = _packed_bias(2, seq, [[11, 18, 34, seq], [20, 29, seq]])
    cell = kernel_attention.CPUAttention(library, 0.25, query_block=8, key_block=8)
    shapes = ((2, 3, seq, 16), (2, 3, seq, 16), (2, 3, seq, 16))
    _compare(lambda q, k, v: cell(q, k, v, bias), lambda q, k, v: _plain(q, k, v, bias, 0.25), shapes,
             _exact(bias, 0.25), seed=3)


@pytest.mark.parametrize("rate", [0.2, 0.7])  # 0.7: the rule flips (keep where the two bits differ)
def test_kernel_draws_the_counter_dropout_masks(library, pynative_mode, rate):
    """The kernel drops exactly the elements CounterDropout's mask of that step and site drops (numpy's
    ``keep_reference`` as the reference), with GQA and blocks that wrap the tables' ends in odd places."""
    batch, heads, groups, seq, dim, site, seed = 2, 4, 2, 33, 12, 7, 5
    dropout = CounterDropout(rate, site, seed)
    cell = kernel_attention.CPUAttention(library, 0.3, (dropout.bits1, dropout.bits2), dropout.scale,
                                         dropout.keep_when_differ, query_block=8, key_block=16)
    bias = causal_bias(seq)
    for step in (0, 4099):
        offsets = dropout.offsets(Tensor(step, ms.int32))
        keep = Tensor(keep_reference((batch, heads, seq, seq), step, site, seed, rate).astype(np.float32))
        shapes = ((batch, heads, seq, dim), (batch, groups, seq, dim), (batch, groups, seq, dim))
        _compare(lambda q, k, v: cell(q, k, v, bias, offsets),
                 lambda q, k, v: _plain(q, k, v, bias, 0.3, keep, dropout.scale), shapes,
                 _exact(bias, 0.3, keep, dropout.scale), seed=step)


def test_kernel_in_graph_mode(library, graph_mode):
    """Inside a compiled GRAPH-mode Cell under value_and_grad, as training runs it."""
    bias = causal_bias(40)
    rng = np.random.default_rng(9)
    shapes = ((2, 2, 40, 16), (2, 1, 40, 16), (2, 1, 40, 16))
    q, k, v = (Tensor(rng.standard_normal(shape).astype(np.float32)) for shape in shapes)
    w = Tensor(rng.standard_normal(shapes[0]).astype(np.float32))

    class Weighted(nn.Cell):
        def __init__(self, cell):
            super().__init__()
            self.cell = cell

        def construct(self, q, k, v):
            if self.cell is None:
                return (_plain(q, k, v, bias, 0.3) * w).sum()
            return (self.cell(q, k, v, bias) * w).sum()

    fused = Weighted(kernel_attention.CPUAttention(library, 0.3, query_block=16, key_block=16))
    got, got_grads = ms.jit(ms.value_and_grad(fused, (0, 1, 2)))(q, k, v)
    want, want_grads = ms.jit(ms.value_and_grad(Weighted(None), (0, 1, 2)))(q, k, v)
    arrays = [a.asnumpy() for a in (q, k, v, w)]
    exact = _exact(bias, 0.3)
    out, out_magnitude = exact(*arrays)[0], exact(*arrays, magnitude=True)[0]
    loss, loss_magnitude = float((out * arrays[3]).sum()), float((out_magnitude * np.abs(arrays[3])).sum())
    # the weighted sum over all the outputs: a sum of out.size terms, each out one of the keys' length
    assert abs(float(got.asnumpy()) - loss) <= 2 * abs(float(want.asnumpy()) - loss) + float(
        sum_error_bound(loss_magnitude, out.size + 40)), (float(got.asnumpy()), float(want.asnumpy()), loss)
    for name, actual, expected, precise, magnitude in zip(("dq", "dk", "dv"), got_grads, want_grads,
                                                          exact(*arrays)[1:], exact(*arrays, magnitude=True)[1:]):
        error = float(np.abs(actual.asnumpy() - precise).max())
        plain_error = float(np.abs(expected.asnumpy() - precise).max())
        assert error <= 2 * plain_error + float(sum_error_bound(magnitude, 40).max()), (name, error, plain_error)


# ---------------------------------------------------------------------------------------- the model
SEQ = 48


def _model_pair(**changes):
    """The model with the kernel (the CPU default) and the same model, same weights, on the plain path (cpu_kernels
    {attention: plain}). Seeded: the "it trains" checks must not depend on the draw."""
    ms.set_seed(0)
    values = dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ, **changes)
    fused = GPTLocalForCausalLM(GPTLocalConfig(**values))
    plain = GPTLocalForCausalLM(GPTLocalConfig(**values, cpu_kernels={"attention": "plain"}))
    weights = dict(fused.parameters_and_names())
    for name, param in plain.parameters_and_names():
        param.set_data(Tensor(weights[name].asnumpy()))
    assert all(layer.attention.core is layer.attention.plain for layer in plain.model.layers)
    assert all(isinstance(layer.attention.core, FusedCPUAttention) for layer in fused.model.layers)
    return fused, plain


def test_tiny_training_matches_plain_path(library, graph_mode):
    """3 AdamW steps: every first-step gradient and the losses (falling) with errors against the float64 model of the
    same weights and dropout masks (torch, same AdamW) within 8x the plain path's + 4 u (``trains_like_plain``), with
    all the kernel covers at once: packed documents (actual_seq_len), counter dropout on the attention probabilities,
    GQA, rope and GPT-2's scale_attn_by_inverse_layer_idx (layer 2's scale differs)."""
    fused, plain = _model_pair(attention_dropout=0.2, hidden_dropout=0.1, scale_attn_by_inverse_layer_idx=True,
                               position_embedding_type="rope", num_query_groups=2)
    assert fused.model.layers[0].attention.core.kernel.has_dropout
    ids = Tensor(np.random.default_rng(0).integers(1, TINY["vocab_size"], (2, SEQ + 1)).astype(np.int32))
    ends = Tensor(np.array([[11, 18, 34, SEQ], [20, 29, SEQ, SEQ]], np.int32))
    batches = [(ids[:, :-1], ids[:, 1:], None, None, None, ends)]
    reference = gpt_float64_steps(float64_weights(plain), batches[0][:2], plain.config, 3, 3e-3, dropout=True,
                                  ends=ends)
    trains_like_plain(fused, plain, batches, 3e-3, reference)


def test_fp16_and_plain_switch_keep_the_plain_path(monkeypatch, capfd):
    """float16 compute is refused with one warning line (per process, not per layer); cpu_kernels plain and
    {attention: plain}, and attention_block_size > 0 choose the plain / blockwise path with no warning."""
    monkeypatch.setattr(build, "_WARNED", set())
    config = GPTLocalConfig(**dict(TINY, compute_dtype="float16"))
    model = GPTLocalForCausalLM(config)
    assert all(layer.attention.core is layer.attention.plain for layer in model.model.layers)
    err = capfd.readouterr().err
    assert err.count("CPU attention kernel off") == 1 and "float32" in err, err
    for cpu_kernels in ("plain", {"attention": "plain"}):
        plain = GPTLocalForCausalLM(GPTLocalConfig(**TINY, cpu_kernels=cpu_kernels)).model.layers[0]
        assert plain.attention.core is plain.attention.plain
    assert plain.input_layernorm.kernel is not None  # {attention: plain} leaves the other ops' kernels
    blockwise = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, attention_block_size=16))).model.layers[0].attention
    assert isinstance(blockwise.core, BlockwiseCore)
    assert "CPU attention kernel off" not in capfd.readouterr().err


# ---------------------------------------------------------------------------------------- the build cache
BUILD_SCRIPT = ("import sys, time; from mindformers_gptlocal.kernels.abi import build; "
                "path, reason = build.library(sys.argv[1]); print(reason, path, build._loads(path) if path else '')")


def _build_in_process(cache, count=1, env=None):
    """``count`` processes building into ``cache`` at once; their (reason, path, loads) lines."""
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_SCRIPT, str(cache)], env=source_env(**(env or {})),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(count)]
    lines = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        lines.append(out.strip().splitlines()[-1].split())
    return lines


def _seed_objects(library, generated, store):
    """The suite's own build's objects (the user's cache, the ``library`` fixture's) copied into ``store``, but the
    smallest source's: a build into a new cache then compiles that one source and links, as after a one-kernel
    change, instead of compiling every kernel again. Returns the object the build must compile."""
    generated.mkdir()
    for name, text in codegen.generated().items():
        (generated / name).write_text(text, encoding="utf-8")
    cxx = build.compiler()
    found, _ = build._objects(cxx, build._compiler_version(cxx), os.path.join(os.path.dirname(os.path.dirname(
        library)), build.OBJECTS), str(generated), build.onednn()[1])
    smallest = min(build.SOURCES, key=os.path.getsize)
    prefix = os.path.basename(smallest)[:-len(".cc")] + "-"
    store.mkdir(parents=True)
    for obj in found:  # copies, not links: the test spoils one object of its own store
        if not os.path.basename(obj).startswith(prefix):
            shutil.copyfile(obj, store / os.path.basename(obj))
    assert len(os.listdir(store)) == len(found) - 1
    return next(os.path.basename(obj) for obj in found if os.path.basename(obj).startswith(prefix))


def test_cache_concurrent_builds_reuse_and_stale_rebuild(tmp_path, library):
    """Two processes building at once both load a whole library (one builds, the other waits on the lock and
    finds it); a later lookup (this process's, past the per-process memo, as a new process looks) reuses it; a
    truncated library is rebuilt, linked from the objects the first build kept (none compiled again); nothing
    half-written is left. The first build compiles one source (the others' objects are the suite's own build's,
    ``_seed_objects``)."""
    cache = tmp_path / "cache"
    store = cache / build.OBJECTS
    compiled = _seed_objects(library, tmp_path / "generated", store)
    first = _build_in_process(cache, count=2)
    assert sorted(line[0] for line in first) == ["built", "cached"], first
    assert first[0][1] == first[1][1] and all(line[2] == "True" for line in first)
    path = first[0][1]
    stamp = os.stat(path).st_mtime_ns
    objects = {name: os.stat(store / name).st_mtime_ns for name in os.listdir(store)}
    assert len(objects) == len(build.SOURCES) + 1 and all(name.endswith(".o") for name in objects), objects
    assert compiled in objects
    cxx = build.compiler()
    assert list(build._find_or_build(str(cache), cxx)) == [path, "cached"]  # found without loading it: this
    assert os.stat(path).st_mtime_ns == stamp  # process never maps the file truncated next
    with open(path, "r+b") as handle:  # a crash mid-copy, a full disk: a file that does not load
        handle.truncate(1000)
    rebuilt = build._find_or_build(str(cache), cxx)
    assert list(rebuilt) == [path, "built"] and build._loads(path)
    assert {name: os.stat(store / name).st_mtime_ns for name in os.listdir(store)} == objects
    leftovers = [name for name in os.listdir(os.path.dirname(path))
                 if name not in (build.LIBRARY_NAME, build.LIBRARY_NAME + ".sha256", ".lock")]
    assert leftovers == []
    (store / sorted(objects)[0]).write_bytes(b"not an object")  # a kept object gone bad: no library, and the
    os.unlink(path)  # objects are dropped, so the next build compiles every source again
    assert build._find_or_build(str(cache), cxx)[1] != "built"
    assert os.listdir(store) == [] and not os.path.exists(path)


def test_an_object_is_keyed_by_its_own_source_and_what_all_share(tmp_path):
    """A kernel's object is found again by the hash of its source and of what every source is compiled with: another
    source text changes only its own key; another shared part (a header, the compiler, the flags) changes every key."""
    import hashlib
    one, two = tmp_path / "one.cc", tmp_path / "two.cc"
    one.write_text("int one() { return 1; }\n")
    two.write_text("int two() { return 2; }\n")
    common = hashlib.sha256(b"headers, compiler, flags")
    keys = {source: build._object_key(common, str(source)) for source in (one, two)}
    assert keys[one] != keys[two] and build._object_key(common, str(one)) == keys[one]
    two.write_text("int two() { return 3; }\n")
    assert build._object_key(common, str(one)) == keys[one] and build._object_key(common, str(two)) != keys[two]
    other = hashlib.sha256(b"headers, another compiler, flags")
    assert build._object_key(other, str(one)) != keys[one]


def test_cache_key_covers_source_mindspore_and_compiler(monkeypatch):
    """Another source, MindSpore version or compiler: another key, so another folder, so a fresh build."""
    source = build.source_bytes()
    key = build.cache_key("g++ 12.2.0", source)
    assert build.cache_key("g++ 12.2.0", source) == key
    assert build.cache_key("g++ 12.2.0", source + b"// changed\n") != key
    assert build.cache_key("g++ 13.1.0", source) != key
    monkeypatch.setattr(build, "mindspore_version", lambda: "2.7.3")
    assert build.cache_key("g++ 12.2.0", source) != key


def test_a_compile_error_is_reported_by_its_first_error_line(tmp_path):
    """A source that does not compile: the reason is g++'s first error line (file, line, message), not the caret
    line that ends its output."""
    source = tmp_path / "broken.cc"
    source.write_text("int f() {\n  return undeclared_name + 1;\n}\n", encoding="utf-8")
    reason = build._run("g++", ["g++", "-c", str(source), "-o", str(tmp_path / "broken.o")])
    assert reason.startswith("g++ failed: ") and "broken.cc:2:" in reason and "error:" in reason, reason
    assert "undeclared_name" in reason and not os.path.exists(tmp_path / "broken.o")
    assert build._run("g++", ["g++", "--version"]) is None


def test_missing_compiler_falls_back_with_one_warning(tmp_path, monkeypatch, capfd):
    """CXX naming no binary: no library, the model builds on the plain path, one warning line naming the cause
    and the fix."""
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-g++"))
    monkeypatch.setenv("GPTLOCAL_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_WARNED", set())
    path, reason = build.library()
    assert path is None and "no C++ compiler" in reason and "no-such-g++" in reason
    model = GPTLocalForCausalLM(GPTLocalConfig(**TINY))
    assert all(layer.attention.core is layer.attention.plain for layer in model.model.layers)
    warnings = [line for line in capfd.readouterr().err.splitlines() if "CPU attention kernel off" in line]
    assert len(warnings) == 1 and "set CXX" in warnings[0], warnings
    assert not os.path.exists(tmp_path / "cache")
