"""Test-only references and per-rank builders, kept out of the production Cells (issue 27).

- ``causal_bias``: the additive causal mask [1, 1, S, S] the attention takes, built in numpy.
- ``keep_reference``: numpy's keep mask of ``CounterDropout`` (``model/dropout.py``), from its formula.
- ``rank_block``: one tensor-parallel rank's part of a real ``GPTLocalBlock`` (local heads, key/value groups
  and intermediate columns; the row-parallel Linears return their partial sums without the bias, which
  belongs after the all-reduce) for the CPU proofs of tests/parallel/test_tensor_parallel.py, test_lora.py and
  test_dist_checkpoint.py. A parallel build never makes these: the ``shard`` strategies split the full Cells.
"""
import numpy as np
import mindspore as ms
from mindspore import nn, Tensor

from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model import GPTLocalBlock
from mindformers_gptlocal.model.attention import MASK_VALUE
from mindformers_gptlocal.model.dropout import (SITE_MULTIPLIERS, STEP_MULTIPLIERS, TABLE_SIZES, bit_probability,
                                                dropout_site)
from mindformers_gptlocal.model.layers import Linear, residual_init_std, to_mstype
from mindformers_gptlocal.parallel.sharding import check_divisible


def causal_bias(seq_length):
    """Additive causal mask [1, 1, S, S]: 0 where a token may attend, MASK_VALUE above the diagonal."""
    upper = np.triu(np.ones((seq_length, seq_length), dtype=np.float32), k=1)
    return Tensor((upper * MASK_VALUE)[None, None], ms.float32)


def keep_reference(shape, step, site, seed, p):
    """numpy: the keep mask ``CounterDropout`` applies; ``step`` an int or an array of steps (then the masks
    of all of them, [*steps.shape, *shape])."""
    rng = np.random.default_rng(seed)
    q = bit_probability(p)
    b1, b2 = ((rng.random(size) < q) for size in TABLE_SIZES)
    index = np.arange(int(np.prod(shape)), dtype=np.int64)
    (p1, p2), (m1, m2), (s1, s2) = TABLE_SIZES, STEP_MULTIPLIERS, SITE_MULTIPLIERS
    step = np.asarray(step, dtype=np.int64)[..., None]
    a = ((step % p1) * m1 + site * s1) % p1
    b = ((step % p2) * m2 + site * s2) % p2
    differ = b1[(index + a) % p1] != b2[(index + b) % p2]
    return (differ if p > 0.5 else ~differ).reshape(step.shape[:-1] + tuple(shape))


def rank_block(config, layer_number, mp, layer_spec=None):
    """One of ``mp`` tensor-parallel ranks' part of ``GPTLocalBlock(config, layer_number)``: the block with its
    Linears replaced by the rank's shapes (QKV and fc1/gate columns, proj and fc2 rows) and the attention's
    head counts set to the rank's. Refuses an ``mp`` that splits a head or a group (``check_divisible``).
    ``layer_spec``: the layer's spec (model/layer_spec.py), e.g. LoRALinears: the rank's Linears are of its classes."""
    check_divisible(config, mp)
    arch = config.arch
    layer_spec = layer_spec or {}
    kernels = KernelProvider.from_config(config)  # the provider a model of ``config`` hands its layers
    block = GPTLocalBlock(config, layer_number, layer_spec=layer_spec, kernels=kernels)
    params, compute = to_mstype(config.params_dtype), to_mstype(config.compute_dtype)
    hidden, std = arch.hidden_size, config.initializer_range

    def linear(path, inp, out, has_bias, init=std, partial=False):
        # a row-parallel part leaves its bias (skip_bias_add): it is added after the sum over ranks
        return layer_spec.get(path, Linear)(inp, out, init, params, compute, has_bias=has_bias, skip_bias_add=partial,
                                            kernels=kernels)
    attention = block.attention
    attention.num_heads = arch.num_attention_heads // mp
    attention.num_groups = arch.groups // mp
    attention.linear_qkv = linear("attention.linear_qkv", hidden,
                                  (attention.num_heads + 2 * attention.num_groups) * arch.head_dim, arch.qkv_bias)
    attention.linear_proj = linear("attention.linear_proj", attention.num_heads * arch.head_dim, hidden, arch.bias,
                                   residual_init_std(config), partial=True)
    mlp = block.mlp
    local = arch.inter // mp
    # with the CPU bias + GeLU kernel (model/gpt.py ParallelFeedForward) fc1 returns x W^T and the kernel adds fc1's bias
    mlp.linear_fc1 = linear("mlp.linear_fc1", hidden, local, arch.bias, partial=mlp.bias_gelu is not None)
    if arch.gated:
        mlp.linear_gate = linear("mlp.linear_gate", hidden, local, arch.bias)
    mlp.linear_fc2 = linear("mlp.linear_fc2", local, hidden, arch.bias, residual_init_std(config), partial=True)
    block.update_parameters_name()  # the new Linears' Parameters named by their paths in the block, as before
    return block


# --- the per-rank CPU proofs' shared pieces (test_tensor_parallel, test_lora, test_sharding_golden) ---
SMALL = dict(vocab_size=64, hidden_size=32, num_attention_heads=4, intermediate_size=64, num_hidden_layers=2,
             max_position_embeddings=16, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0,
             bos_token_id=0, eos_token_id=0, pad_token_id=0)


def randomised(cell, seed):
    """Random values in every parameter (LayerNorm ones and zero biases would hide layout mistakes)."""
    rng = np.random.default_rng(seed)
    for _, param in cell.parameters_and_names():
        param.set_data(Tensor(rng.normal(0, 0.3, param.shape).astype(np.float32)))
    return cell


def params_by_path(cell):
    return dict(cell.parameters_and_names())


class AllReduceParts(nn.Cell):
    """Stands in for a row-parallel sub-Cell across mp ranks: each rank's part runs on the same
    (replicated) input, the partial outputs are summed (the all-reduce), then the bias is added."""

    def __init__(self, parts, bias):
        super().__init__()
        self.parts = nn.CellList(parts)
        self.bias = bias

    def construct(self, hidden, *args, **kwargs):
        total = self.parts[0](hidden, *args, **kwargs)
        for part in self.parts[1:]:
            total = total + part(hidden, *args, **kwargs)
        if self.bias is None:  # add_bias_linear False
            return total
        return total + self.bias


def value_and_grads(block, weights, x, probe, bias, rotary=None):
    def loss(hidden):
        return (block(hidden, bias, None, None, None, None, None, rotary) * probe).sum()
    out = block(x, bias, None, None, None, None, None, rotary)
    _, (dx, dweights) = ms.value_and_grad(loss, grad_position=0, weights=weights)(x)
    return out.asnumpy(), dx.asnumpy(), [g.asnumpy() for g in dweights]


# --- what the tests comparing a fast path with the plain one share ---
class LossOf(nn.Cell):
    """The loss of a model called on ``inputs`` (the first of its training outputs), for ``value_and_grad``."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def construct(self, *inputs):
        return self.model(*inputs)[0]


def copy_weights(source, target, keep=()):
    """Every Parameter of ``target`` but those named in ``keep`` set to the value of ``source``'s of the same name."""
    values = dict(source.parameters_and_names())
    for name, param in target.parameters_and_names():
        if name not in keep:
            param.set_data(Tensor(values[name].asnumpy()))


def set_float_weights(model, weights):
    """``model``'s Parameters from ``weights`` (name -> a float model's float32 array): an int8 model's quantized as
    ``gptlocal quantize`` does (int8 rows and their scales), a bfloat16 Parameter's rounded; names ``weights`` lacks
    keep their value."""
    from mindformers_gptlocal.model.quantization import quantize_rows
    for name, param in model.parameters_and_names():
        if name.endswith("_scale"):
            param.set_data(Tensor(quantize_rows(weights[name[:-len("_scale")]])[1]))
        elif param.dtype == ms.int8:
            param.set_data(Tensor(quantize_rows(weights[name])[0]))
        elif name in weights:
            param.set_data(Tensor(weights[name], param.dtype))


def train_steps(model, batches, steps=3, learning_rate=1e-3):
    """Losses of ``steps`` AdamW steps (graph mode, ``batches`` taken in turn) and the first step's gradients by
    parameter name."""
    model.set_train(True)
    weights = model.trainable_params()
    grad_fn = ms.jit(ms.value_and_grad(LossOf(model), None, weights=weights))
    optimizer = nn.AdamWeightDecay(weights, learning_rate=learning_rate)
    losses, first = [], None
    for step in range(steps):
        loss, grads = grad_fn(*batches[step % len(batches)])
        if first is None:
            first = {p.name: g.asnumpy() for p, g in zip(weights, grads)}
        optimizer(grads)
        losses.append(float(loss.asnumpy()))
    return losses, first


def trains_like_plain(fast, plain, batches, learning_rate, reference):
    """A fast path's training against the plain path's (``train_steps`` each) and the float64 model's
    (``reference``: its losses and first-step gradients, ``gpt_float64_steps``): every first-step gradient and the
    losses with errors against it of the plain path's size (``assert_error_of_plain_size``), falling. Returns both
    first-step gradients by name."""
    losses, grads = train_steps(fast, batches, learning_rate=learning_rate)
    plain_losses, plain_grads = train_steps(plain, batches, learning_rate=learning_rate)
    exact_losses, exact_grads = reference
    assert sorted(exact_grads) == sorted(plain_grads) == sorted(grads)
    for name in plain_grads:
        assert_error_of_plain_size(grads[name], plain_grads[name], exact_grads[name], name)
    assert_error_of_plain_size(losses, plain_losses, exact_losses, "losses")
    assert losses[-1] < losses[0]  # it trains
    return grads, plain_grads


# --- rounding-error bounds: how far two computations of the same sums may part (issue 60) ---
# A fast path and the plain one compute the same sums in float32 in different orders and blockings: oneDNN's GEMM
# per ISA, AVX2 / AVX-512 reductions, our tiles. Neither order is the exact one, so their agreement is bounded by
# rounding analysis, not by a tolerance seen on one CPU: a sum of K terms computed in any order carries an error of at
# most gamma_K * sum |terms|, gamma_K = K u / (1 - K u) (Higham, Accuracy and Stability of Numerical Algorithms,
# 2nd ed., 3.1 and 3.5: dot products and matrix products in any order, blocked or not).
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "bfloat16": 2.0 ** -8}


def gamma(length, dtype="float32"):
    """gamma_K of ``dtype``'s unit roundoff u (float32 2^-24, bfloat16 2^-8) for sums of ``length`` terms."""
    ku = max(int(length), 1) * UNIT_ROUNDOFF[dtype]
    assert ku < 1, (length, dtype)
    return ku / (1 - ku)


def sum_error_bound(magnitude, length, dtype="float32", sides=2):
    """Elementwise bound on |a - b| for two evaluations of the same sums of at most ``length`` terms in any orders:
    ``sides`` (2: two rounded results; 1: one against an exact float64 one) times gamma_K times ``magnitude``, the sum
    of the terms' absolute values of each element (|A| @ |B| for A @ B; for a chain of products the same chain on
    absolute values, which bounds each stage's propagated error too)."""
    return sides * gamma(length, dtype) * np.asarray(magnitude, np.float64)


def assert_within_rounding(actual, expected, magnitude, length, dtype="float32", sides=2, name=""):
    """|actual - expected| <= ``sum_error_bound`` elementwise (float64 differences)."""
    bound = sum_error_bound(magnitude, length, dtype, sides)
    gap = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
    worst = np.unravel_index(int(np.argmax(gap - bound)), gap.shape) if gap.ndim else ()
    assert (gap <= bound).all(), (name, "gap", float(gap[worst]), "bound", float(bound[worst]), "at", worst)



def assert_kernel_and_plain_within_rounding(actual, expected, exact, magnitudes, lengths, names):
    """Each of ``actual`` (the kernel) and ``expected`` (MindSpore's ops) within float32's rounding of the float64
    ``exact`` (``assert_within_rounding``, sides 1): both compute the same sums in their own orders (per ISA), so
    each is held to the float64 value, neither to the other's rounding."""
    for name, got, want, precise, magnitude, length in zip(names, actual, expected, exact, magnitudes, lengths):
        assert_within_rounding(got, precise, magnitude, length, sides=1, name=name + " kernel vs float64")
        assert_within_rounding(want, precise, magnitude, length, sides=1, name=name + " MindSpore vs float64")

def assert_errors_of_one_size(fast, plain, reference, name="", length=1, factor=2.0):
    """The fast path's error against a more precise ``reference`` within ``factor`` of the plain path's either way,
    in the Frobenius norm, give or take float32's rounding of the reference itself (gamma_K of float32 times its
    norm): for two computations of one formula whose dominant rounding (bfloat16's operands) is the same on both
    sides, so their errors are of one size whatever order each sums in (a fast path that skips the rounding fails
    as one that adds error). The norm, not the largest element: one element's error is a draw, the norm over a
    tensor is steady (its ratio between two such draws stays near 1). Returns the plain path's error."""
    fast, plain, reference = (np.asarray(a, np.float64) for a in (fast, plain, reference))
    error, plain_error = np.linalg.norm(fast - reference), np.linalg.norm(plain - reference)
    floor = gamma(length) * np.linalg.norm(reference)
    assert plain_error / factor - floor <= error <= factor * plain_error + floor, (
        name, float(error), float(plain_error), float(floor))
    return float(plain_error)


def int8_linear_reference(x, quantized, scale, bias=None):
    """The int8 Linear's scheme (model/quantization.py) in numpy, the way the kernel computes it: x [T, K] float32
    quantized per row (max |x| / 127; x * (127 / max) rounded to nearest even, clipped to +-127; a zero row gives
    zeros), the int8 product exact in int64, then acc * (x_scale * scale) (+ bias), all in float32."""
    x = np.asarray(x, np.float32)
    amax = np.max(np.abs(x), axis=1) if x.shape[1] else np.zeros(x.shape[0], np.float32)
    inverse = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, np.float32(1)), np.float32(0))
    inverse = inverse.astype(np.float32)
    xq = np.clip(np.rint(x * inverse[:, None]), -127, 127).astype(np.int64)
    acc = (xq @ quantized.astype(np.int64).T).astype(np.float32)
    x_scale = (amax / np.float32(127)).astype(np.float32)
    y = acc * (x_scale[:, None] * np.asarray(scale, np.float32)[None, :])
    return y if bias is None else (y + np.asarray(bias, np.float32)[None, :]).astype(np.float32)


# --- elementwise functions' rounding (issue 60): what their float32 evaluations' errors scale with ---
# For a fixed chain of m roundings (no sum of many terms) the same rule holds with K = m, the magnitude then being
# each element's chain on absolute values with each intermediate's condition folded in (Higham 3.1; the exp of a
# rounded argument z carries z's error times |z|). The counts below are counted on the kernels' common.h forms (the
# plain path's model/layers.py TanhGeLU / SiLU are the same sigmoid forms), exp taken as 4 roundings (common.h
# exp_neg is ~2 ulp), every propagated term bounded by the magnitude it is folded into.
GELU_Z = {"tanh": (1.5957691216057308, 0.044715), "quick": (1.702, 0.0), "silu": (1.0, 0.0)}  # z = a (u + k u^3)
UNDERFLOW = 2.0 ** -100  # exp's flush to 0 below float32's normal range (2^-126), over any gamma_K here: s's floor
GELU_ROUNDINGS = 8  # y = u * sigmoid(z): z 5 (+3 for u's own rounding, u = x + b), the sigmoid 4 (exp, 1 +, /), * u 1
GELU_GRAD_ROUNDINGS = 26  # s + u s (1 - s) z': the sigmoid's error times (1 + |u z'|) 12, the products and z' 10,
# * dy 1, u's rounding times u gelu''(u) (|u gelu''| <= 7 times the magnitude below) ... counted as 26 in all
# MindSpore's Sigmoid (the plain path's) is an approximation, not a rounding of exp: relative error measured on a
# 2e5-point grid of [-70, 70] at most 39 + 4.3 |z| units of float32's u for z < 0 (its exp's, growing with |z|),
# 23 for z > 0; allowed (a + b |z| (1 - s)) u, (a, b) = (48, 5), on its side
MINDSPORE_SIGMOID_ULPS = (48.0, 5.0)
NORM_ROUNDINGS = 16  # a norm's roundings outside its row's sums: mean, centring, variance, + eps, sqrt, 1/, * rstd,
# * gamma, + beta (9); the backward's g = dy gamma, g xhat, the two means, the products, differences and * rstd (7)


def gelu_float64(u, form, sigmoid_ulps=(0.0, 0.0)):
    """(gelu(u), gelu'(u), bound of gelu's, bound of gelu''s float32 error) in float64 for the sigmoid forms (and
    SiLU, u sigmoid(u), as the form "silu"), the
    bounds in units of gamma_1 (pass them with length 1): GELU_ROUNDINGS times |u| s (1 + (1 - s) |z|) and
    GELU_GRAD_ROUNDINGS times s (1 + (1 - s) |z|) (1 + |u z'|) (z's error moves s by s (1 - s) dz; (1 - s) of a
    rounded s carries s's error; s at least UNDERFLOW), plus ``sigmoid_ulps`` (a, b): a sigmoid whose own relative
    error is (a + b |z| (1 - s)) u beyond the 4 counted, carried the same way."""
    a, k = GELU_Z[form]
    u = np.asarray(u, np.float64)
    z, zabs, slope = a * (u + k * u ** 3), a * (np.abs(u) + k * np.abs(u) ** 3), a * (1 + 3 * k * u * u)
    e = np.exp(-np.abs(z))
    s = np.where(z >= 0, 1 / (1 + e), e / (1 + e))  # the sigmoid without overflow
    condition = s * (1 + (1 - s) * zabs) + UNDERFLOW
    spread = 1 + np.abs(u * slope)
    excess = s * (sigmoid_ulps[0] + sigmoid_ulps[1] * zabs * (1 - s))
    return (u * s, s + u * s * (1 - s) * slope, np.abs(u) * (GELU_ROUNDINGS * condition + excess),
            (GELU_GRAD_ROUNDINGS * condition + excess) * spread)


def gelu_second_float64(u, form):
    """|gelu''(u)| in float64 for the sigmoid forms: s (1 - s) (2 |z'| + |u| z'^2 |1 - 2 s| + |u z''|), how far an
    error in u moves gelu'(u) (to first order)."""
    a, k = GELU_Z[form]
    u = np.asarray(u, np.float64)
    z, slope, curve = a * (u + k * u ** 3), a * (1 + 3 * k * u * u), a * 6 * k * u
    e = np.exp(-np.abs(z))
    s = np.where(z >= 0, 1 / (1 + e), e / (1 + e))
    return s * (1 - s) * (2 * np.abs(slope) + np.abs(u) * slope ** 2 * np.abs(1 - 2 * s) + np.abs(u * curve))


def round_bf16(a):
    """float32 -> nearest bfloat16 (ties to even), as float32 (bit arithmetic; common.h bf16_bits)."""
    bits = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
    return bits.astype(np.uint32).view(np.float32)


def bf16_spread(value, error):
    """How far apart bfloat16 roundings of any two values within ``error`` of ``value`` can be (0 where the whole
    interval rounds to one bfloat16, else the distance of its ends' roundings, which are monotone): an operand
    computed in float32 then rounded to bfloat16 is known to within this, whatever order its sums ran in."""
    value, error = np.asarray(value, np.float64), np.asarray(error, np.float64)
    widen = 2.0 ** -22 * np.abs(value)  # the float64 -> float32 step's own rounding of the ends
    low = round_bf16((value - error - widen).astype(np.float32)).astype(np.float64)
    high = round_bf16((value + error + widen).astype(np.float32)).astype(np.float64)
    return high - low


# --- a float64 reference of the tests' tiny models (issue 60): the float32 paths' errors measured, not guessed ---
# A whole model cannot be bounded elementwise from outside, so a fast path is held to the float64 model of the same
# weights by the plain path's own error against it: the two are float32 evaluations of one model in their own orders.
def _gpt_float64(p, ids, config, lora_scale, step=None, ends=None):
    """torch float64 logits [B, S, V] of GPTLocalForCausalLM from ``p`` (name -> tensor), the layouts the tests
    build: learned positions or rope (rotate_half on the first rotary_dim channels, float64 angles), pre-LayerNorm
    or RMSNorm blocks, fused QKV [S, G, group + 2, D] (each group's query heads, its key, its value), tanh or quick
    GeLU or SwiGLU (silu(gate) * fc1), LoRA where a Linear has ``lora_a`` / ``lora_b`` (``lora_scale`` = alpha /
    rank), the word embeddings or ``output_layer`` as the head; NeoX's parallel residual,
    scale_attn_by_inverse_layer_idx; the counter dropout of forward ``step`` (``keep_reference``'s masks; None:
    none); packed rows where ``ends`` [B, k] (actual_seq_len) is given (each document attends to itself, its
    positions from 0)."""
    import torch
    fn = torch.nn.functional
    arch, eps = config.arch, config.layernorm_epsilon
    heads, groups, dim, width = arch.num_attention_heads, arch.groups, arch.head_dim, arch.hidden_size
    size = heads // groups
    layers = sorted({int(name.split(".")[2]) for name in p if name.startswith("model.layers.")})
    act = {"gelu_new": lambda u: fn.gelu(u, approximate="tanh"), "quick_gelu": lambda u: u * torch.sigmoid(1.702 * u)}

    def linear(path, x):
        y = fn.linear(x, p[path + ".weight"], p.get(path + ".bias"))
        if path + ".lora_a" in p:
            y = y + lora_scale * fn.linear(fn.linear(x, p[path + ".lora_a"]), p[path + ".lora_b"])
        return y

    def norm(path, h):
        if arch.rmsnorm:
            return h * torch.rsqrt((h * h).mean(-1, keepdim=True) + eps) * p[path + ".weight"]
        return fn.layer_norm(h, (width,), p[path + ".weight"], p[path + ".bias"], eps)

    batch, seq = ids.shape
    index = torch.arange(seq)
    if ends is None:
        document, positions = torch.zeros(batch, seq, dtype=torch.int64), index.repeat(batch, 1)
    else:
        ends = _int64(ends)
        document = (ends[:, None, :] <= index[None, :, None]).sum(-1)  # [B, S]: the documents ended before t
        starts = torch.cat((torch.zeros(batch, 1, dtype=torch.int64), ends), 1).gather(1, document)
        positions = index[None, :] - starts
    mask = (index[None, :, None] < index[None, None, :]) | (document[:, :, None] != document[:, None, :])
    mask = mask[:, None]  # [B, 1, S, S]: True where a token may not attend
    half = arch.rotary_dim // 2
    angles = positions[..., None].double() * arch.rotary_base ** (
        -torch.arange(0, arch.rotary_dim, 2, dtype=torch.float64) / arch.rotary_dim)
    cos, sin = (f(torch.cat((angles, angles), -1))[:, None] for f in (torch.cos, torch.sin))  # [B, 1, S, rotary]

    def rope(x):
        if not arch.rope:
            return x
        part = x[..., :arch.rotary_dim]
        rotated = torch.cat((-part[..., half:], part[..., :half]), -1)
        return torch.cat((part * cos + rotated * sin, x[..., arch.rotary_dim:]), -1)

    def drop(x, rate, layer=0, part="embedding"):  # CounterDropout's mask of forward ``step`` (None: eval)
        if step is None or not rate:
            return x
        keep = keep_reference(tuple(x.shape), step, dropout_site(layer, part), config.dropout_seed, rate)
        return x * torch.tensor(keep.astype(np.float64)) / (1.0 - rate)

    h = p["model.embedding.word_embeddings"][ids]
    if arch.learned_positions:
        h = h + p["model.embedding.position_embeddings"][positions]
    h = drop(h, config.embedding_dropout)
    for i in layers:
        at, number = f"model.layers.{i}.", i + 1
        qkv = linear(at + "attention.linear_qkv", norm(at + "input_layernorm", h))
        qkv = qkv.reshape(batch, seq, groups, size + 2, dim)
        q = rope(qkv[:, :, :, :size].reshape(batch, seq, heads, dim).transpose(1, 2))
        k, v = (qkv[:, :, :, j].transpose(1, 2).repeat_interleave(size, 1) for j in (size, size + 1))
        scale = dim ** -0.5 / (number if config.scale_attn_by_inverse_layer_idx else 1)
        scores = (q @ rope(k).transpose(-1, -2) * scale).masked_fill(mask, float("-inf"))
        probs = drop(torch.softmax(scores, -1), config.attention_dropout, number, "attention_probs")
        context = (probs @ v).transpose(1, 2).reshape(batch, seq, width)
        attended = drop(linear(at + "attention.linear_proj", context), config.hidden_dropout, number,
                        "attention_output")
        h, x = (h, norm(at + "post_attention_layernorm", h)) if arch.parallel_residual else (
            h + attended, norm(at + "post_attention_layernorm", h + attended))
        if arch.gated:
            inner = fn.silu(linear(at + "mlp.linear_gate", x)) * linear(at + "mlp.linear_fc1", x)
        else:
            inner = act[config.hidden_act](linear(at + "mlp.linear_fc1", x))
        h = h + (attended if arch.parallel_residual else 0) + drop(linear(at + "mlp.linear_fc2", inner),
                                                                    config.hidden_dropout, number, "mlp_output")
    head = p["output_layer.weight"] if arch.untied else p["model.embedding.word_embeddings"]
    return norm("model.final_layernorm", h) @ head.T


def _int64(tensor):
    import torch
    return torch.tensor(np.asarray(tensor.asnumpy() if hasattr(tensor, "asnumpy") else tensor, np.int64))


def float64_weights(model):
    """name (as ``parameters_and_names`` gives it before ``train_steps`` wraps the model) -> float64 array of every
    float32 Parameter (not the dropout counter)."""
    return {name: param.asnumpy().astype(np.float64) for name, param in model.parameters_and_names()
            if param.dtype == ms.float32}


def gpt_float64_logits(weights, ids, config, lora_scale=1.0):
    """The float64 logits [B, S, V] of the tiny model (``_gpt_float64``) from ``weights`` (float64_weights)."""
    import torch
    p = {name: torch.tensor(value) for name, value in weights.items()}
    return _gpt_float64(p, _int64(ids), config, lora_scale).numpy()


def gpt_float64_steps(weights, batch, config, steps=1, learning_rate=0.0, lora_scale=1.0, trainable=None,
                      dropout=False, eval_ids=None, ends=None):
    """``train_steps`` in float64 (torch autograd) for the tiny model (``_gpt_float64``, mean token cross-entropy)
    with MindSpore's AdamWeightDecay (no bias correction, eps 1e-6, no decay) from ``weights`` (float64_weights) on
    ``batch`` (ids, labels): the ``steps`` losses and the first step's gradients of ``trainable`` (names; every
    weight if None), named as ``train_steps`` names them (its LossOf wrapper's ``model.`` prefix). ``dropout``: step
    k's forward draws counter k's masks. ``eval_ids``: then also the logits of ``eval_ids`` after each step.
    ``ends``: packed rows (actual_seq_len)."""
    import torch
    p = {name: torch.tensor(value, requires_grad=True) for name, value in weights.items()}
    trainable = list(p) if trainable is None else list(trainable)
    ids, labels = (_int64(t) for t in batch)
    moments = {name: (torch.zeros_like(p[name]), torch.zeros_like(p[name])) for name in trainable}
    losses, first, logits = [], None, []
    for step in range(steps):
        loss = _loss(p, ids, labels, config, lora_scale, step if dropout else None, ends)
        grads = torch.autograd.grad(loss, [p[name] for name in trainable])
        losses.append(loss.item())
        if first is None:
            first = {"model." + name: g.numpy() for name, g in zip(trainable, grads)}
        with torch.no_grad():
            for name, g in zip(trainable, grads):
                m, v = moments[name]
                m.mul_(0.9).add_(0.1 * g)
                v.mul_(0.999).add_(0.001 * g * g)
                p[name] -= learning_rate * m / (1e-6 + v.sqrt())
            if eval_ids is not None:
                logits.append(_gpt_float64(p, _int64(eval_ids), config, lora_scale).numpy())
    return (losses, first) if eval_ids is None else (losses, first, logits)


def _loss(p, ids, labels, config, lora_scale=1.0, step=None, ends=None):
    import torch
    logits = _gpt_float64(p, ids, config, lora_scale, step, ends)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def gpt_float64_grads(weights, config, terms, trainable):
    """The float64 loss sum(c * loss(ids[:, :-1] -> ids[:, 1:], dropout step, packed ends)) over ``terms`` (c, ids
    [B, S + 1], step or None, ends or None) and its gradients of ``trainable`` named as ``train_steps`` names them."""
    import torch
    p = {name: torch.tensor(value, requires_grad=True) for name, value in weights.items()}
    total = 0.0
    for coefficient, ids, step, ends in terms:
        ids = _int64(ids)
        total = total + coefficient * _loss(p, ids[:, :-1], ids[:, 1:], config, step=step, ends=ends)
    grads = torch.autograd.grad(total, [p[name] for name in trainable])
    return total.item(), {"model." + name: g.numpy() for name, g in zip(trainable, grads)}


def assert_error_of_plain_size(fast, plain, reference, name="", factor=8.0, floor=4.0):
    """max |fast - reference| <= ``factor`` max |plain - reference| + ``floor`` u max |reference| (float32's u): a
    fast path's error against the float64 model of the same weights of the plain path's size (two float32
    evaluations of one model in their own orders: their largest errors are two draws, 0.5-1.8x apart on AVX2 here,
    8x covers any other order's; the floor a plain path that happens to land near the reference). The plain path
    within sqrt(u) of the values first (measured 2-42 u): a reference of another model would make the bound vacuous.
    Returns the plain path's largest error."""
    fast, plain, reference = (np.asarray(a, np.float64) for a in (fast, plain, reference))
    error, plain_error = np.abs(fast - reference).max(), np.abs(plain - reference).max()
    scale = np.abs(reference).max()
    allowed = factor * plain_error + floor * UNIT_ROUNDOFF["float32"] * scale
    assert plain_error <= UNIT_ROUNDOFF["float32"] ** 0.5 * scale, (
        name, "the reference is another model: plain's error", float(plain_error), "of", float(scale))
    assert error <= allowed, (name, "error", float(error), "plain's", float(plain_error), "allowed", float(allowed))
    return float(plain_error)
