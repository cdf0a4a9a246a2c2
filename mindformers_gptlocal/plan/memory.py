"""Per-device parameter counts, training memory and communication of a gpt_local layout: arithmetic only.

Parameter counts come from the parameter table (``model/params.py``: every weight's shape and how
it splits under tensor parallel ``t`` = model_parallel: QKV and fc1 column-parallel, weight and bias
split; the output projection and fc2 row-parallel, weight split, bias whole; LayerNorms whole; the
token embedding's vocabulary split only when ``vocab_emb_dp`` is False). Activations follow what
``model/gpt.py`` computes. The layer choices (``model/arch.py`` ``Arch``: GQA, SwiGLU, RMSNorm, biases,
rope, untied head) reach the counts through the table; SwiGLU adds its gate's activations below.

Memory terms (bytes per device), each the state that lives through a training step:

* weights: parameters in ``params_dtype``.
* gradients: one per parameter, in ``params_dtype`` (MindSpore's grads take the parameter dtype); with
  ``pet_config`` (LoRA, adapters) only the trainable ones have gradients and moments (``stage_pet_params``).
* optimizer: MindFormers' AdamW (and GPTLocalAdamW, its fused form) keeps two fp32 moments (``adam_m``, ``adam_v``) per parameter,
  whatever the parameter dtype. It keeps no separate fp32 master copy: with fp32 parameters the
  weights are the master; with bf16/fp16 ones it updates in fp32 on the fly and casts back. With
  ``parallel.enable_parallel_optimizer`` the moments are split over the data-parallel ranks.
* activations: what the backward pass needs from one micro-batch (``activation_bytes``), times the
  micro-batches in flight on that stage under 1F1B (stages - stage index, at most micro_batch_num).
  Full recompute keeps only each layer's input, plus one layer's activations being recomputed.

On Ascend these analytic numbers are the estimate (plus the runtime's workspace, which
``max_device_memory`` caps); they are not measured on a card here. On CPU the measured peak RSS
of a MindFormers training run holds much more; ``cpu_peak_rss`` adds a measured runtime term and
measured factors (below), the state one per optimizer type.
"""
from ..peft import is_pet_name, read as read_pet
from ..model.params import POSITION_EMBEDDINGS, WORD_EMBEDDINGS, dims, layer_of, table_of_dims
from ..parallel.layout import Layout

BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ADAM_MOMENT_BYTES = 8  # two fp32 moments

# CPU (device_target CPU) terms, measured with MindSpore 2.7.2 + MindFormers 1.8.0 through
# `gptlocal run` (GPTLocalTrainOneStepCell with grad clipping, graph mode, fp32, seq 256, 3 steps)
# on a 2-core x86 machine; `python benchmarks/memory.py rss-fit measure` runs them (the runs are
# in benchmarks/cpu_rss_runs.jsonl; peak RSS = the run's own VmHWM) and fits
#   peak RSS = RUNTIME_OVERHEAD_CPU + CPU_STATE_FACTOR[optimizer.type] * (weights + grads + moments)
#              + CPU_ACTIVATION_FACTOR * (activations - head) + CPU_HEAD_FACTOR * head activations
# by least squares to 9 runs, 7 shapes with GPTLocalAdamW and 2 with AdamW; the held-out shape
# (GPT-2 small with vocab 8192, batch 2x256) is in neither fit. Peak RSS, MB measured -> fitted
# (GPTLocalAdamW | AdamW), from `python benchmarks/memory.py rss-fit fit benchmarks/cpu_rss_runs.jsonl
# --held-out small_v8192` (runs of 2026-12-01, with the CPU attention, LayerNorm and bias + GeLU kernels,
# the step cell's malloc_trim after its compile and no PyTorch in MindFormers' process; measured on a busy
# machine, which changes time, not bytes):
#   2 layers x 64 wide, vocab 512, batch 4x256       659 ->  720     |   (not run)
#   tiny (4 x 256, vocab 8192), batch 4x256          997 ->  992     | 1187 -> 1171
#   tiny, batch 8x256                               1228 -> 1206     |   (not run)
#   tiny with vocab 50257, batch 4x256              1761 -> 1744     |   (not run)
#   GPT-2 small (124M), batch 2x256                 3430 -> 3530     | 7712 -> 7713
#   GPT-2 small, batch 1x256                        3212 -> 3132     |   (not run)
#   GPT-2 small with vocab 8192, batch 4x256        3242 -> 3219     |   (not run)
#   held out: GPT-2 small, vocab 8192, batch 2x256  2697 -> 2711 (1.005) |   (not run)
# The fit before (runs of 2026-11-30, before the kernels, with PyTorch loaded through tensorboardX and no
# malloc_trim) gave runtime 958 MB, GPTLocalAdamW 1.05x, AdamW 3.21x, activations 2.60x, head 0.99x; its
# estimates were 22-39% above today's peaks (tiny 1,383 vs 997 MB). Repeated runs differ by ~1%.
# One term per line below; the factors multiply this module's analytic byte counts.
# RUNTIME_OVERHEAD_CPU (690 MB): what is there with (almost) no model: the Python process with
#   MindSpore and MindFormers imported, the compiled graph, the dataset pipeline, MindSpore's CPU
#   memory pool.
# CPU_STATE_FACTOR, per ``optimizer.type``: weights + grads + two fp32 moments are 16 bytes per fp32
#   parameter. GPTLocalAdamW (optim.py, one in-place kernel per parameter) holds them about once
#   (1.08x, 17 bytes per parameter). MindFormers' AdamW writes the update as ~10 element-wise ops per
#   parameter, each with a parameter-sized fp32 temporary; its peak holds 3.28x (52 bytes per
#   parameter). An optimizer not measured here gets AdamW's factor (``cpu_state_factor``), the conservative
#   one.
# CPU_ACTIVATION_FACTOR (1.24x): the layers' and the embedding's saved activations
#   (``layer_activation_bytes``, ``embedding_activation_bytes``) grow peak RSS by 1.24x their analytic
#   count (2.6x before the CPU kernels, whose backward keeps only its inputs: no [B, N, S, S] attention
#   probabilities, no GeLU or LayerNorm intermediates; 4.8x before the explicit broadcasts).
# CPU_HEAD_FACTOR (0.88x): the head's four fp32 [tokens, vocab] buffers (``head_activation_bytes``)
#   are there a little less than once; one activation factor for both fits the runs worse, hence two terms.
RUNTIME_OVERHEAD_CPU = 690 * 2 ** 20
CPU_STATE_FACTOR = {"GPTLocalAdamW": 1.08, "AdamW": 3.28}
CPU_CONSERVATIVE_OPTIMIZER = "AdamW"
CPU_ACTIVATION_FACTOR = 1.24
CPU_HEAD_FACTOR = 0.88


def shape_of(model_config):
    """The sizes the arithmetic needs (``params.dims``, GPTLocalConfig's defaults for absent keys) and dtypes."""
    get = model_config.get
    s = dims(model_config)
    s.update(
        seq=get("seq_length", 1024),
        params_dtype=str(get("params_dtype", "float32")), compute_dtype=str(get("compute_dtype", "float32")),
        ln_dtype=str(get("layernorm_compute_dtype", "float32")),
        softmax_dtype=str(get("softmax_compute_dtype", "float32")),
        hidden_dropout=float(get("hidden_dropout", 0.1)), attention_dropout=float(get("attention_dropout", 0.1)),
        tied=not s["arch"].untied, flash=bool(get("use_flash_attention", False)),
        pet_config=get("pet_config") or None)
    return s


def _rank_sizes(s, t, vocab_parallel):
    """Parameters one tensor-parallel rank holds, by part, from the parameter table of a one-layer model of
    these sizes: one layer, the token table, the position table, the final norm."""
    table = table_of_dims(dict(s, layers=1), Layout(mp=t, vocab_emb_dp=not vocab_parallel))
    return dict(layer=sum(spec.rank_size(t) for name, spec in table.items() if layer_of(name) is not None),
                words=table[WORD_EMBEDDINGS].rank_size(t),
                positions=table[POSITION_EMBEDDINGS].rank_size(t) if POSITION_EMBEDDINGS in table else 0,  # rope: none
                final_norm=sum(spec.rank_size(t) for name, spec in table.items()
                               if name.startswith("model.final_layernorm.")))


def layer_params(s, t=1):
    """Parameters of one decoder layer held by one tensor-parallel rank."""
    return _rank_sizes(s, t, False)["layer"]


def stage_params(s, layer_counts, t=1, vocab_parallel=False):
    """Per stage: dict of parameter counts by part. The tied head: with one stage the head reuses the
    embedding (counted once); with several, the last stage holds its own copy of the token
    embedding (MindSpore gives a parameter shared across stages a copy on each stage that uses it
    and keeps the copies equal by all-reducing their gradients), so it is counted there again."""
    sizes = _rank_sizes(s, t, vocab_parallel)
    stages = []
    last = len(layer_counts) - 1
    for index, count in enumerate(layer_counts):
        parts = {"layers": count * sizes["layer"]}
        if index == 0:
            parts["embedding"] = sizes["words"] + sizes["positions"]
        if index == last:
            parts["final_norm"] = sizes["final_norm"]
            if last > 0 and s["tied"]:
                parts["head_copy"] = sizes["words"]
        if not s["tied"] and index == last:
            parts["head"] = sizes["words"]
        stages.append(parts)
    spec = read_pet(s.get("pet_config"), s["layers"])
    for parts, (adapters, _) in zip(stages, stage_pet_params(s, layer_counts, t, vocab_parallel) or ()):
        parts[spec.plan_part] = adapters  # LoRA / bottleneck adapters of the stage's layers, or the prefix
    return stages


def stage_pet_params(s, layer_counts, t=1, vocab_parallel=False):
    """With ``pet_config``: per stage (the PEFT method's parameters, trainable parameters) one tensor-parallel
    rank holds, from the full parameter table and the method's freeze (only trainable parameters get gradients
    and optimizer moments); None without pet_config. LoRA / bottleneck adapters: those of the stage's layers;
    prefix tuning: the prefix tensors, replicated, on every stage (each stage's layers read their rows), the only
    trainable parameters (the base is frozen)."""
    spec = read_pet(s.get("pet_config"), s["layers"])
    if spec is None:
        return None
    table = table_of_dims(s, Layout(mp=t, vocab_emb_dp=not vocab_parallel), spec)
    ends = [sum(layer_counts[:i + 1]) for i in range(len(layer_counts))]
    last = len(layer_counts) - 1
    out = []
    for index, end in enumerate(ends):
        start = end - layer_counts[index]

        def here(name, index=index, start=start, end=end):
            layer = layer_of(name)
            if layer is not None:
                return start <= layer < end
            if is_pet_name(name):  # the prefix: on every stage (each stage's layers read its rows)
                return True
            return index == (0 if name.startswith("model.embedding.") else last)
        names = [name for name in table if here(name)]
        adapters = sum(table[n].rank_size(t) for n in names if is_pet_name(n))
        trainable = sum(table[n].rank_size(t) for n in names if not spec.is_frozen(n))
        out.append((adapters, trainable))
    return out


def layer_activation_bytes(s, batch, t=1, seq_parallel=False, recompute="none", flash=False):
    """Bytes one layer keeps from one micro-batch of ``batch`` sequences for the backward pass.

    Counted from ``GPTLocalBlock.construct``: the LayerNorm inputs (in layernorm dtype) and outputs,
    the QKV projection's input and its Q, K, V, the softmax output (softmax dtype) and its cast to
    the compute dtype when they differ, dropout masks when dropout > 0, the attention context, the
    fc1 output and the activation's output. Under tensor parallel the head/MLP parts are 1/t;
    sequence parallel also splits the LayerNorm/residual parts. ``flash`` (Ascend's fused attention)
    keeps no [seq, seq] scores, only two fp32 softmax statistics per query. ``recompute``: 'full' keeps only the
    layer input; 'selective' drops what MindFormers-style selective recompute rebuilds (the
    softmax-to-compute cast, the attention-dropout output and mask, the activation output).
    """
    c, ln, sm = BYTES[s["compute_dtype"]], BYTES[s["ln_dtype"]], BYTES[s["softmax_dtype"]]
    tokens = batch * s["seq"]
    h, i, a = s["hidden"], s["inter"], s["heads"]
    split = t if seq_parallel else 1
    if recompute == "full":
        return tokens * h * c // split
    scores = batch * a * s["seq"] * s["seq"] // t
    norm_part = tokens * h * (2 * ln + 2 * c) // split          # two LayerNorms: input and output
    attn = tokens * h * (3 * c + c) // t                          # Q, K, V and the context
    mlp = tokens * i * c // t                                     # fc1 output (activation input)
    if recompute != "selective":
        mlp += tokens * i * c // t                                # activation output (fc2 input)
    if s["arch"].gated:  # SwiGLU: the gate's output and its silu too (the product is the fc2 input above)
        mlp += 2 * tokens * i * c // t
    drop = 2 * tokens * h // split if s["hidden_dropout"] > 0 else 0   # two residual dropout masks
    if flash:
        attn += batch * a * s["seq"] * 8 // t                     # softmax max and sum, fp32
    else:
        attn += scores * sm                                       # softmax output
        if recompute != "selective" and sm != c:
            attn += scores * c                                    # probs cast to compute dtype
        if recompute != "selective" and s["attention_dropout"] > 0:
            attn += scores * (1 + c)                              # mask and dropped probs
    return norm_part + attn + mlp + drop


def kv_cache_bytes(s, batch, length, t=1):
    """Bytes of the decode KV cache (``model/kv_cache.py``): keys and values of every layer, [batch,
    num_query_groups, length, head_dim] each, in the compute dtype; grouped-query attention shrinks it by
    heads / num_query_groups. ``t``: per tensor-parallel rank (whole groups per rank)."""
    head_dim = s["hidden"] // s["heads"]
    return 2 * s["layers"] * batch * s["arch"].groups * length * head_dim * BYTES[s["compute_dtype"]] // t


def head_activation_bytes(s, batch, t=1, vocab_parallel=False):
    """Bytes of the tied head and loss for one micro-batch: the final LayerNorm's input/output,
    and four fp32 [tokens, vocab] buffers alive at the start of the backward pass: the logits, the
    log-softmax output kept for its backward, the dense gradient GatherD scatters into, and the
    gradient of the logits (the head's ``ops.cast(..., float32)`` makes all of them fp32)."""
    tokens = batch * s["seq"]
    vocab = s["vocab"] // (t if vocab_parallel else 1)
    norm = tokens * s["hidden"] * (BYTES[s["ln_dtype"]] + BYTES[s["compute_dtype"]])
    return norm + 4 * tokens * vocab * 4


def embedding_activation_bytes(s, batch):
    """The embedding output (words + positions, in the compute dtype) for one micro-batch."""
    return batch * s["seq"] * s["hidden"] * BYTES[s["compute_dtype"]]


def stage_activation_bytes(s, batch, layers, first, last, t=1, seq_parallel=False, recompute="none",
                           vocab_parallel=False, flash=False):
    """Activations of one micro-batch on a stage holding ``layers`` layers.

    ``recompute``: 'none', 'selective', 'full', or an int = layers of this stage recomputed in full.
    With full recompute the layer being recomputed in backward holds its full activations once.
    """
    if isinstance(recompute, bool):
        recompute = "full" if recompute else "none"
    full_layers = layers if recompute == "full" else (recompute if isinstance(recompute, int) else 0)
    full_layers = min(full_layers, layers)
    rest_mode = "selective" if recompute == "selective" else "none"
    total = full_layers * layer_activation_bytes(s, batch, t, seq_parallel, "full", flash)
    total += (layers - full_layers) * layer_activation_bytes(s, batch, t, seq_parallel, rest_mode, flash)
    if full_layers:
        total += layer_activation_bytes(s, batch, t, seq_parallel, "none", flash)
    if first:
        total += embedding_activation_bytes(s, batch)
    if last:
        total += head_activation_bytes(s, batch, t, vocab_parallel)
    return total


def in_flight_micro_batches(stage, stages, micro_batch_num):
    """1F1B: stage k holds forward activations of (stages - k) micro-batches at its peak."""
    return max(1, min(stages - stage, micro_batch_num))


def cpu_state_factor(optimizer_type):
    """(factor, optimizer whose measured factor it is) for ``optimizer.type``; an optimizer not measured
    here gets the AdamW factor, the larger one."""
    name = str(optimizer_type or "")
    if name in CPU_STATE_FACTOR:
        return CPU_STATE_FACTOR[name], name
    return CPU_STATE_FACTOR[CPU_CONSERVATIVE_OPTIMIZER], CPU_CONSERVATIVE_OPTIMIZER


def cpu_peak_rss(state_bytes, activation_bytes, head_bytes, optimizer_type="GPTLocalAdamW"):
    """Peak RSS of a single-process CPU training run:
    runtime + state factor * states + activation factor * (activations - head) + head factor * head.

    ``state_bytes``: weights + gradients + optimizer moments; ``activation_bytes``: one step's
    activations, of which ``head_bytes`` are the head's (``head_activation_bytes``);
    ``optimizer_type``: the YAML's ``optimizer.type`` (see ``cpu_state_factor``). The terms and their
    measured factors are described at the top of this module.
    """
    state_factor = cpu_state_factor(optimizer_type)[0]
    return (RUNTIME_OVERHEAD_CPU + state_factor * state_bytes
            + CPU_ACTIVATION_FACTOR * (activation_bytes - head_bytes) + CPU_HEAD_FACTOR * head_bytes)
