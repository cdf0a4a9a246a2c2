// One whole decoder layer of a training step for CPU, forward and backward: the typed cores of
// gptlocal_train_layer_fwd / _bwd (gpt_local, kernels/abi/table.py; kernels/cells/train_layer.py CPUTrainLayer; model/gpt.py
// GPTLocalBlock in training graphs where cpu_kernels.train_layer chooses it).
//
// Why: the training step is otherwise MindSpore's graph of per-op kernels with every activation between them a float32
// tensor of MindSpore's pool (issue 51). Here the layer is one node each way, composed of the library's typed cores
// called as C++ functions (cpu_layernorm.cc / cpu_rmsnorm.cc, cpu_linear.cc's GEMMs, cpu_rope.cc, cpu_attention.cc,
// cpu_bias_gelu.cc / cpu_swiglu.cc, lora_dropout.cc's counter-dropout mask), so its numbers are those of the model's
// per-op graph with those kernels, and the activations live in buffers this file owns.
//
// The layer (options TrainLayerOptions: norm a NormKind, mlp MlpForm::kTanh, kQuick or kSwiglu,
// bias, qkv_bias, rope, parallel_residual; heads N, groups G):
//   a = norm1(x); qkv = a Wqkv^T (+ bqkv), group-major [G, (N/G query heads, k, v), D] per token; q, k (rope on
//   their first R channels: cos, sin [Bc, 1, S, R]), v -> causal attention (the additive mask [Bb, 1, S, S], the
//   counter dropout on the probabilities) -> ctx; attn = drop(ctx Wproj^T (+ bproj)) (site attention_output);
//   sequential: h = x + attn; m = mlp(norm2(h)); y = h + drop(m) (site mlp_output)
//   parallel (NeoX): m = mlp(norm2(x)); y = (x + attn) + drop(m)
//   mlp: GeLU: gelu(b W1^T + b1) W2^T (+ b2) (the bias + GeLU core on the GEMM's output, as the unfused graph);
//        SwiGLU: (silu(b Wgate^T (+ bg)) * (b W1^T (+ b1))) W2^T (+ b2)
// Absent parameters (RMSNorm's shift, biases, SwiGLU's gate in a GeLU layer) are passed as one-element tensors and
// ignored (their gradients are zeros).
//
// What the forward saves for the backward (in the layer's slot, below), per token:
//   qkv [Q] (the QKV GEMM's output, before rope), ctx [N D] (attention's output, token-major: the projection's GEMM
//   input), the MLP's GEMM output(s) [I] (GeLU: fc1's x W1^T before its bias; SwiGLU: gate and up [2 I]), and, with
//   the sequential residual, h [H]; and lse [N] (each query row's logsumexp). With bf16 GEMMs (precision 1, 2:
//   compute_dtype bfloat16) qkv, ctx and the MLP's are saved as bfloat16 (the GEMMs round them to bf16 anyway: the
//   weight gradients read the same bits), h and lse as float32 (the residual stream a LayerNorm reads: PyTorch's
//   autocast keeps it float32 too); else all float32. Under bf16 the forward itself goes on from the bf16 values it
//   saves (the attention's q, k, v, the MLP's activation input), as autocast's bf16 GEMM outputs: the backward's
//   recomputed probabilities and activation are then the forward's exactly (the logsumexp of fp32 q, k against bf16
//   ones would be off by the rounding times the logits). Recomputed in the backward instead of saved: both norms' outputs
//   and statistics, rope, the GeLU / SwiGLU output, every dropout mask (drawn again from the tables).
//
// Buffers and pairing. Each layer (its Cell) owns a slot (TrainLayerOptions.slot; slot 0 is shared by the layers
// MindSpore recomputes), kept across steps (grown, never shrunk; gptlocal_train_layer_release frees it when the Cell
// goes). A forward writes its saved activations into its slot and returns a ticket (slot, generation); the backward
// gets that ticket (a forward output, so the ticket of the forward whose outputs MindSpore hands the bprop: the
// recomputed one under recompute) and reads the slot only where it still holds that generation. Where it does not
// (another forward of the same slot ran in between: a shared recompute slot, pipeline micro-batches, an eval
// forward, a second call of the layer) the backward first runs the forward again from its inputs, which it always
// has, into the slot: the numbers are the same (every core is deterministic for a thread count; the dropout masks come
// from the step's offsets), only slower; gptlocal_train_layer_stats counts those recomputes. One mutex guards the
// slots and the shared workspace: the layer's kernels never run at once (MindSpore runs a step's layers in sequence
// anyway), and a forward cannot overwrite a slot while a backward reads it.
//
// Scratch: one workspace for every layer (its buffers sized for the largest call, kept across calls).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <vector>

#include "common.h"

namespace {

// ------------------------------------------------------------------------------------------------ the layer's shape
struct Dims {
  int64_t B, S, H, N, G, D, Q, ND, I, R, Bb, Bc, T, group;
  int64_t PA1, PA2, PH1, PH2;
  bool layer_norm, gated, quick, bias, qkv_bias, rope, parallel, bf16;
};

// The parameters and the gradients: cores.h's TrainLayerParams, TrainLayerGrads (generated from
// kernels/abi/layer_table.py LAYER: each parameter, then, of the gradients, the layer input's).
using Params = TrainLayerParams;
using Grads = TrainLayerGrads;

using Inputs = TrainLayerInputs;  // offsets: (a, b) of attention_probs, attention_output, mlp_output

// The checks of a call: 0, or the status the kernel fails with (nothing written).
int read_dims(int64_t B, int64_t S, int64_t H, int64_t Bb, int64_t Bc, int64_t Sr, int64_t R, int64_t PA1,
              int64_t PA2, int64_t PH1, int64_t PH2, int64_t Hn, int64_t Q, int64_t Qb, int64_t ND, int64_t Hb,
              int64_t I, int64_t Ib, int64_t Ig, int64_t Igb, const int32_t *offsets, const TrainLayerOptions &o,
              Dims *d) {
  *d = Dims{};
  d->B = B, d->S = S, d->H = H, d->N = o.heads, d->G = o.groups, d->Q = Q, d->ND = ND, d->I = I, d->R = R;
  d->Bb = Bb, d->Bc = Bc, d->T = B * S, d->PA1 = PA1, d->PA2 = PA2, d->PH1 = PH1, d->PH2 = PH2;
  d->layer_norm = o.norm == NormKind::kLayerNorm, d->gated = o.mlp == MlpForm::kSwiglu;
  d->quick = o.mlp == MlpForm::kQuick, d->bias = o.bias != 0;
  d->qkv_bias = o.qkv_bias != 0, d->rope = o.rope != 0, d->parallel = o.parallel_residual != 0;
  d->bf16 = o.precision != 0;
  const bool norm_known = o.norm == NormKind::kLayerNorm || o.norm == NormKind::kRmsNorm;
  const bool mlp_known = o.mlp == MlpForm::kTanh || o.mlp == MlpForm::kQuick || o.mlp == MlpForm::kSwiglu;
  if (!norm_known || !mlp_known || o.precision < 0 || o.precision > 2) return Status::kBadCall;
  if (d->N <= 0 || d->G <= 0 || d->N % d->G != 0 || ND % d->N != 0) return Status::kBadShape;
  d->D = ND / d->N;
  d->group = d->N / d->G;
  if (Q != (d->N + 2 * d->G) * d->D || (Bb != 1 && Bb != B)) return Status::kBadShape;
  if (d->layer_norm && Hn != H) return Status::kBadShape;  // LayerNorm's shifts
  if (d->qkv_bias && Qb != Q) return Status::kBadShape;
  if (d->bias && (Hb != H || Ib != I)) return Status::kBadShape;
  if (d->gated && (Ig != I || (d->bias && Igb != I))) return Status::kBadShape;
  if (d->rope && ((Bc != 1 && Bc != B) || Sr != S || R <= 0 || R > d->D || R % 2 != 0)) return Status::kBadShape;
  const int modes[3] = {o.attention_dropout_mode, o.hidden_dropout_mode, o.hidden_dropout_mode};
  const int64_t sizes[3][2] = {{PA1, PA2}, {PH1, PH2}, {PH1, PH2}};
  for (int site = 0; site < 3; ++site) {
    if (modes[site] < 0 || modes[site] > 2) return Status::kBadCall;
    if (modes[site] == 0) continue;
    const int32_t a = offsets[2 * site], b = offsets[2 * site + 1];
    if (sizes[site][0] < 2 || sizes[site][1] < 2 || a < 0 || b < 0 || a >= sizes[site][0] || b >= sizes[site][1]) {
      return Status::kDropoutOffsets;
    }
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------ small passes
int threads_of(const TrainLayerOptions &o, int64_t elements) { return threads_for(o.threads, elements); }

// y = a + b over n elements, in chunks on the library's threads.
void add(const float *a, const float *b, float *y, int64_t n, const TrainLayerOptions &o) {
  run_chunks(threads_of(o, n), n, [&](int, int64_t i0, int64_t i1) { add_rows(a + i0, b + i0, y + i0, i1 - i0); });
}

// y = (a + b) + c, the sums in that order.
void add3(const float *a, const float *b, const float *c, float *y, int64_t n, const TrainLayerOptions &o) {
  run_chunks(threads_of(o, n), n, [&](int, int64_t i0, int64_t i1) {
    add_rows(a + i0, b + i0, y + i0, i1 - i0);
    add_rows(y + i0, c + i0, y + i0, i1 - i0);
  });
}

VEC_FN(void, widen_rows, (const uint16_t *in, float *out, int64_t n), (in, out, n)) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_value(in[i]);
}

VEC_FN(void, keep_half_rows, (float *x, uint16_t *saved, int64_t n), (x, saved, n)) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    saved[i] = bf16_bits(x[i]);
    x[i] = bf16_value(saved[i]);
  }
}

// saved = x as bf16, and x = those bf16 values (float32): the forward goes on with what the backward will read.
void keep_half(float *x, uint16_t *saved, int64_t n, const TrainLayerOptions &o) {
  run_chunks(threads_of(o, n), n, [&](int, int64_t i0, int64_t i1) { keep_half_rows(x + i0, saved + i0, i1 - i0); });
}

void to_full(const uint16_t *in, float *out, int64_t n, const TrainLayerOptions &o) {
  run_chunks(threads_of(o, n), n, [&](int, int64_t i0, int64_t i1) { widen_rows(in + i0, out + i0, i1 - i0); });
}

// out[c] = the sum over rows t of x[t, c], rows in order for every column (whatever the thread count): a bias's
// gradient.
void column_sums(const float *x, int64_t T, int64_t C, float *out, const TrainLayerOptions &o) {
  column_blocks(threads_of(o, T * C), C, [&](int64_t c0, int64_t c1) {
    std::fill(out + c0, out + c1, 0.0f);
    for (int64_t t = 0; t < T; ++t) add_rows(out + c0, x + t * C + c0, out + c0, c1 - c0);
  });
}

// The counter dropout of a [T, H] tensor at `site` (1 attention_output, 2 mlp_output), in place: lora_dropout.cc's
// core, the mask of model/dropout.py CounterDropout (element i of the flattened tensor by the two tables).
int hidden_dropout(float *x, int64_t n, int site, const Dims &d, const Inputs &in, const TrainLayerOptions &o) {
  if (o.hidden_dropout_mode == 0) return 0;
  return gptlocal_core_lora_dropout(x, in.hidden_t1, in.hidden_t2, in.offsets + 2 * site, x, n, d.PH1, d.PH2,
                                    LoRADropoutOptions{o.hidden_dropout_scale, o.hidden_dropout_mode, o.threads});
}

// qkv [B, S, G, group + 2, D] -> q [B, N, S, D], k and v [B, G, S, D] (model/attention.py _split_groups); `to_rows`
// the other way (the gradients back into the fused layout).
template <bool to_rows>
void heads(float *qkv, float *q, float *k, float *v, const Dims &d, const TrainLayerOptions &o) {
  const int64_t S = d.S, D = d.D, N = d.N, G = d.G, gs = d.group;
  const size_t bytes = sizeof(float) * D;
  run_chunks(threads_of(o, d.T * d.Q), d.T, [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / S, s = r % S;
      float *row = qkv + r * d.Q;
      for (int64_t g = 0; g < G; ++g) {
        float *part = row + g * (gs + 2) * D;
        for (int64_t j = 0; j <= gs + 1; ++j) {
          float *head = j < gs ? q + ((b * N + g * gs + j) * S + s) * D
                               : (j == gs ? k : v) + ((b * G + g) * S + s) * D;
          if (to_rows) {
            std::memcpy(part + j * D, head, bytes);
          } else {
            std::memcpy(head, part + j * D, bytes);
          }
        }
      }
    }
  });
}

// rows [B, S, N, D] (token-major, a GEMM's [T, N D]) <-> heads [B, N, S, D]
template <bool to_rows>
void context(float *rows, float *heads_, const Dims &d, const TrainLayerOptions &o) {
  const int64_t S = d.S, D = d.D, N = d.N;
  const size_t bytes = sizeof(float) * D;
  run_chunks(threads_of(o, d.T * d.ND), d.T, [&](int, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t b = r / S, s = r % S;
      for (int64_t n = 0; n < N; ++n) {
        float *head = heads_ + ((b * N + n) * S + s) * D;
        if (to_rows) {
          std::memcpy(rows + r * d.ND + n * D, head, bytes);
        } else {
          std::memcpy(head, rows + r * d.ND + n * D, bytes);
        }
      }
    }
  });
}

// ------------------------------------------------------------------------------------------------ slots, workspace
// The shape a slot's activations are of: a backward of another shape runs its forward again.
struct Shape {
  int64_t B, S, H, N, G, D, I, R;
  bool gated, parallel, bf16;
  bool operator==(const Shape &other) const {
    return B == other.B && S == other.S && H == other.H && N == other.N && G == other.G && D == other.D &&
           I == other.I && R == other.R && gated == other.gated && parallel == other.parallel && bf16 == other.bf16;
  }
};

Shape shape_of(const Dims &d) { return Shape{d.B, d.S, d.H, d.N, d.G, d.D, d.I, d.R, d.gated, d.parallel, d.bf16}; }

struct Slot {
  std::vector<float> full;      // float32 activations (all of them, or h and lse under bf16)
  std::vector<uint16_t> half;   // bfloat16 ones (qkv, ctx, the MLP's) under bf16
  int64_t generation = 0;       // the forward whose activations these are; 0: none
  Shape shape{};
};

// Where a slot's activations are: float32 pointers, or bf16 ones (bf16 GEMMs); h null with the parallel residual.
struct Saved {
  float *qkv, *ctx, *mlp, *h, *lse;
  uint16_t *qkv16, *ctx16, *mlp16;
};

// The pointers into `slot` for `d`, growing it where it is smaller.
Saved carve(Slot *slot, const Dims &d) {
  const int64_t mlp = d.T * d.I * (d.gated ? 2 : 1), h = d.parallel ? 0 : d.T * d.H, lse = d.B * d.N * d.S;
  const int64_t wide = d.T * d.Q + d.T * d.ND + mlp;  // the GEMM operands
  const size_t full = static_cast<size_t>((d.bf16 ? 0 : wide) + h + lse);
  const size_t half = static_cast<size_t>(d.bf16 ? wide : 0);
  if (slot->full.size() < full) slot->full.resize(full);
  if (slot->half.size() < half) slot->half.resize(half);
  Saved s{};
  float *f = slot->full.data();
  if (d.bf16) {
    uint16_t *b = slot->half.data();
    s.qkv16 = b, s.ctx16 = b + d.T * d.Q, s.mlp16 = s.ctx16 + d.T * d.ND;
  } else {
    s.qkv = f, s.ctx = f + d.T * d.Q, s.mlp = s.ctx + d.T * d.ND;
    f = s.mlp + mlp;
  }
  s.h = d.parallel ? nullptr : f;
  s.lse = f + h;
  return s;
}

// The shared scratch: the buffers of Buffers below (and the norms' statistics), each grown to the largest call, kept.
constexpr int kBuffers = 12;  // buffers() takes them
struct Workspace {
  std::vector<float> buffers[kBuffers];
  float *get(int id, int64_t floats) {
    std::vector<float> &buffer = buffers[id];
    if (buffer.size() < static_cast<size_t>(floats)) buffer.resize(static_cast<size_t>(floats));
    return buffer.data();
  }
  int64_t bytes() const {
    int64_t total = 0;
    for (const auto &buffer : buffers) total += static_cast<int64_t>(buffer.size() * sizeof(float));
    return total;
  }
};

struct State {
  std::mutex lock;
  std::map<int32_t, Slot> slots;
  Workspace workspace;
  int64_t generation = 0;
  int64_t forwards = 0, backwards = 0, recomputed = 0;
};

State &state() {
  static State *s = new State();  // never destroyed: a kernel may run while the process exits
  return *s;
}

// ------------------------------------------------------------------------------------------------ norms, GEMMs
// y = norm(x) and its row statistics [2 T] (common.h's norm_forward / norm_backward: the layer's NormKind)
int norm_forward(const float *x, const float *w, const float *b, float *y, float *stats, const Dims &d,
                 const TrainLayerOptions &o) {
  return ::norm_forward(o.norm, x, w, b, y, stats, d.T, d.H, o.epsilon, o.threads);
}

int norm_backward(const float *x, const float *w, const float *stats, const float *dy, float *dx, float *dw,
                  float *db, const Dims &d, const TrainLayerOptions &o) {
  return ::norm_backward(o.norm, x, w, stats, dy, dx, dw, db, d.T, d.H, o.epsilon, o.threads);
}

LinearOptions linear_options(const TrainLayerOptions &o) { return LinearOptions{o.threads, o.precision}; }

AttentionOptions attention_options(const TrainLayerOptions &o) {
  return AttentionOptions{o.scale, o.attention_dropout_scale, o.attention_dropout_mode, o.threads, o.query_block,
                          o.key_block};
}

// qkv [T, Q] -> the attention's q [B, N, S, D], k, v [B, G, S, D]; with rope q and k turned (rope's core) from their
// raw heads in `raw` [T, N D + G D].
int attention_inputs(float *qkv, float *q, float *k, float *v, float *raw, const Dims &d, const Inputs &in,
                     const TrainLayerOptions &o) {
  if (!d.rope) {
    heads<false>(qkv, q, k, v, d, o);
    return 0;
  }
  float *raw_k = raw + d.T * d.ND;
  heads<false>(qkv, raw, raw_k, v, d, o);
  const int status = gptlocal_core_rope_fwd(raw, in.cos, in.sin, q, d.B, d.N, d.S, d.D, d.Bc, d.R,
                                            ThreadOptions{o.threads});
  if (status != 0) return status;
  return gptlocal_core_rope_fwd(raw_k, in.cos, in.sin, k, d.B, d.G, d.S, d.D, d.Bc, d.R, ThreadOptions{o.threads});
}

// ------------------------------------------------------------------------------------------------ forward
// The workspace's activations and scratch by name (llm.c's ActivationTensors), each of one size for a shape (so taking
// them never moves another). The names on one line share one buffer, sized for the largest of them: each holds its
// value only while the next of its line is not yet written (forward, then backward, in the order below), which keeps
// the workspace at eleven [T, width] buffers.
struct Buffers {
  float *attn, *dm, *dn2;                  // the projection's output; the MLP's branch of dy (dropped); norm2's dx
  float *normed2, *dh;                     // norm2's output; the residual's gradient
  float *widened;                          // a saved bf16 GEMM operand widened to float32 (the MLP's, then ctx)
  float *act, *dctx, *da;                  // the MLP's activation; the projection's dx; the QKV GEMM's dx
  float *qkv32, *ds, *dqkv;                // qkv before its bf16 rounding (or widened again); fc2's dx; dqkv
  float *heads, *dmlp;                     // q, k, v; the MLP GEMM outputs' gradient (then q, k, v again)
  float *normed1, *mlp_out, *db, *dattn;   // norm1's output, the MLP's output; norm2's dy, drop(dh); norm1's again
  float *raw, *db_up;                      // rope's raw heads; the up path's norm2 dy (SwiGLU), then raw heads again
  float *ctx_heads, *dn1;                  // attention's output as heads; norm1's dx
  float *zeros, *dctx_heads;               // a bias-less GeLU's zero bias and unused sums [2 I]; dctx as heads
  float *dheads, *out;                     // dq, dk, dv; a recomputed forward's output
  float *stats;                            // the norm's statistics [2 T]
};

Buffers buffers(const Dims &d, Workspace &ws) {
  const int64_t T = d.T, H = d.H, I = d.I, Q = d.Q, ND = d.ND, mlp = I * (d.gated ? 2 : 1);
  Buffers w{};
  w.attn = w.dm = w.dn2 = ws.get(0, T * H);
  w.normed2 = w.dh = ws.get(1, T * H);
  w.widened = ws.get(2, d.bf16 ? T * std::max(ND, mlp) : 0);  // (float32: none)
  w.act = w.dctx = w.da = ws.get(3, T * std::max(std::max(I, ND), H));
  w.qkv32 = w.ds = w.dqkv = ws.get(4, T * std::max(I, Q));
  w.heads = w.dmlp = ws.get(5, T * std::max(mlp, Q));
  w.normed1 = w.mlp_out = w.db = w.dattn = ws.get(6, T * H);
  w.raw = w.db_up = ws.get(7, T * std::max(H, ND + d.G * d.D));
  w.ctx_heads = w.dn1 = ws.get(8, T * std::max(ND, H));
  w.zeros = w.dctx_heads = ws.get(9, std::max(T * ND, 2 * I));
  w.dheads = w.out = ws.get(10, T * std::max(Q, H));
  w.stats = ws.get(11, 2 * T);
  return w;
}

// The layer's forward: out [T, H], the activations into `saved`.
int forward(const Dims &d, const Inputs &in, const Params &p, const TrainLayerOptions &o, const Saved &saved,
            float *out, const Buffers &w) {
  const int64_t T = d.T, H = d.H, I = d.I;
  const LinearOptions lo = linear_options(o);
  float *a = w.normed1;
  int status = norm_forward(in.hidden, p.norm1_w, p.norm1_b, a, w.stats, d, o);
  // QKV (its output saved: float32 in place, else rounded from the scratch copy)
  float *qkv = d.bf16 ? w.qkv32 : saved.qkv;
  if (status == 0) status = gptlocal_core_linear_fwd(a, p.qkv_w, d.qkv_bias ? p.qkv_b : nullptr, qkv, T, H, d.Q, lo);
  if (status != Status::kOk) return status;
  if (d.bf16) keep_half(qkv, saved.qkv16, T * d.Q, o);
  // the heads (rope's from its raw heads), attention
  float *q = w.heads, *k = q + T * d.ND, *v = k + T * d.G * d.D;
  status = attention_inputs(qkv, q, k, v, w.raw, d, in, o);
  if (status != Status::kOk) return status;
  float *ctx_heads = w.ctx_heads;
  status = gptlocal_core_attention_fwd(q, k, v, in.mask, in.attention_t1, in.attention_t2, in.offsets, ctx_heads,
                                       saved.lse, d.B, d.N,
                                       d.S, d.D, d.G, d.Bb, d.PA1, d.PA2, attention_options(o));
  if (status != Status::kOk) return status;
  float *ctx = d.bf16 ? w.widened : saved.ctx;
  context<true>(ctx, ctx_heads, d, o);
  if (d.bf16) keep_half(ctx, saved.ctx16, T * d.ND, o);
  // projection, dropout, residual
  float *attn = w.attn;
  status = gptlocal_core_linear_fwd(ctx, p.proj_w, d.bias ? p.proj_b : nullptr, attn, T, d.ND, H, lo);
  if (status == 0) status = hidden_dropout(attn, T * H, 1, d, in, o);
  if (status != Status::kOk) return status;
  const float *mlp_in = in.hidden;  // the parallel residual's norm2 reads x
  if (!d.parallel) {
    add(in.hidden, attn, saved.h, T * H, o);
    mlp_in = saved.h;
  }
  // norm2, the MLP
  float *b = w.normed2;
  status = norm_forward(mlp_in, p.norm2_w, p.norm2_b, b, w.stats, d, o);
  if (status != Status::kOk) return status;
  float *mlp = d.bf16 ? w.widened : saved.mlp;  // (ctx is dead)
  float *s = w.act;
  if (d.gated) {  // mlp: gate, then up
    status = gptlocal_core_linear_fwd(b, p.gate_w, d.bias ? p.gate_b : nullptr, mlp, T, H, I, lo);
    if (status == 0) status = gptlocal_core_linear_fwd(b, p.fc1_w, d.bias ? p.fc1_b : nullptr, mlp + T * I, T, H, I, lo);
    if (status == 0 && d.bf16) keep_half(mlp, saved.mlp16, 2 * T * I, o);
    if (status == 0) status = gptlocal_core_swiglu_fwd(mlp, mlp + T * I, s, T * I, ThreadOptions{o.threads});
  } else {  // mlp: fc1's x W1^T, its bias added by the bias + GeLU core (zeros without one)
    float *zeros = w.zeros;
    std::fill(zeros, zeros + I, 0.0f);
    status = gptlocal_core_linear_fwd(b, p.fc1_w, nullptr, mlp, T, H, I, lo);
    if (status == 0 && d.bf16) keep_half(mlp, saved.mlp16, T * I, o);
    if (status == 0) {
      status = gptlocal_core_bias_gelu_fwd(mlp, d.bias ? p.fc1_b : zeros, s, T, I,
                                           BiasGeluOptions{d.quick ? MlpForm::kQuick : MlpForm::kTanh, o.threads});
    }
  }
  if (status != Status::kOk) return status;
  float *m = w.mlp_out;  // (norm1's output is dead)
  status = gptlocal_core_linear_fwd(s, p.fc2_w, d.bias ? p.fc2_b : nullptr, m, T, I, H, lo);
  if (status == 0) status = hidden_dropout(m, T * H, 2, d, in, o);
  if (status != Status::kOk) return status;
  if (d.parallel) {
    add3(in.hidden, attn, m, out, T * H, o);
  } else {
    add(saved.h, m, out, T * H, o);
  }
  return 0;
}

// ------------------------------------------------------------------------------------------------ backward
int backward(const Dims &d, const Inputs &in, const Params &p, const TrainLayerOptions &o, const Saved &saved,
             const float *dy, const Grads &g, const Buffers &w) {
  const int64_t T = d.T, H = d.H, I = d.I, mlp_width = I * (d.gated ? 2 : 1);
  const LinearOptions lo = linear_options(o);
  int status = 0;
  // the MLP's branch: dm = drop(dy)
  const float *dm = dy;
  if (o.hidden_dropout_mode != 0) {
    std::memcpy(w.dm, dy, sizeof(float) * T * H);
    status = hidden_dropout(w.dm, T * H, 2, d, in, o);
    dm = w.dm;
  }
  // norm2 again, the MLP's saved GEMM outputs (widened under bf16) and its activation again
  const float *mlp_in = d.parallel ? in.hidden : saved.h;
  float *b = w.normed2;
  if (status == 0) status = norm_forward(mlp_in, p.norm2_w, p.norm2_b, b, w.stats, d, o);
  if (status != Status::kOk) return status;
  float *mlp = saved.mlp;
  if (d.bf16) {
    mlp = w.widened;
    to_full(saved.mlp16, mlp, T * mlp_width, o);
  }
  float *zeros = w.zeros, *dbias_unused = w.zeros + I;  // a GeLU layer without biases: its stand-in bias and sums
  std::fill(zeros, zeros + I, 0.0f);
  float *s = w.act;
  if (d.gated) {
    status = gptlocal_core_swiglu_fwd(mlp, mlp + T * I, s, T * I, ThreadOptions{o.threads});
  } else {
    status = gptlocal_core_bias_gelu_fwd(mlp, d.bias ? p.fc1_b : zeros, s, T, I,
                                         BiasGeluOptions{d.quick ? MlpForm::kQuick : MlpForm::kTanh, o.threads});
  }
  // fc2: ds, dW2, db2
  float *ds = w.ds;
  if (status == 0) status = gptlocal_core_linear_bwd(s, p.fc2_w, dm, ds, g.dfc2_w, T, I, H, lo);
  if (status != Status::kOk) return status;
  if (d.bias) column_sums(dm, T, H, g.dfc2_b, o);
  // the activation's backward, then fc1 (and the gate): db
  float *dmlp = w.dmlp, *db = w.db;
  if (d.gated) {
    status = gptlocal_core_swiglu_bwd(mlp, mlp + T * I, ds, dmlp, dmlp + T * I, T * I, ThreadOptions{o.threads});
    float *db_up = w.db_up;
    if (status == 0) status = gptlocal_core_linear_bwd(b, p.gate_w, dmlp, db, g.dgate_w, T, H, I, lo);
    if (status == 0) status = gptlocal_core_linear_bwd(b, p.fc1_w, dmlp + T * I, db_up, g.dfc1_w, T, H, I, lo);
    if (status != Status::kOk) return status;
    add(db, db_up, db, T * H, o);
    if (d.bias) {
      column_sums(dmlp, T, I, g.dgate_b, o);
      column_sums(dmlp + T * I, T, I, g.dfc1_b, o);
    }
  } else {
    status = gptlocal_core_bias_gelu_bwd(mlp, d.bias ? p.fc1_b : zeros, ds, dmlp, d.bias ? g.dfc1_b : dbias_unused, T,
                                         I, BiasGeluOptions{d.quick ? MlpForm::kQuick : MlpForm::kTanh, o.threads});
    if (status == 0) status = gptlocal_core_linear_bwd(b, p.fc1_w, dmlp, db, g.dfc1_w, T, H, I, lo);
    if (status != Status::kOk) return status;
  }
  // norm2's backward: dn2 (dm is dead)
  float *dn2 = w.dn2;
  status = norm_backward(mlp_in, p.norm2_w, w.stats, db, dn2, g.dnorm2_w, g.dnorm2_b, d, o);
  if (status != Status::kOk) return status;
  // the residual: dh (norm2's output is dead); the attention's branch: dattn = drop(dh) (db is dead)
  const float *dh = dy;
  if (!d.parallel) {
    add(dy, dn2, w.dh, T * H, o);
    dh = w.dh;
  }
  const float *dattn = dh;
  if (o.hidden_dropout_mode != 0) {
    std::memcpy(w.dattn, dh, sizeof(float) * T * H);
    status = hidden_dropout(w.dattn, T * H, 1, d, in, o);
    if (status != Status::kOk) return status;
    dattn = w.dattn;
  }
  // the projection: ctx (widened under bf16), dctx (the activation is dead), dWproj, dbproj
  float *ctx = saved.ctx;
  if (d.bf16) {
    ctx = w.widened;
    to_full(saved.ctx16, ctx, T * d.ND, o);
  }
  float *dctx = w.dctx;
  status = gptlocal_core_linear_bwd(ctx, p.proj_w, dattn, dctx, g.dproj_w, T, d.ND, H, lo);
  if (status != Status::kOk) return status;
  if (d.bias) column_sums(dattn, T, H, g.dproj_b, o);
  // attention's inputs again: qkv (widened under bf16: ds is dead), the heads (the activation's gradient is dead),
  // rope's raw heads; ctx and dctx as heads
  float *qkv = saved.qkv;
  if (d.bf16) {
    qkv = w.qkv32;
    to_full(saved.qkv16, qkv, T * d.Q, o);
  }
  float *q = w.heads, *k = q + T * d.ND, *v = k + T * d.G * d.D, *raw = w.raw, *raw_k = raw + T * d.ND;
  status = attention_inputs(qkv, q, k, v, raw, d, in, o);
  if (status != Status::kOk) return status;
  float *ctx_heads = w.ctx_heads, *dctx_heads = w.dctx_heads;
  context<false>(ctx, ctx_heads, d, o);
  context<false>(dctx, dctx_heads, d, o);
  // attention's backward: dq, dk, dv; rope's backward into the raw heads; dqkv in the fused layout
  float *dq = w.dheads, *dk = dq + T * d.ND, *dv = dk + T * d.G * d.D;
  status = gptlocal_core_attention_bwd(q, k, v, in.mask, in.attention_t1, in.attention_t2, in.offsets, ctx_heads,
                                       saved.lse, dctx_heads, dq, dk, dv, d.B, d.N, d.S, d.D, d.G, d.Bb, d.PA1, d.PA2,
                                       attention_options(o));
  if (status != Status::kOk) return status;
  float *dqkv = w.dqkv;  // (qkv is dead)
  if (d.rope) {
    status = gptlocal_core_rope_bwd(dq, in.cos, in.sin, raw, d.B, d.N, d.S, d.D, d.Bc, d.R, ThreadOptions{o.threads});
    if (status == 0) {
      status = gptlocal_core_rope_bwd(dk, in.cos, in.sin, raw_k, d.B, d.G, d.S, d.D, d.Bc, d.R,
                                      ThreadOptions{o.threads});
    }
    if (status != Status::kOk) return status;
    heads<true>(dqkv, raw, raw_k, dv, d, o);
  } else {
    heads<true>(dqkv, dq, dk, dv, d, o);
  }
  if (d.qkv_bias) column_sums(dqkv, T, d.Q, g.dqkv_b, o);
  // norm1 again (dattn is dead), QKV's backward: da (dctx is dead), norm1's backward: dn1 (ctx as heads is dead)
  float *a = w.normed1;
  status = norm_forward(in.hidden, p.norm1_w, p.norm1_b, a, w.stats, d, o);
  float *da = w.da;
  if (status == 0) status = gptlocal_core_linear_bwd(a, p.qkv_w, dqkv, da, g.dqkv_w, T, H, d.Q, lo);
  float *dn1 = w.dn1;
  if (status == 0) status = norm_backward(in.hidden, p.norm1_w, w.stats, da, dn1, g.dnorm1_w, g.dnorm1_b, d, o);
  if (status != Status::kOk) return status;
  if (d.parallel) {
    add3(dh, dn1, dn2, g.dhidden, T * H, o);
  } else {
    add(dh, dn1, g.dhidden, T * H, o);
  }
  return 0;
}

// The gradients of the absent parameters (their one-element stand-ins, or a GeLU layer's gate): zeros.
void zero_absent(const Dims &d, int64_t Hn, int64_t Qb, int64_t Hb, int64_t Ib, int64_t Ig, int64_t Igb,
                 const Grads &g) {
  if (!d.layer_norm) {
    std::fill(g.dnorm1_b, g.dnorm1_b + Hn, 0.0f);
    std::fill(g.dnorm2_b, g.dnorm2_b + Hn, 0.0f);
  }
  if (!d.qkv_bias) std::fill(g.dqkv_b, g.dqkv_b + Qb, 0.0f);
  if (!d.bias) {
    std::fill(g.dproj_b, g.dproj_b + Hb, 0.0f);
    std::fill(g.dfc2_b, g.dfc2_b + Hb, 0.0f);
    std::fill(g.dfc1_b, g.dfc1_b + Ib, 0.0f);
  }
  if (!d.gated) std::fill(g.dgate_w, g.dgate_w + Ig * d.H, 0.0f);
  if (!d.gated || !d.bias) std::fill(g.dgate_b, g.dgate_b + Igb, 0.0f);
}

}  // namespace

int gptlocal_core_train_layer_fwd(const TrainLayerInputs &in, const TrainLayerParams &p, float *out, int32_t *ticket,
                                  int64_t B, int64_t S, int64_t H, int64_t Bb, int64_t Bc, int64_t Sr, int64_t R,
                                  int64_t PA1, int64_t PA2, int64_t PH1, int64_t PH2, int64_t Hn, int64_t Q, int64_t Qb,
                                  int64_t ND, int64_t Hb, int64_t I, int64_t Ib, int64_t Ig, int64_t Igb,
                                  const TrainLayerOptions &options) {
  Dims d;
  const int checked = read_dims(B, S, H, Bb, Bc, Sr, R, PA1, PA2, PH1, PH2, Hn, Q, Qb, ND, Hb, I, Ib, Ig, Igb,
                                in.offsets, options, &d);
  if (checked != Status::kOk) return checked;
  State &st = state();
  std::lock_guard<std::mutex> hold(st.lock);
  Slot &slot = st.slots[options.slot];
  slot.generation = 0;  // until this forward has written it
  const Saved saved = carve(&slot, d);
  const int status = forward(d, in, p, options, saved, out, buffers(d, st.workspace));
  if (status != 0) return status;
  slot.generation = ++st.generation;
  slot.shape = shape_of(d);
  ++st.forwards;
  ticket[0] = options.slot;
  ticket[1] = static_cast<int32_t>(slot.generation & 0x7fffffff);
  return 0;
}

int gptlocal_core_train_layer_bwd(const TrainLayerInputs &in, const TrainLayerParams &p, const int32_t *ticket,
                                  const float *dout, const TrainLayerGrads &g, int64_t B, int64_t S, int64_t H,
                                  int64_t Bb, int64_t Bc, int64_t Sr, int64_t R, int64_t PA1, int64_t PA2, int64_t PH1,
                                  int64_t PH2, int64_t Hn, int64_t Q, int64_t Qb, int64_t ND, int64_t Hb, int64_t I,
                                  int64_t Ib, int64_t Ig, int64_t Igb, const TrainLayerOptions &options) {
  Dims d;
  const int checked = read_dims(B, S, H, Bb, Bc, Sr, R, PA1, PA2, PH1, PH2, Hn, Q, Qb, ND, Hb, I, Ib, Ig, Igb,
                                in.offsets, options, &d);
  if (checked != Status::kOk) return checked;
  State &st = state();
  std::lock_guard<std::mutex> hold(st.lock);
  zero_absent(d, Hn, Qb, Hb, Ib, Ig, Igb, g);
  Slot &slot = st.slots[options.slot];
  const bool paired = ticket[0] == options.slot && slot.generation != 0 &&
                      static_cast<int32_t>(slot.generation & 0x7fffffff) == ticket[1] && slot.shape == shape_of(d);
  const Saved saved = carve(&slot, d);
  const Buffers w = buffers(d, st.workspace);
  if (!paired) {  // the slot holds another forward's activations (or none): this one's again, from its inputs
    slot.generation = 0;
    const int status = forward(d, in, p, options, saved, w.out, w);
    if (status != 0) return status;
    slot.generation = ++st.generation;
    slot.shape = shape_of(d);
    ++st.recomputed;
  }
  ++st.backwards;
  return backward(d, in, p, options, saved, dout, g, w);
}

// Frees a layer's slot (its Cell is gone); 0.
int gptlocal_train_layer_release(int32_t slot) {
  State &st = state();
  std::lock_guard<std::mutex> hold(st.lock);
  st.slots.erase(slot);
  return 0;
}

// out[0..5]: forwards, backwards, backwards that ran their forward again (not paired with their slot), the slots'
// bytes, the workspace's bytes, the slots held.
void gptlocal_train_layer_stats(int64_t *out) {
  State &st = state();
  std::lock_guard<std::mutex> hold(st.lock);
  int64_t held = 0;
  for (const auto &entry : st.slots) {
    held += static_cast<int64_t>(entry.second.full.size() * sizeof(float) + entry.second.half.size() * 2);
  }
  out[0] = st.forwards, out[1] = st.backwards, out[2] = st.recomputed, out[3] = held;
  out[4] = st.workspace.bytes(), out[5] = static_cast<int64_t>(st.slots.size());
}
