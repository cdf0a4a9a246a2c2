// One GPT-2 decoder layer of a decode step (one new token per row) in one call: the typed cores of
// gptlocal_decode_layer_fwd, _int8_fwd and _bf16w_fwd (gpt_local, kernels/table.py; kernels/decode_layer.py;
// model/gpt.py GPTLocalBlock).
//
// Why: the plain decode graph runs ~20-30 small MindSpore ops a layer (norm, GEMM, bias add, reshapes and
// transposes of the heads, the cache writes, the masked softmax over the cache, ...); for one token a row each costs
// more in dispatch than in arithmetic. Here the layer is one node:
//   LayerNorm -> x Wqkv^T + b -> this token's K, V written IN PLACE into the layer's caches at (slot, head,
//   position) -> each head's query over its row's cached keys 0..position (+ the additive bias of those keys) ->
//   ctx Wproj^T + b -> + hidden -> LayerNorm -> x W1^T, bias + GeLU -> x W2^T + b -> + residual.
// The norms, GEMMs and bias + GeLU are the library's own typed cores (cpu_layernorm.cc, cpu_linear.cc,
// cpu_linear_int8.cc, cpu_bias_gelu.cc: called as C++ functions, so the same code and the same column-block
// threading over oneDNN's GEMMs as the model's plain graph with those kernels); the cache write and the attention
// over the cache are here.
//
// The tensors (kernels/table.py decode_layer_inputs): hidden [B, 1, H]; ln1 gamma, beta [H]; Wqkv [Q, H], bqkv [Q]
// (Q = (N + 2G) D, group-major [G, (N/G q heads, k, v), D]); Wproj [H, N D], bproj [H]; ln2 gamma, beta [H];
// W1 [I, H], b1 [I]; W2 [H, I], b2 [H]; the key and value caches [Bc, G, L, D] (Parameters, written IN PLACE);
// write_index int32 [B, G, 1, 3] ((slot, head, position), KVCache.write_index); bias [B or 1, 1, 1, L]
// (KVCache.attention_bias: 0 on rows 0..position, MASK_VALUE after) -> the new hidden [B, 1, H].
// DecodeLayerOptions: epsilon, scale, form 0 tanh / 1 quick GeLU, threads, precision (the GEMMs' LinearOptions
// precision: 0 float32, 1 bf16 x bf16 -> f32, 2 the same emulated).
// The int8 layer (model/quant_cells.py QuantLinear): each weight int8 [out, in] followed by its float32 per-channel
// scales [out]; its GEMMs cpu_linear_int8.cc's, the input quantized per row; precision 0. The bf16 layer: the four
// weights held as bfloat16 (a bf16 model built for inference, provider.py bf16_weights; precision 1 or 2), its GEMMs
// cpu_linear.cc's linear_bf16w_fwd, the numbers of that model's plain decode graph.
// Row b's query attends to its slot's keys 0..position (what the bias keeps; the keys after it are masked by the
// bias in the plain graph, and skipped here). Scratch: per-thread buffers kept across calls (grown, never shrunk).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

VEC_CLONES float dot_row(const float *a, const float *b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

VEC_CLONES void add_scaled(float *acc, const float *x, float f, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) acc[j] += f * x[j];
}

VEC_CLONES void add_into(float *y, const float *x, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] += x[j];
}

// softmax(q k_j * scale + bias_j) v_j over keys j = 0..count-1 into out [D]; scores: [count] scratch.
void attend(const float *q, const float *K, const float *V, const float *bias, int64_t count, int64_t D, float scale,
            float *scores, float *out) {
  float m = -INFINITY;
  for (int64_t j = 0; j < count; ++j) {
    const float s = dot_row(q, K + j * D, D) * scale + bias[j];
    scores[j] = s;
    m = s > m ? s : m;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    const float e = exp_neg(scores[j] - m);
    scores[j] = e;
    sum += e;
  }
  std::fill(out, out + D, 0.0f);
  for (int64_t j = 0; j < count; ++j) add_scaled(out, V + j * D, scores[j], D);
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// The calling thread's scratch, kept across calls (a decode step calls each layer once a token: no allocation
// after the first calls).
std::vector<float> &scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer;
}

// One Linear of the layer: its weight (float32, bfloat16 bits or int8), an int8 weight's per-channel scales, its bias.
template <class Weight>
struct LayerLinear {
  const Weight *w;
  const float *scale;
  const float *b;
};

template <class Weight>
struct LayerWeights {
  const float *ln1_gamma, *ln1_beta;
  LayerLinear<Weight> qkv, proj;
  const float *ln2_gamma, *ln2_beta;
  LayerLinear<Weight> fc1, fc2;
};

// y [T, width] = x [T, in] W^T (+ b, where not null) through the core of the weight's dtype, in the layer's precision.
int linear(const LayerLinear<float> &l, const float *x, const float *b, float *y, int64_t T, int64_t in, int64_t width,
           const DecodeLayerOptions &o) {
  return gptlocal_core_linear_fwd(x, l.w, b, y, T, in, width, LinearOptions{o.threads, o.precision});
}
int linear(const LayerLinear<uint16_t> &l, const float *x, const float *b, float *y, int64_t T, int64_t in,
           int64_t width, const DecodeLayerOptions &o) {
  return gptlocal_core_linear_bf16w_fwd(x, l.w, b, y, T, in, width, LinearOptions{o.threads, o.precision});
}
int linear(const LayerLinear<int8_t> &l, const float *x, const float *b, float *y, int64_t T, int64_t in,
           int64_t width, const DecodeLayerOptions &o) {
  return gptlocal_core_int8_linear_fwd(x, l.w, l.scale, b, y, T, in, width, ThreadOptions{o.threads});
}

// The GEMMs' precision each weight dtype takes: float32 weights any (0, or rounded to bf16 at each call), bf16 ones 1
// or 2, int8 ones 0.
bool precision_fits(const float *, int precision) { return precision >= 0 && precision <= 2; }
bool precision_fits(const uint16_t *, int precision) { return precision == 1 || precision == 2; }
bool precision_fits(const int8_t *, int precision) { return precision == 0; }

template <class Weight>
int decode_layer(const float *hidden, const LayerWeights<Weight> &w, float *key_cache, float *value_cache,
                 const int32_t *index, const float *bias, float *out, int64_t B, int64_t H, int64_t Q, int64_t ND,
                 int64_t I, int64_t Bc, int64_t G, int64_t L, int64_t D, int64_t Bb, const DecodeLayerOptions &o) {
  if (!precision_fits(w.qkv.w, o.precision)) return 1;
  if (G <= 0 || D <= 0 || ND % D != 0 || (Bb != 1 && Bb != B)) return 2;
  const int64_t N = ND / D, group = N / G;
  if (N % G != 0 || Q != (N + 2 * G) * D) return 2;
  if (B == 0) return 0;
  // where each row writes and how many keys it reads: every (slot, head, position) checked before anything is written
  int64_t keys = 0;  // key rows read, over rows and heads: the attention's work
  for (int64_t bg = 0; bg < B * G; ++bg) {
    const int32_t *at = index + bg * 3;
    if (at[0] < 0 || at[0] >= Bc || at[1] != bg % G || at[2] < 0 || at[2] >= L) return 4;
    keys += (at[2] + 1) * group;
  }

  std::vector<float> &buffer = scratch(static_cast<size_t>(B * (3 * H + Q + ND + I + 2)));
  float *normed = buffer.data(), *qkv = normed + B * H, *context = qkv + B * Q, *mid = context + B * ND,
        *inner = mid + B * H, *moments = inner + B * I, *swap = moments + 2 * B;  // swap: [B, H]
  const LayerNormOptions norm_options{o.epsilon, o.threads};
  auto norm = [&](const float *x, const float *gamma, const float *beta, float *y) {
    return gptlocal_core_layernorm_fwd(x, gamma, beta, y, moments, moments + B, B, H, norm_options);
  };

  // LayerNorm, QKV
  int status = norm(hidden, w.ln1_gamma, w.ln1_beta, normed);
  if (status == 0) status = linear(w.qkv, normed, w.qkv.b, qkv, B, H, Q, o);
  if (status != 0) return 10 + status;
  // this token's keys and values into the caches, in place
  for (int64_t bg = 0; bg < B * G; ++bg) {
    const int32_t *at = index + bg * 3;
    const int64_t b = bg / G, g = bg % G;
    const int64_t row = ((static_cast<int64_t>(at[0]) * G + g) * L + at[2]) * D;
    const float *k = qkv + b * Q + (g * (group + 2) + group) * D;
    std::memcpy(key_cache + row, k, sizeof(float) * D);
    std::memcpy(value_cache + row, k + D, sizeof(float) * D);
  }
  // each (row, head): its query over its slot's keys 0..position
  const int64_t tasks = B * N;
  run_parallel(threads_for(o.threads, keys * D), tasks, [&](std::atomic<int64_t> &next, int) {
    std::vector<float> scores(static_cast<size_t>(L));
    for (int64_t task = next.fetch_add(1); task < tasks; task = next.fetch_add(1)) {
      const int64_t b = task / N, n = task % N, g = n / group;
      const int32_t *at = index + (b * G + g) * 3;
      const int64_t base = (static_cast<int64_t>(at[0]) * G + g) * L * D;
      attend(qkv + b * Q + (g * (group + 2) + n % group) * D, key_cache + base, value_cache + base,
             bias + (Bb == 1 ? 0 : b) * L, at[2] + 1, D, o.scale, scores.data(),
             context + b * ND + n * D);
    }
  });
  // projection + residual, LayerNorm, fc1 + bias + GeLU, fc2 + residual
  status = linear(w.proj, context, w.proj.b, mid, B, ND, H, o);
  if (status != 0) return 20 + status;
  for (int64_t b = 0; b < B; ++b) add_into(mid + b * H, hidden + b * H, H);
  status = norm(mid, w.ln2_gamma, w.ln2_beta, normed);
  if (status == 0) status = linear(w.fc1, normed, nullptr, inner, B, H, I, o);
  if (status == 0) {
    status = gptlocal_core_bias_gelu_fwd(inner, w.fc1.b, inner, B, I, BiasGeluOptions{o.form, o.threads});
  }
  if (status == 0) status = linear(w.fc2, inner, w.fc2.b, swap, B, I, H, o);
  if (status != 0) return 30 + status;
  for (int64_t b = 0; b < B; ++b) {
    const float *x = swap + b * H, *r = mid + b * H;
    float *y = out + b * H;
    for (int64_t h = 0; h < H; ++h) y[h] = r[h] + x[h];
  }
  return 0;
}

}  // namespace

// The float32 layer and the bfloat16-weight one: one body, two typed cores (their weights' pointer types differ).
#define GPTLOCAL_PLAIN_DECODE_LAYER(name, Weight)                                                                      \
  int name(const float *hidden, const float *ln1_gamma, const float *ln1_beta, const Weight *qkv_w,                    \
           const float *qkv_b, const Weight *proj_w, const float *proj_b, const float *ln2_gamma,                      \
           const float *ln2_beta, const Weight *fc1_w, const float *fc1_b, const Weight *fc2_w,                        \
           const float *fc2_b, float *key_cache, float *value_cache, const int32_t *write_index,                       \
           const float *bias, float *out, int64_t B, int64_t H, int64_t Q, int64_t ND, int64_t I, int64_t Bc,          \
           int64_t G, int64_t L, int64_t D, int64_t Bb, const DecodeLayerOptions &options) {                           \
    const LayerWeights<Weight> w{ln1_gamma, ln1_beta, {qkv_w, nullptr, qkv_b}, {proj_w, nullptr, proj_b},              \
                                 ln2_gamma, ln2_beta, {fc1_w, nullptr, fc1_b}, {fc2_w, nullptr, fc2_b}};               \
    return decode_layer(hidden, w, key_cache, value_cache, write_index, bias, out, B, H, Q, ND, I, Bc, G, L, D, Bb,    \
                        options);                                                                                      \
  }

GPTLOCAL_PLAIN_DECODE_LAYER(gptlocal_core_decode_layer_fwd, float)
GPTLOCAL_PLAIN_DECODE_LAYER(gptlocal_core_decode_layer_bf16w_fwd, uint16_t)

int gptlocal_core_decode_layer_int8_fwd(const float *hidden, const float *ln1_gamma, const float *ln1_beta,
                                        const int8_t *qkv_w, const float *qkv_scale, const float *qkv_b,
                                        const int8_t *proj_w, const float *proj_scale, const float *proj_b,
                                        const float *ln2_gamma, const float *ln2_beta, const int8_t *fc1_w,
                                        const float *fc1_scale, const float *fc1_b, const int8_t *fc2_w,
                                        const float *fc2_scale, const float *fc2_b, float *key_cache,
                                        float *value_cache, const int32_t *write_index, const float *bias, float *out,
                                        int64_t B, int64_t H, int64_t Q, int64_t ND, int64_t I, int64_t Bc, int64_t G,
                                        int64_t L, int64_t D, int64_t Bb, const DecodeLayerOptions &options) {
  const LayerWeights<int8_t> w{ln1_gamma, ln1_beta, {qkv_w, qkv_scale, qkv_b}, {proj_w, proj_scale, proj_b},
                               ln2_gamma, ln2_beta, {fc1_w, fc1_scale, fc1_b}, {fc2_w, fc2_scale, fc2_b}};
  return decode_layer(hidden, w, key_cache, value_cache, write_index, bias, out, B, H, Q, ND, I, Bc, G, L, D, Bb,
                      options);
}
