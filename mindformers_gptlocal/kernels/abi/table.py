"""The kernel table: every kernel of gpt_local's CPU library, one entry each (``spec.py`` says how one reads).

From this table come the library's AOT entry points (adapters the build generates, ``codegen.py``), the typed cores'
declarations and the options structs (the generated ``cores.h``), the options' Python values (``LinearOptions(...)
.tensor()``), the primitives' shapes, dtypes and (where ``backward`` names a kernel) bprops (``aot.primitive``), and
``build.py``'s sources and symbols. A new kernel: its core in a ``.cc`` file (``int gptlocal_core_<name>(...)``, the
signature ``cores.h`` declares from its entry) and its entry here; ``aot.KernelCell(path, KERNEL, **options)`` is
then its Cell (or a class of its own where the model calls it otherwise), and ``provider.py`` a method where the
model uses it. ``python -m mindformers_gptlocal.kernels.abi.codegen`` prints what the build generates.
"""
from .layer_table import decode_layer_parameters, decoder_layer_fields, train_layer_parameters
from .spec import Export, Kernel, Options, Struct, Table

# ------------------------------------------------------------------------------------------------ options structs
ThreadOptions = Options("ThreadOptions", "threads: int", "Only the threads a kernel may run.")
AttentionOptions = Options(
    "AttentionOptions", "scale: float, dropout_scale: float, dropout_mode: int, threads: int, query_block: int, "
    "key_block: int", "The fused attention's: dropout_mode 0 none, 1 keep where the counter dropout's bits agree, 2 "
    "where they differ; the query and key blocks' rows.")
LayerNormOptions = Options("LayerNormOptions", "epsilon: float, threads: int", "LayerNorm's.")
RMSNormOptions = Options("RMSNormOptions", "epsilon: float, threads: int", "RMSNorm's.")
BiasGeluOptions = Options("BiasGeluOptions", "form: int, threads: int",
                          "Bias + GeLU's: form MlpForm::kTanh or kQuick.")
LinearOptions = Options("LinearOptions", "threads: int, precision: int",
                        "Linear's GEMM: precision 0 float32, 1 bfloat16 x bfloat16 -> float32 (oneDNN's "
                        "dnnl_gemm_bf16bf16f32), 2 the same numbers emulated (inputs rounded to bfloat16, sgemm).")
LinearGeluOptions = Options("LinearGeluOptions", "threads: int, precision: int, form: int",
                            "The GEMM with the bias + GeLU epilogue: LinearOptions' fields, then the GeLU form.")
LoRADropoutOptions = Options("LoRADropoutOptions", "scale: float, mode: int, threads: int",
                             "LoRA's input dropout: scale 1 / (1 - p); mode 1 keep where the bits agree, 2 where "
                             "they differ.")
Int8Options = Options("Int8Options", "threads: int, method: int",
                      "The exact int8 product's: method 0 chosen by this CPU (2 where oneDNN has VNNI, else 1), 1 "
                      "the dot loop (int16 pairs summed in int32), 2 oneDNN's s8s8s32 (exact with VNNI only).")
HeadLossOptions = Options("HeadLossOptions", "threads: int, rows: int",
                          "The fused head + loss's: the rows of a chunk (0: chunks of equal rows, each at most 64 MB "
                          "of logits where 64 rows fit).")
TrainLayerOptions = Options(
    "TrainLayerOptions", "epsilon: float, scale: float, attention_dropout_scale: float, hidden_dropout_scale: float, "
    "attention_dropout_mode: int, hidden_dropout_mode: int, heads: int, groups: int, norm: int, mlp: int, bias: int, "
    "qkv_bias: int, rope: int, parallel_residual: int, precision: int, threads: int, query_block: int, key_block: int, "
    "slot: int", "The training layer's: the norms' epsilon, attention's scale, the counter dropouts' scales and modes "
    "(0 none, 1 keep where the bits agree, 2 where they differ; the hidden one at both residual sites), the query "
    "heads and key/value groups, norm (a NormKind), mlp (MlpForm: kTanh, kQuick or kSwiglu), bias (the "
    "projection's and the MLP's Linears), qkv_bias, rope, parallel_residual (NeoX), the GEMMs' precision "
    "(LinearOptions'; 1, 2 also save the GEMM operands as bf16), the threads, attention's query and key blocks, the "
    "layer's slot (its saved activations; 0 shared by recomputed layers).")
DecodeLayerOptions = Options("DecodeLayerOptions", "epsilon: float, scale: float, form: int, threads: int, "
                             "precision: int, norm: int, rotary_dim: int, parallel_residual: int, qkv_bias: int, "
                             "bias: int, absent: int", "The decode step's layer (cpu_decoder.h LayerShape's "
                             "choices): the norms' epsilon, attention's scale, the MLP's form (an MlpForm), the GEMMs' precision "
                             "(LinearOptions'), norm (a NormKind), the rope's "
                             "channels (0: none), NeoX's parallel residual, whether qkv and the other Linears have "
                             "biases, the DecoderLayer fields handed a placeholder (drop_absent's mask: "
                             "DecoderLayer.pointer_mask).")
# the native runner's structs (cpu_decoder.cc; runtime/native.py fills them once per runner)
DecoderModel = Struct(
    "DecoderModel", "hidden: int, heads: int, groups: int, head_dim: int, inter: int, vocab: int, layers: int, "
    "norm: int, rotary_dim: int, form: int, parallel_residual: int, weights: int, precision: int, threads: int, "
    "max_positions: int, words_kind: int, head_kind: int, epsilon: float, words: void*, words_scale: f32*, "
    "positions: f32*, final_weight: f32*, final_bias: f32*, head: void*, head_scale: f32*",
    "A model for gptlocal_decoder_step: its sizes and layout choices (DecodeLayerOptions' codes; weights and the "
    "*_kind fields: WeightKind), the token table (+ scales), the learned "
    "position table (or null: rope), the final norm, the head's table (+ scales).")
DecoderLayer = Struct(
    "DecoderLayer", decoder_layer_fields(), "One layer's attention scale and Parameters (layer_table.py LAYER; "
    "cpu_decoder.h LayerWeights): null where the layer has none (a bias, an int8 weight's scales, a LayerNorm's bias, "
    "SwiGLU's gate).", drop="drop_absent")
DecoderCache = Struct(
    "DecoderCache", "keys: mut f32*, values: mut f32*, cos: f32*, sin: f32*, slots: int, length: int",
    "A runner's KV cache: keys and values [layers, slots, G, length, D] float32, written in place; the rope's cos and "
    "sin [length, rotary_dim] by position (null without rope).")
DecoderCall = Struct(
    "DecoderCall", "ids: i32*, positions: i32*, slots: i32*, last: i32*, batch: int, width: int, logits: mut f32*, "
    "tokens: mut i32*, work: mut void*, work_bytes: int64, failed_layer: mut i32*",
    "One step: ids and positions [batch, width], each row's cache slot [batch] and the column whose logits come "
    "back [batch]; logits [batch, vocab] (or null) and / or tokens [batch] (their argmax, or null); the workspace "
    "(gptlocal_decoder_workspace bytes); failed_layer: null, or where a failed step writes the index of the layer "
    "whose part failed (-1: not in a layer).")

# ------------------------------------------------------------------------------------------------ kernels
ATTENTION_INPUTS = ("q: f32[B, N, S, D], k: f32[B, G, S, D], v: f32[B, G, S, D], bias: f32[Bb, 1, S, S], "
                    "t1: f32[P1], t2: f32[P2], offsets: i32[2]")
DROPOUT_TABLES = "t1: f32[P1], t2: f32[P2], offsets: i32[2]"
DECODE_CACHE = ("key_cache: inout f32[Bc, G, L, D], value_cache: inout f32[Bc, G, L, D], "
                "write_index: i32[B, G, 1, 3], bias: f32[Bb, 1, 1, L], cos: f32[_, _, _, _], sin: f32[_, _, _, _]")
# The training layer's tensors (cpu_train_layer.cc): the layer's input, attention's mask, rope's cos and sin, the
# attention's and the hidden dropout's bit tables, their offsets (attention_probs, attention_output, mlp_output: (a, b)
# each), then the parameters; a parameter the layer has not is a one-element stand-in (RMSNorm's shift, a bias, a
# GeLU MLP's gate [1, H]), and so are rope's cos and sin [1, 1, 1, 2] without rope and a dropout's tables [1] without it.
TRAIN_LAYER_INPUTS = (
    "hidden: f32[B, S, H], mask: f32[Bb, 1, S, S], cos: f32[Bc, 1, Sr, R], sin: f32[Bc, 1, Sr, R], "
    "attention_t1: f32[PA1], attention_t2: f32[PA2], hidden_t1: f32[PH1], hidden_t2: f32[PH2], offsets: i32[6], "
    + ", ".join(f"{name}: f32[{dims}]" for name, dims in train_layer_parameters()))
TRAIN_LAYER_PARAMETERS = tuple(name for name, _ in train_layer_parameters())
TRAIN_LAYER_GRADIENTS = "dhidden: f32[B, S, H], " + ", ".join(
    f"d{name}: f32[{dims}]" for name, dims in train_layer_parameters())
# the training layer's inputs, parameters and gradients as its cores take them (structs: cpu_train_layer.cc), the
# parameters from layer_table.py
TrainLayerInputs = Struct("TrainLayerInputs", "hidden: f32*, mask: f32*, cos: f32*, sin: f32*, attention_t1: f32*, "
                          "attention_t2: f32*, hidden_t1: f32*, hidden_t2: f32*, offsets: i32*",
                          "The training layer's input, attention's mask, rope's cos and sin, the dropouts' tables and "
                          "their offsets ((a, b) of attention_probs, attention_output, mlp_output).")
TrainLayerParams = Struct("TrainLayerParams", ", ".join(f"{name}: f32*" for name in TRAIN_LAYER_PARAMETERS),
                          "The training layer's parameters (layer_table.py LAYER; a stand-in where the layer has "
                          "none).")
TrainLayerGrads = Struct("TrainLayerGrads", ", ".join(f"d{name}: mut f32*" for name in TRAIN_LAYER_PARAMETERS)
                         + ", dhidden: mut f32*", "The gradients the training layer's backward writes: each "
                         "parameter's (zeros for a stand-in), then the layer input's.")


def decode_layer_inputs(weight):
    """The decode layer's inputs with its five Linears' weights of dtype ``weight``, each followed by its float32
    per-channel scales (an int8 model's; else a placeholder) and its bias (or a placeholder); SwiGLU's gate (or a
    placeholder weight) between fc1 and fc2; the rope's cos and sin [B, 1, 1, R] (or placeholders)."""
    return f"hidden: f32[B, 1, H], {decode_layer_parameters(weight)}, {DECODE_CACHE}"


TABLE = Table([
    Kernel("gptlocal_attention_fwd", "cpu_attention.cc", ATTENTION_INPUTS, "out: f32[B, N, S, D], lse: f32[B, N, S]",
           AttentionOptions, "fused causal attention (FlashAttention-2's scheme): the context and each row's "
           "logsumexp", backward="gptlocal_attention_bwd", op="attention"),
    Kernel("gptlocal_attention_bwd", "cpu_attention.cc",
           ATTENTION_INPUTS + ", out: f32[B, N, S, D], lse: f32[B, N, S], dout: f32[B, N, S, D]",
           "dq: f32[B, N, S, D], dk: f32[B, G, S, D], dv: f32[B, G, S, D]", AttentionOptions,
           "its backward, the probabilities recomputed from the logsumexp", op="attention"),
    Export("InPlaceScatterNdUpdate", "kv_write.cc", "int InPlaceScatterNdUpdate(int nparam, void **params, "
           "int *ndims, int64_t **shapes, const char **dtypes, void *stream, void *extra)",
           "the KV cache's in-place ScatterNdUpdate (MindSpore's ABI, any dtype and rank: written by hand)",
           op="kv_write"),
    Kernel("gptlocal_layernorm_fwd", "cpu_layernorm.cc", "x: f32[*T, H], gamma: f32[H], beta: f32[H]",
           "y: f32[*T, H], mean: f32[*T], rstd: f32[*T]", LayerNormOptions, "LayerNorm over the last axis",
           backward="gptlocal_layernorm_bwd", op="layer_norm"),
    Kernel("gptlocal_layernorm_bwd", "cpu_layernorm.cc",
           "x: f32[*T, H], gamma: f32[H], mean: f32[*T], rstd: f32[*T], dy: f32[*T, H]",
           "dx: f32[*T, H], dgamma: f32[H], dbeta: f32[H]", LayerNormOptions, "its backward", op="layer_norm"),
    Kernel("gptlocal_bias_gelu_fwd", "cpu_bias_gelu.cc", "x: f32[*T, F], bias: f32[F]", "y: f32[*T, F]",
           BiasGeluOptions, "gelu(x + bias), tanh or quick", backward="gptlocal_bias_gelu_bwd", op="bias_gelu"),
    Kernel("gptlocal_bias_gelu_bwd", "cpu_bias_gelu.cc", "x: f32[*T, F], bias: f32[F], dy: f32[*T, F]",
           "dx: f32[*T, F], dbias: f32[F]", BiasGeluOptions, "its backward", op="bias_gelu"),
    Kernel("gptlocal_lora_dropout_fwd", "lora_dropout.cc", "x: f32[*n], " + DROPOUT_TABLES, "y: f32[*n]",
           LoRADropoutOptions, "LoRA's input dropout: the counter dropout's mask", core="lora_dropout",
           backward="gptlocal_lora_dropout_bwd", op="lora_dropout"),
    Kernel("gptlocal_lora_dropout_bwd", "lora_dropout.cc", "dy: f32[*n], " + DROPOUT_TABLES, "dx: f32[*n]",
           LoRADropoutOptions, "its backward: the same mask drawn again", core="lora_dropout", op="lora_dropout"),
    Kernel("gptlocal_rmsnorm_fwd", "cpu_rmsnorm.cc", "x: f32[*T, H], weight: f32[H]", "y: f32[*T, H], rstd: f32[*T]",
           RMSNormOptions, "RMSNorm over the last axis", backward="gptlocal_rmsnorm_bwd", op="rms_norm"),
    Kernel("gptlocal_rmsnorm_bwd", "cpu_rmsnorm.cc", "x: f32[*T, H], weight: f32[H], rstd: f32[*T], dy: f32[*T, H]",
           "dx: f32[*T, H], dweight: f32[H]", RMSNormOptions, "its backward", op="rms_norm"),
    Kernel("gptlocal_swiglu_fwd", "cpu_swiglu.cc", "gate: f32[*n], up: f32[*n]", "y: f32[*n]", ThreadOptions,
           "silu(gate) * up", backward="gptlocal_swiglu_bwd", op="swiglu"),
    Kernel("gptlocal_swiglu_bwd", "cpu_swiglu.cc", "gate: f32[*n], up: f32[*n], dy: f32[*n]",
           "dgate: f32[*n], dup: f32[*n]", ThreadOptions, "its backward, the sigmoid recomputed", op="swiglu"),
    Kernel("gptlocal_linear_fwd", "cpu_linear.cc", "x: f32[T, K], w: f32[N, K], b: f32[N]?", "y: f32[T, N]",
           LinearOptions, "x w^T (+ b) over column blocks", core="linear_fwd", op="linear"),
    Kernel("gptlocal_linear_fwd_bias", "cpu_linear.cc", "x: f32[T, K], w: f32[N, K], b: f32[N]", "y: f32[T, N]",
           LinearOptions, "the same with the bias, a symbol of its own (MindSpore keys a Custom's bprop by it)",
           core="linear_fwd", op="linear"),
    Kernel("gptlocal_linear_bwd", "cpu_linear.cc", "x: f32[T, K], w: f32[N, K], dy: f32[T, N]",
           "dx: f32[T, K], dw: f32[N, K]", LinearOptions, "dx = dy w, dw = dy^T x", op="linear"),
    Kernel("gptlocal_linear_bf16w_fwd", "cpu_linear.cc", "x: f32[T, K], w: bf16[N, K], b: f32[N]?", "y: f32[T, N]",
           LinearOptions, "the forward on a weight held as bfloat16 (precision 1 or 2)", op="linear"),
    Kernel("gptlocal_linear_gelu_fwd", "cpu_linear.cc", "x: f32[T, K], w: f32[N, K], b: f32[N]",
           "y: f32[T, N], h: f32[T, N]", LinearGeluOptions, "y = gelu(h), h = x w^T + b",
           backward="gptlocal_linear_gelu_bwd", op="gemm_epilogue"),
    Kernel("gptlocal_linear_gelu_bwd", "cpu_linear.cc", "x: f32[T, K], w: f32[N, K], h: f32[T, N], dy: f32[T, N]",
           "dx: f32[T, K], dw: f32[N, K], db: f32[N], scratch: f32[T, N]", LinearGeluOptions,
           "its backward (scratch: dh = dy gelu'(h))", op="gemm_epilogue"),
    Kernel("gptlocal_linear_residual_fwd", "cpu_linear.cc",
           "x: f32[T, K], w: f32[N, K], b: f32[N], residual: f32[T, N]", "y: f32[T, N]", LinearOptions,
           "y = residual + x w^T + b", op="gemm_epilogue"),
    Export("gptlocal_linear_bf16_native", "cpu_linear.cc", "int gptlocal_linear_bf16_native()",
           "1 where precision 1 runs oneDNN's bf16 GEMM on this CPU, 0 where it runs the emulation", op="linear"),
    Export("gptlocal_cpu_isa", "cpu_linear.cc", "int gptlocal_cpu_isa()",
           "oneDNN's effective ISA here (dnnl_get_effective_cpu_isa: its dnnl_cpu_isa_t bit mask), which the GEMM "
           "rules read"),
    Export("gptlocal_set_isa", "cpu_linear.cc", "int gptlocal_set_isa(int tier)",
           "the library's one ISA cap (common.h IsaTier; model_config.cpu_kernels.isa, build.apply_isa): every "
           "path, oneDNN's through dnnl_set_max_cpu_isa where it still takes it (Status::kOk; kBadCall: no such tier)"),
    Export("gptlocal_isa", "cpu_linear.cc", "int gptlocal_isa(int part)",
           "the ISA decision's parts: the cap, our loops' tier, oneDNN's (capped), the CPU's flags', oneDNN's own"),
    Export("gptlocal_bf16_gemm_fast", "cpu_linear.cc", "int gptlocal_bf16_gemm_fast(int isa)",
           "1 where oneDNN's bf16 GEMM runs its fast kernels on a CPU of oneDNN's ISA `isa` (avx512_core on), the "
           "rule precision 1 follows", op="linear"),
    Export("gptlocal_to_bf16", "cpu_linear.cc", "void gptlocal_to_bf16(const float *in, int64_t n, uint16_t *out)",
           "common.h's to_bf16 (bf16_bits: to nearest even), as the GEMMs round: for tests"),
    Kernel("gptlocal_decode_layer_fwd", "cpu_decode_layer.cc", decode_layer_inputs("f32"), "out: f32[B, 1, H]",
           DecodeLayerOptions, "a layer of the decode step (every layout), the caches written in place",
           op="decode_layer", groups=(DecoderLayer,)),
    Kernel("gptlocal_decode_layer_int8_fwd", "cpu_decode_layer.cc", decode_layer_inputs("i8"),
           "out: f32[B, 1, H]", DecodeLayerOptions, "the same layer of an int8 model", op="decode_layer",
           groups=(DecoderLayer,)),
    Kernel("gptlocal_decode_layer_bf16w_fwd", "cpu_decode_layer.cc", decode_layer_inputs("bf16"), "out: f32[B, 1, H]",
           DecodeLayerOptions, "the same layer with bfloat16 weights", op="decode_layer", groups=(DecoderLayer,)),
    Export("gptlocal_decoder_step", "cpu_decoder.cc", "int gptlocal_decoder_step(const DecoderModel *model, "
           "const DecoderLayer *layers, const DecoderCache *cache, const DecoderCall *call)",
           "the native runner's step: a model's forward over its KV cache for one call's rows, logits or their argmax "
           "(Status::kOk, or the named status of the part that failed; its layer in DecoderCall.failed_layer)",
           op="runner", structs=(DecoderModel, DecoderLayer, DecoderCache, DecoderCall)),
    Export("gptlocal_decoder_linear", "cpu_decoder.cc", "int gptlocal_decoder_linear(int kind, int precision, "
           "int threads, const void *w, const float *scale, const float *b, const float *x, float *y, int64_t T, "
           "int64_t K, int64_t N)", "the decoder's Linear alone (float32, bf16 or int8 weights): for tests of each "
           "ISA tier's few-row GEMMs", op="runner"),
    Export("gptlocal_decoder_workspace", "cpu_decoder.cc", "int64_t gptlocal_decoder_workspace(const DecoderModel "
           "*model, int64_t rows, int64_t batch)", "the workspace bytes of a step of `rows` token rows, `batch` "
           "sequences", op="runner", structs=(DecoderModel,)),
    Kernel("gptlocal_rows_bf16_fwd", "cpu_decoder.cc", "table: bf16[V, H], ids: i32[*T]", "rows: f32[*T, H]",
           ThreadOptions, "rows of a bfloat16 table widened to float32: a bf16 inference build's token lookup",
           op="linear"),
    Kernel("gptlocal_int8_linear_fwd", "cpu_linear_int8.cc", "x: f32[T, K], w: i8[N, K], scale: f32[N], b: f32[N]?",
           "y: f32[T, N]", ThreadOptions, "an int8 model's Linear: x quantized per row, s8 x s8 -> s32, scaled",
           op="int8_linear"),
    Kernel("gptlocal_int8_matmul_fwd", "cpu_linear_int8.cc", "x: i8[T, K], w: i8[N, K]", "acc: i32[T, N]",
           Int8Options, "the exact int8 product x w^T in int32, by the CPU's method or the one given",
           core="int8_matmul"),
    Export("gptlocal_int8_gemm_exact", "cpu_linear_int8.cc", "int gptlocal_int8_gemm_exact(int isa)",
           "1 where oneDNN's s8s8s32 GEMM is exact on a CPU of oneDNN's ISA `isa` (VNNI), the rule the int8 cores "
           "follow", op="int8_linear"),
    Export("gptlocal_int8_method", "cpu_linear_int8.cc", "int gptlocal_int8_method(int asked)",
           "the int8 product's method a call runs here (Int8Options.method `asked`; 0: this CPU's choice)",
           op="int8_linear"),
    Kernel("gptlocal_square_sum_fwd", "cpu_square_sum.cc", "x: f32[*n]", "total: f32[1]", ThreadOptions,
           "the sum of x's squares", op="square_sum"),
    Kernel("gptlocal_adamw_fwd", "cpu_adamw.cc",
           "w: inout f32[*n], m: inout f32[*n], v: inout f32[*n], g: f32[*n], lr: f32[*1], beta1: f32[*1], "
           "beta2: f32[*1], eps: f32[*1], decay: f32[*1]", "status: token", ThreadOptions,
           "AdamWeightDecay's update of one parameter and its moments, in place", op="adamw"),
    Kernel("gptlocal_head_loss_fwd", "cpu_head_loss.cc",
           "x: f32[T, H], w: f32[V, H], labels: i32[T], row_weight: f32[T]",
           "loss: f32[1], gx: f32[T, H], gw: f32[V, H]", HeadLossOptions,
           "the LM head and its cross-entropy over chunks of rows: the weighted loss and its gradients (no [T, V] "
           "tensor)", backward="gptlocal_head_loss_bwd", op="head_loss"),
    Kernel("gptlocal_head_loss_bwd", "cpu_head_loss.cc", "gx: f32[T, H], gw: f32[V, H], dloss: f32[1]",
           "dx: f32[T, H], dw: f32[V, H]", HeadLossOptions, "its backward: the gradients scaled by dloss",
           op="head_loss"),
    Kernel("gptlocal_train_layer_fwd", "cpu_train_layer.cc", TRAIN_LAYER_INPUTS, "out: f32[B, S, H], ticket: i32[2]",
           TrainLayerOptions, "a whole decoder layer of a training step (norm, QKV, rope, attention, projection, "
           "residual, norm, MLP, residual): its output and the ticket of the activations it saved in its slot",
           backward="gptlocal_train_layer_bwd", op="train_layer", groups=(TrainLayerInputs, TrainLayerParams)),
    Kernel("gptlocal_train_layer_bwd", "cpu_train_layer.cc", TRAIN_LAYER_INPUTS + ", ticket: i32[2], dout: f32[B, S, H]",
           TRAIN_LAYER_GRADIENTS,
           TrainLayerOptions, "its backward: the slot's activations where the ticket still holds them (else the "
           "forward again, from its inputs), then every gradient", op="train_layer",
           groups=(TrainLayerInputs, TrainLayerParams, TrainLayerGrads)),
    Export("gptlocal_train_layer_release", "cpu_train_layer.cc", "int gptlocal_train_layer_release(int32_t slot)",
           "frees a training layer's slot (its Cell is gone)", op="train_layer"),
    Export("gptlocal_train_layer_stats", "cpu_train_layer.cc", "void gptlocal_train_layer_stats(int64_t *out)",
           "the training layer's counts: forwards, backwards, backwards that ran their forward again, the slots' "
           "bytes, the workspace's bytes, the slots", op="train_layer"),
    Kernel("gptlocal_rope_fwd", "cpu_rope.cc", "x: f32[B, N, S, D], cos: f32[Bc, 1, S, R], sin: f32[Bc, 1, S, R]",
           "y: f32[B, N, S, D]", ThreadOptions, "rotary embedding of the first R channels of each head (rotate_half)",
           backward="gptlocal_rope_bwd"),
    Kernel("gptlocal_rope_bwd", "cpu_rope.cc", "dy: f32[B, N, S, D], cos: f32[Bc, 1, S, R], sin: f32[Bc, 1, S, R]",
           "dx: f32[B, N, S, D]", ThreadOptions, "its backward: the transposed rotation"),
], structs=(TrainLayerInputs, TrainLayerParams, TrainLayerGrads))
KERNELS = {kernel.symbol: kernel for kernel in TABLE.kernels}
