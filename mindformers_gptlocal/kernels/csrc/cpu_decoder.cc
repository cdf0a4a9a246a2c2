// The decoder of a gpt_local model over its KV cache, for CPU inference: every layer layout the model builds, one
// call per step (gpt_local, kernels/abi/table.py: gptlocal_decoder_step, gptlocal_decoder_workspace; runtime/native.py
// NativeRunner calls them through ctypes), and the one layer function the graph's decode-layer node calls too
// (cpu_decode_layer.cc, kernels/cells/decode_layer.py).
//
// Why: a MindSpore graph costs ~50-200 us a node call and a Llama-style layer is ~20-30 ops, so a decode step of a
// 124M model spent more in dispatch than in streaming its weights. Here the whole step is one C++ call composed from
// the library's typed cores (CTranslate2's layers composed from ops, llama.cpp's one-call graph):
//   tokens -> embedding (float32 or int8 rows x their scales; + learned positions) -> each layer -> the final norm of
//   the rows whose logits are asked -> the head (logits, or only their argmax: greedy decoding copies no logits).
// A layer (layer_forward), for T = B x S token rows, row (b, s) at its own position pos[b S + s] of slot slot[b]:
//   n = norm1(x) (LayerNorm or RMSNorm: cpu_layernorm.cc, cpu_rmsnorm.cc) -> qkv = n Wqkv^T (+ b), group-major
//   [G, (N/G query heads, k, v), D] (model/attention.py) -> rope (rotate_half on the first R channels of each query
//   and key head, cos/sin per row) -> every row's key and value written IN PLACE into the layer's caches [Bc, G, L,
//   D] at (slot, g, position) -> attention of each query row over its slot's rows 0..position (cache_attention) ->
//   a = ctx Wproj^T (+ b) -> sequential: h = x + a, out = h + mlp(norm2(h)); NeoX's parallel residual:
//   out = (x + a) + mlp(norm2(x)); mlp: fc2(act(fc1(n))) (GeLU tanh / quick / erf, ReLU) or SwiGLU
//   fc2(silu(gate(n)) * fc1(n)) (cpu_swiglu.cc).
// Attention of S > 1 rows (a prefill, the server's chunks and refills) writes all S rows' keys first, then each
// query reads its slot's rows 0..position: the compiled graphs' semantics (KVCache.attention_bias masks the rest).
//
// Weights (the GEMMs: `linear` below): float32 (up to kFloatFewRows rows, a decode step's, through few_rows below:
// each weight row streamed once past tiles of 4 rows, AVX2 FMA, no packing; more rows through cpu_linear.cc's
// gptlocal_core_linear_fwd, oneDNN's sgemm; a bf16 model built for training rounds them at each call there,
// LinearOptions.precision 1 or 2), bfloat16 (an inference build's bf16_weights: up to kBf16FewRows rows through
// few_rows, x rounded to bfloat16 and the weight widened as it streams, the numbers of cpu_linear.cc's
// linear_bf16w_fwd up to the order of the sums; more rows through that core) or int8 with per-channel scales
// (gptlocal quantize; int8_rows_* below, any row count: x quantized per row exactly as cpu_linear_int8.cc does, the
// s8 x s8 products summed exactly in int32 with AVX2's maddubs/madd (|x| as u8 times w with x's sign: no pair sum
// saturates at |w| <= 127), so its numbers are the plain int8 scheme's, model/quant_cells.py).
// Memory: the runner owns the caches and one workspace (gptlocal_decoder_workspace bytes for its largest call);
// every temporary of a call is carved from it, nothing is allocated per step but the attention's per-thread scores
// (thread_local, grown, kept).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "common.h"
#include "cpu_decoder.h"

namespace {

using gptlocal::decoder::Arena;
using gptlocal::decoder::LayerShape;
using gptlocal::decoder::LayerWeights;
using gptlocal::decoder::Rows;

// float32 and bf16 weights: up to this many rows through few_rows, more through cpu_linear.cc's cores. Measured (one
// thread, a cold 2,048 x 768 float32 weight, min of 40, AMD EPYC Zen 3): few_rows 0.33 / 0.37 / 0.63 / 1.15 / 2.17
// ms at 1 / 4 / 8 / 16 / 32 rows, oneDNN's sgemm 0.31 / 0.49 / 0.63 / 0.88 / 1.41 ms. bf16 weights: the same where
// oneDNN has a bf16 GEMM for this CPU (precision 1); where it emulates one (precision 2: the weight widened to float32
// at each call) few_rows, which widens as it streams, up to kBf16FewRows
constexpr int64_t kFloatFewRows = 8;
constexpr int64_t kBf16FewRows = 32;
constexpr int64_t kQueryBlock = 16;   // attention: query positions of one row per task
// the few-row GEMMs: the columns in blocks of this many, each block's weight rows (16 x K: 32 KB of int8, 64 KB of
// bf16 at K 2,048) kept in cache while every tile of 4 rows of x passes them (rows outer per column would read all
// of x again for each column: a prefill's x no longer fits in cache)
constexpr int64_t kColumnBlock = 16;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// The AVX2 + FMA intrinsics below run where the library's ISA decision allows them (common.h vec_tier: the CPU's
// flags under model_config.cpu_kernels.isa), else the plain loops (rows_plain, int8_rows_plain): both testable on
// any AVX2 machine by capping the ISA at scalar.
bool has_avx2() { return gptlocal::vec_tier() >= kIsaAvx2; }

// ------------------------------------------------------------------------------------------------ float weights
// A float32 weight, or a bfloat16 one's bits widened (exact).
inline float weight_value(float w) { return w; }
inline float weight_value(uint16_t w) { return bf16_value(w); }

// y[t, n] = sum_k x[t, k] w[n, k] (+ b[n]) for columns n0..n1: x float32 (a bf16 GEMM's: already rounded to bfloat16),
// w float32 or bfloat16 bits.
template <class W>
void rows_plain(const float *x, const W *w, const float *b, float *y, int64_t T, int64_t K, int64_t N, int64_t n0,
                int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const W *wr = w + n * K;
    for (int64_t t = 0; t < T; ++t) {
      const float *xr = x + t * K;
      float sum = 0.0f;
      for (int64_t k = 0; k < K; ++k) sum += xr[k] * weight_value(wr[k]);
      y[t * N + n] = b != nullptr ? sum + b[n] : sum;
    }
  }
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma"))) inline int32_t hsum8i(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
  return _mm_cvtsi128_si32(s);
}

// 8 weights as float32: loaded, or bfloat16 bits widened.
__attribute__((target("avx2,fma"))) inline __m256 load8(const float *w) { return _mm256_loadu_ps(w); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t *w) {
  const __m256i bits = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i *>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(bits, 16));
}

// R rows (1..4) of x against one weight row: the weight read once from memory, the rows from L1.
template <int R, class W>
__attribute__((target("avx2,fma"))) void rows_tile(const float *x, const W *wr, const float *b, float *y, int64_t K,
                                                   int64_t N, int64_t n) {
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 wv = load8(wr + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), wv, acc[r]);
  }
  for (int r = 0; r < R; ++r) {
    float sum = hsum8(acc[r]);
    for (int64_t k = K8; k < K; ++k) sum += x[r * K + k] * weight_value(wr[k]);
    y[r * N + n] = b != nullptr ? sum + b[n] : sum;
  }
}

// One row of x against 4 float32 weight rows n .. n + 3 (a decode step's GEMV): four independent FMA chains and four
// weight streams in flight at once, where one row at a time waits on its single chain (Llama-style ~124M, batch 1:
// 54-61 -> 58-69 tok/s). Each output's sum is formed in the same order as rows_tile<1>'s (the same lanes, k
// ascending, then hsum8 and the tail): the same numbers.
template <class W>
__attribute__((target("avx2,fma"))) void gemv_tile4(const float *x, const W *w, const float *b, float *y, int64_t K,
                                                    int64_t n) {
  const W *w0 = w + n * K, *w1 = w0 + K, *w2 = w1 + K, *w3 = w2 + K;
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t(7);
  for (int64_t k = 0; k < K8; k += 8) {
    const __m256 xv = _mm256_loadu_ps(x + k);
    a0 = _mm256_fmadd_ps(xv, load8(w0 + k), a0);
    a1 = _mm256_fmadd_ps(xv, load8(w1 + k), a1);
    a2 = _mm256_fmadd_ps(xv, load8(w2 + k), a2);
    a3 = _mm256_fmadd_ps(xv, load8(w3 + k), a3);
  }
  const __m256 acc[4] = {a0, a1, a2, a3};
  const W *rows[4] = {w0, w1, w2, w3};
  for (int r = 0; r < 4; ++r) {
    float sum = hsum8(acc[r]);
    for (int64_t k = K8; k < K; ++k) sum += x[k] * weight_value(rows[r][k]);
    y[n + r] = b != nullptr ? sum + b[n + r] : sum;
  }
}

template <class W>
__attribute__((target("avx2,fma"))) void rows_avx2(const float *x, const W *w, const float *b, float *y, int64_t T,
                                                   int64_t K, int64_t N, int64_t n0, int64_t n1) {
  if (T == 1 && sizeof(W) == sizeof(float)) {  // a float32 GEMV: four weight rows at a time (bf16 weights: the
    // widening of four streams measured slower than one row at a time, 84-87 against 95-97 tok/s, Llama-style ~124M)
    int64_t n = n0;
    for (; n + 4 <= n1; n += 4) gemv_tile4(x, w, b, y, K, n);
    for (; n < n1; ++n) rows_tile<1>(x, w + n * K, b, y, K, N, n);
    return;
  }
  for (int64_t block = n0; block < n1; block += kColumnBlock) {
    const int64_t end = std::min(n1, block + kColumnBlock);
    for (int64_t t = 0; t < T; t += 4) {
      const float *xt = x + t * K;
      float *out = y + t * N;
      const int64_t rows = std::min<int64_t>(4, T - t);
      for (int64_t n = block; n < end; ++n) {
        const W *wr = w + n * K;
        switch (rows) {
          case 4: rows_tile<4>(xt, wr, b, out, K, N, n); break;
          case 3: rows_tile<3>(xt, wr, b, out, K, N, n); break;
          case 2: rows_tile<2>(xt, wr, b, out, K, N, n); break;
          default: rows_tile<1>(xt, wr, b, out, K, N, n); break;
        }
      }
    }
  }
}
#endif

// The few-row GEMM of a float32 or bfloat16 weight over column blocks on `threads` threads (AVX2 where the ISA
// decision allows it: has_avx2).
template <class W>
void few_rows(int threads, const float *x, const W *w, const float *b, float *y, int64_t T, int64_t K, int64_t N) {
  column_blocks(gemm_threads(threads, T * N * K), N, [&](int64_t n0, int64_t n1) {
#if defined(__x86_64__)
    if (has_avx2()) return rows_avx2(x, w, b, y, T, K, N, n0, n1);
#endif
    rows_plain(x, w, b, y, T, K, N, n0, n1);
  });
}

// ------------------------------------------------------------------------------------------------ int8 weights
// Row x [K] as int8 q and its scale (common.h's quantize_row, as the int8 Linear quantizes), |q| into aq.
void quantize_row(const float *x, int64_t K, int8_t *q, int8_t *aq, float *scale) {
  quantize_row(x, K, q, scale);
  for (int64_t k = 0; k < K; ++k) aq[k] = static_cast<int8_t>(q[k] < 0 ? -q[k] : q[k]);
}

// The int8 GEMM's tiers (int8_gemm below): each exact int32 sum q[t] . w[n] for columns n0..n1 handed to
// out(t, n, sum). The plain loops, for any int8 operands:
template <class Out>
void int8_rows_plain(const int8_t *q, const int8_t *w, int64_t T, int64_t K, int64_t n0, int64_t n1,
                     const Out &out) {
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t *wr = w + n * K;
    for (int64_t t = 0; t < T; ++t) {
      const int8_t *x = q + t * K;
      int32_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += static_cast<int32_t>(x[k]) * static_cast<int32_t>(wr[k]);
      out(t, n, acc);
    }
  }
}

#if defined(__x86_64__)
// AVX2's, for operands in [-127, 127] (the scheme's: quantize_row's rows, `gptlocal quantize`'s weights): R rows
// (1..4) of q (aq: their |q|) against weight row n.
template <int R, class Out>
__attribute__((target("avx2,fma"))) void int8_tile(const int8_t *q, const int8_t *aq, const int8_t *wr, int64_t K,
                                                   int64_t t, int64_t n, const Out &out) {
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t K32 = K & ~int64_t(31);
  for (int64_t k = 0; k < K32; k += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(wr + k));
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(q + r * K + k));
      const __m256i av = _mm256_loadu_si256(reinterpret_cast<const __m256i *>(aq + r * K + k));
      // |x| (u8) times w with x's sign: x w exactly; a pair's sum <= 2 * 127 * 127 < 2^15 (no saturation)
      const __m256i pairs = _mm256_maddubs_epi16(av, _mm256_sign_epi8(wv, xv));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(pairs, ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    int32_t sum = hsum8i(acc[r]);
    for (int64_t k = K32; k < K; ++k) sum += static_cast<int32_t>(q[r * K + k]) * static_cast<int32_t>(wr[k]);
    out(t + r, n, sum);
  }
}

template <class Out>
__attribute__((target("avx2,fma"))) void int8_rows_avx2(const int8_t *q, const int8_t *aq, const int8_t *w,
                                                       int64_t T, int64_t K, int64_t n0, int64_t n1,
                                                       const Out &out) {
  for (int64_t block = n0; block < n1; block += kColumnBlock) {
    const int64_t end = std::min(n1, block + kColumnBlock);
    for (int64_t t = 0; t < T; t += 4) {
      const int64_t o = t * K, rows = std::min<int64_t>(4, T - t);
      for (int64_t n = block; n < end; ++n) {
        const int8_t *wr = w + n * K;
        switch (rows) {
          case 4: int8_tile<4>(q + o, aq + o, wr, K, t, n, out); break;
          case 3: int8_tile<3>(q + o, aq + o, wr, K, t, n, out); break;
          case 2: int8_tile<2>(q + o, aq + o, wr, K, t, n, out); break;
          default: int8_tile<1>(q + o, aq + o, wr, K, t, n, out); break;
        }
      }
    }
  }
}
#endif

// The tier a call runs: AVX2's where the ISA decision allows it and the operands are the scheme's, else the plain.
template <class Out>
void int8_rows(const int8_t *q, const int8_t *aq, const int8_t *w, int64_t T, int64_t K, int64_t n0, int64_t n1,
               bool scheme_range, const Out &out) {
#if defined(__x86_64__)
  if (scheme_range && has_avx2()) return int8_rows_avx2(q, aq, w, T, K, n0, n1, out);
#endif
  int8_rows_plain(q, w, T, K, n0, n1, out);
}

// ------------------------------------------------------------------------------------------------ one Linear
// The step's conversion buffers (x rounded to bf16; x quantized to int8, |q|, the rows' scales), [rows, widest K].
struct Convert {
  float *rounded;
  int8_t *q, *aq;
  float *scales;
};

// y [T, N] = x [T, K] W^T (+ b) for a weight of the model's kind (0 float32, 1 bfloat16 bits, 2 int8 + scales): up
// to kFloatFewRows / kBf16FewRows rows through the few-row GEMMs here (float32 weights at precision 0; bf16 ones x
// rounded to bfloat16 first), more through cpu_linear.cc's cores (oneDNN's sgemm, its bf16 GEMM or that GEMM's
// emulation); int8 always here (exact in int32).
int linear(int kind, int precision, int threads, const void *w, const float *scale, const float *b, const float *x,
           float *y, int64_t T, int64_t K, int64_t N, const Convert &c) {
  if (T == 0 || N == 0) return 0;
  if (kind == WeightKind::kFloat32) {
    const float *wf = static_cast<const float *>(w);
    if (T > kFloatFewRows || precision != 0 || K == 0) {
      return gptlocal_core_linear_fwd(x, wf, b, y, T, K, N, LinearOptions{threads, precision});
    }
    few_rows(threads, x, wf, b, y, T, K, N);
    return 0;
  }
  if (kind == WeightKind::kBfloat16) {
    const uint16_t *wb = static_cast<const uint16_t *>(w);
    if (T > (precision == 2 ? kBf16FewRows : kFloatFewRows) || K == 0) {  // oneDNN's bf16 GEMM or its emulation
      return gptlocal_core_linear_bf16w_fwd(x, wb, b, y, T, K, N, LinearOptions{threads, precision == 2 ? 2 : 1});
    }
    round_bf16(x, T * K, c.rounded);
    few_rows(threads, c.rounded, wb, b, y, T, K, N);
    return 0;
  }
  const int count = gemm_threads(threads, T * N * K);
  if (kind != WeightKind::kInt8 || scale == nullptr) return Status::kBadCall;
  const int8_t *wq = static_cast<const int8_t *>(w);
  run_chunks(threads_for(threads, T * K), T, [&](int, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) quantize_row(x + t * K, K, c.q + t * K, c.aq + t * K, c.scales + t);
  });
  gptlocal::decoder::int8_gemm(count, c.q, c.aq, c.scales, wq, scale, b, y, T, K, N);
  return 0;
}

// ------------------------------------------------------------------------------------------------ elementwise
// scores[j] = (q . K[j]) scale (+ bias[j] where bias is not null) for j < count.
VEC_FN(void, dot_scores, (const float *q, const float *K, int64_t count, int64_t D, float scale, const float *bias,
                          float *scores),
       (q, K, count, D, scale, bias, scores)) {
  for (int64_t j = 0; j < count; ++j) {
    const float *k = K + j * D;
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t d = 0; d < D; ++d) s += q[d] * k[d];
    scores[j] = bias != nullptr ? s * scale + bias[j] : s * scale;
  }
}

VEC_FN(void, weighted_rows, (const float *p, const float *V, int64_t count, int64_t D, float *out),
       (p, V, count, D, out)) {
  std::fill(out, out + D, 0.0f);
  for (int64_t j = 0; j < count; ++j) {
    const float *v = V + j * D;
    const float f = p[j];
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) out[d] += f * v[d];
  }
}

// s[0..valid) <- softmax of s[0..valid) (s[valid..count) <- 0): exp of s - max (common.h exp_neg), normalized.
VEC_FN(void, softmax_prefix, (float *s, int64_t valid, int64_t count), (s, valid, count)) {
  float m = kNegInf;
  for (int64_t j = 0; j < valid; ++j) m = s[j] > m ? s[j] : m;
  const float inv = 1.0f / exp_sum(s, valid, m);
#pragma omp simd
  for (int64_t j = 0; j < valid; ++j) s[j] *= inv;
  std::fill(s + valid, s + count, 0.0f);
}

// The MLP's activation in place on [n] (form 0 tanh GeLU, 1 quick, 2 erf, 3 ReLU; common.h's GeLU forms, as the
// bias + GeLU kernel computes them).
VEC_FN(void, activate, (float *x, int64_t n, int form), (x, n, form)) {
  if (form == MlpForm::kTanh) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = gelu_tanh(x[i]);
  } else if (form == MlpForm::kQuick) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = gelu_quick(x[i]);
  } else if (form == MlpForm::kErf) {
    for (int64_t i = 0; i < n; ++i) x[i] = 0.5f * x[i] * (1.0f + std::erf(x[i] * 0.70710678118654752f));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) x[i] = x[i] > 0.0f ? x[i] : 0.0f;
  }
}

// rotate_half of the first R channels of one head vector (model/attention.py _rotate_all; cpu_rope.cc's forward):
// c and s the row's cos and sin [R] (their halves equal).
VEC_FN(void, rotate, (float *x, const float *c, const float *s, int64_t R), (x, c, s, R)) {
  const int64_t half = R / 2;
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    x[j] = a * c[j] - b * s[j];
    x[j + half] = b * c[j + half] + a * s[j + half];
  }
}

// ------------------------------------------------------------------------------------------------ attention
// Each query row (b, s) of qkv [T, Qw] (its N heads, group-major) over its slot's cached rows 0..pos into
// ctx [T, N D]: tasks of one row's up to kQueryBlock positions x one key/value group (the group's query heads read
// its keys once); few queries by dot loops, more by two sgemm calls (scores, then probabilities x values).
int cache_attention(const LayerShape &m, const Rows &rows, const float *qkv, const float *keys, const float *values,
                    float scale, float *ctx, int threads) {
  const int64_t N = m.heads, G = m.groups, D = m.head_dim, L = rows.length, group = N / G, Qw = (N + 2 * G) * D;
  const int64_t blocks = (rows.S + kQueryBlock - 1) / kQueryBlock, tasks = rows.B * G * blocks;
  int64_t work = 0;
  for (int64_t t = 0; t < rows.B * rows.S; ++t) work += (rows.pos[t] + 1) * N * D;
  std::atomic<int> failed(0);
  run_parallel(threads_for(threads, work), tasks, [&](std::atomic<int64_t> &next, int) {
    thread_local std::vector<float> buffer;
    for (int64_t task = next.fetch_add(1); task < tasks; task = next.fetch_add(1)) {
      const int64_t b = task / (G * blocks), g = task / blocks % G, block = task % blocks;
      const int64_t s0 = block * kQueryBlock, s1 = std::min(rows.S, s0 + kQueryBlock), nq = (s1 - s0) * group;
      int64_t count = 0;
      for (int64_t s = s0; s < s1; ++s) count = std::max<int64_t>(count, rows.pos[b * rows.S + s] + 1);
      const int64_t base = (static_cast<int64_t>(rows.slot[b]) * G + g) * L * D;
      const float *K = keys + base, *V = values + base;
      const float *bias = rows.bias != nullptr ? rows.bias + b * rows.bias_stride : nullptr;
      const size_t need = static_cast<size_t>(nq * (count + 2 * D));
      if (buffer.size() < need) buffer.resize(need);
      float *scores = buffer.data(), *Qb = scores + nq * count, *out = Qb + nq * D;
      if (nq * count * D < 65536) {  // a decode step's few queries: dot loops
        for (int64_t s = s0; s < s1; ++s) {
          const int64_t t = b * rows.S + s, valid = rows.pos[t] + 1;
          for (int64_t h = 0; h < group; ++h) {
            const float *q = qkv + t * Qw + (g * (group + 2) + h) * D;
            dot_scores(q, K, valid, D, scale, bias, scores);
            softmax_prefix(scores, valid, valid);
            weighted_rows(scores, V, valid, D, ctx + t * N * D + (g * group + h) * D);
          }
        }
        continue;
      }
      for (int64_t s = s0; s < s1; ++s) {  // the block's queries, (position, head) rows
        const int64_t t = b * rows.S + s;
        for (int64_t h = 0; h < group; ++h) {
          std::memcpy(Qb + ((s - s0) * group + h) * D, qkv + t * Qw + (g * (group + 2) + h) * D, sizeof(float) * D);
        }
      }
      SequentialGemm one;
      if (dnnl_sgemm('N', 'T', nq, count, D, scale, Qb, D, K, D, 0.0f, scores, count) != dnnl_success) {
        failed.store(1);
        continue;
      }
      for (int64_t i = 0; i < nq; ++i) {
        float *row = scores + i * count;
        if (bias != nullptr) add_rows(row, bias, row, count);
        softmax_prefix(row, rows.pos[b * rows.S + s0 + i / group] + 1, count);
      }
      if (dnnl_sgemm('N', 'N', nq, D, count, 1.0f, scores, count, V, D, 0.0f, out, D) != dnnl_success) {
        failed.store(1);
        continue;
      }
      for (int64_t s = s0; s < s1; ++s) {
        const int64_t t = b * rows.S + s;
        for (int64_t h = 0; h < group; ++h) {
          std::memcpy(ctx + t * N * D + (g * group + h) * D, out + ((s - s0) * group + h) * D, sizeof(float) * D);
        }
      }
    }
  });
  return failed.load() != 0 ? Status::kGemm : Status::kOk;
}

// norm(x [T, H]) into y: common.h's norm_forward (LayerNorm or RMSNorm, the layer's), moments [2 T] its statistics.
int normalize(const LayerShape &m, const float *weight, const float *bias, const float *x, float *y, int64_t T,
              float *moments, int threads) {
  return norm_forward(m.norm, x, weight, bias, y, moments, T, m.hidden, m.epsilon, threads);
}

}  // namespace

namespace gptlocal {
namespace decoder {

void int8_gemm(int threads, const int8_t *q, const int8_t *aq, const float *xs, const int8_t *w, const float *ws,
               const float *b, float *y, int64_t T, int64_t K, int64_t N) {
  column_blocks(threads, N, [&](int64_t n0, int64_t n1) {
    int8_rows(q, aq, w, T, K, n0, n1, true,
              [&](int64_t t, int64_t n, int32_t sum) { y[t * N + n] = int8_output(sum, xs[t], ws[n], b, n); });
  });
}

void int8_sums(int threads, const int8_t *q, const int8_t *aq, const int8_t *w, int32_t *acc, int64_t T, int64_t K,
               int64_t N, bool scheme_range) {
  column_blocks(threads, N, [&](int64_t n0, int64_t n1) {
    int8_rows(q, aq, w, T, K, n0, n1, scheme_range,
              [&](int64_t t, int64_t n, int32_t sum) { acc[t * N + n] = sum; });
  });
}

int64_t layer_workspace(const LayerShape &m, int64_t T, Arena *arena) {
  const int64_t H = m.hidden, N = m.heads, G = m.groups, D = m.head_dim, I = m.inter;
  const int64_t Qw = (N + 2 * G) * D, widest = std::max({H, N * D, I});
  arena->take<float>(T * H);       // normed
  arena->take<float>(T * Qw);      // qkv
  arena->take<float>(T * N * D);   // ctx
  arena->take<float>(T * H);       // attention out
  arena->take<float>(T * H);       // h
  arena->take<float>(T * I);       // inner (fc1, up)
  arena->take<float>(T * I);       // gate
  arena->take<float>(T * H);       // mlp out
  arena->take<float>(2 * T);       // the norms' moments
  arena->take<float>(T * widest);  // x rounded to bf16
  arena->take<int8_t>(T * widest);  // x quantized
  arena->take<int8_t>(T * widest);  // |x| quantized
  arena->take<float>(T);           // the rows' scales
  return arena->used();
}

int layer_forward(const LayerShape &m, const LayerWeights &w, const Rows &rows, const float *x, float *out,
                  float *keys, float *values, const float *cos, const float *sin, Arena *arena) {
  const int64_t T = rows.B * rows.S, H = m.hidden, N = m.heads, G = m.groups, D = m.head_dim, I = m.inter;
  const int64_t Qw = (N + 2 * G) * D, widest = std::max({H, N * D, I}), group = N / G, R = m.rotary_dim;
  if (G <= 0 || N % G != 0 || (R != 0 && (R % 2 != 0 || R > D))) return Status::kBadShape;
  if (T == 0) return Status::kOk;
  float *normed = arena->take<float>(T * H), *qkv = arena->take<float>(T * Qw), *ctx = arena->take<float>(T * N * D);
  float *attn = arena->take<float>(T * H), *h = arena->take<float>(T * H), *inner = arena->take<float>(T * I);
  float *gate = arena->take<float>(T * I), *mlp = arena->take<float>(T * H), *moments = arena->take<float>(2 * T);
  Convert convert{arena->take<float>(T * widest), arena->take<int8_t>(T * widest), arena->take<int8_t>(T * widest),
                  arena->take<float>(T)};
  if (arena->overflow()) return Status::kWorkspace;
  const int th = m.threads, kind = m.weights, precision = m.precision;
  const int elementwise = threads_for(th, T * H);

  int status = normalize(m, w.norm1_weight, w.norm1_bias, x, normed, T, moments, elementwise);
  if (status == 0) status = linear(kind, precision, th, w.qkv, w.qkv_scale, w.qkv_bias, normed, qkv, T, H, Qw, convert);
  if (status != Status::kOk) return status;
  // rope on each query and key head, then every row's key and value into the caches, in place
  for (int64_t t = 0; t < T; ++t) {
    const int64_t b = t / rows.S, slot = rows.slot[b], at = rows.pos[t];
    float *row = qkv + t * Qw;
    for (int64_t g = 0; g < G; ++g) {
      float *heads = row + g * (group + 2) * D;
      if (R != 0) {
        for (int64_t j = 0; j <= group; ++j) rotate(heads + j * D, cos + t * R, sin + t * R, R);
      }
      const int64_t cached = ((slot * G + g) * rows.length + at) * D;
      std::memcpy(keys + cached, heads + group * D, sizeof(float) * D);
      std::memcpy(values + cached, heads + (group + 1) * D, sizeof(float) * D);
    }
  }
  status = cache_attention(m, rows, qkv, keys, values, w.scale, ctx, th);
  if (status == Status::kOk) {
    status = linear(kind, precision, th, w.proj, w.proj_scale, w.proj_bias, ctx, attn, T, N * D, H, convert);
  }
  if (status != Status::kOk) return status;
  // sequential: h = x + attn, the MLP on norm2(h); parallel (NeoX): the MLP on norm2(x), h = x + attn
  add_rows(x, attn, h, T * H);
  status = normalize(m, w.norm2_weight, w.norm2_bias, m.parallel_residual ? x : h, normed, T, moments, elementwise);
  if (status != Status::kOk) return status;
  status = linear(kind, precision, th, w.fc1, w.fc1_scale, w.fc1_bias, normed, inner, T, H, I, convert);
  if (status == Status::kOk && m.form == MlpForm::kSwiglu) {  // SwiGLU: silu(gate(n)) * fc1(n)
    status = linear(kind, precision, th, w.gate, w.gate_scale, w.gate_bias, normed, gate, T, H, I, convert);
    if (status == 0) status = gptlocal_core_swiglu_fwd(gate, inner, inner, T * I, ThreadOptions{th});
  } else if (status == 0) {
    activate(inner, T * I, m.form);
  }
  if (status == 0) status = linear(kind, precision, th, w.fc2, w.fc2_scale, w.fc2_bias, inner, mlp, T, I, H, convert);
  if (status != Status::kOk) return status;
  add_rows(h, mlp, out, T * H);
  return 0;
}

}  // namespace decoder
}  // namespace gptlocal

namespace {

using gptlocal::decoder::layer_forward;
using gptlocal::decoder::layer_workspace;

LayerShape shape_of(const DecoderModel &m) {
  return LayerShape{m.hidden, m.heads, m.groups, m.head_dim, m.inter, m.norm, m.rotary_dim, m.form,
                    m.parallel_residual, m.weights, m.precision, m.threads, m.epsilon};
}

// Every temporary of one step of `rows` token rows and `batch` sequences, carved in this order.
struct StepBuffers {
  float *hidden[2], *cos, *sin, *selected, *normed, *moments, *logits;
  Convert convert;
};

StepBuffers step_buffers(const DecoderModel &m, int64_t rows, int64_t batch, Arena *arena) {
  StepBuffers s{};
  const int64_t R = std::max<int64_t>(m.rotary_dim, 1), widest = m.hidden;
  s.hidden[0] = arena->take<float>(rows * m.hidden);
  s.hidden[1] = arena->take<float>(rows * m.hidden);
  s.cos = arena->take<float>(rows * R);
  s.sin = arena->take<float>(rows * R);
  s.selected = arena->take<float>(batch * m.hidden);
  s.normed = arena->take<float>(batch * m.hidden);
  s.moments = arena->take<float>(2 * batch);
  s.logits = arena->take<float>(batch * m.vocab);
  s.convert = Convert{arena->take<float>(batch * widest), arena->take<int8_t>(batch * widest),
                      arena->take<int8_t>(batch * widest), arena->take<float>(batch)};
  return s;
}

// The token rows' embeddings [T, H]: the table's row (float32, or int8 times its scale) + the learned position's.
int embed(const DecoderModel &m, const int32_t *ids, const int32_t *positions, int64_t T, float *out) {
  const int64_t H = m.hidden;
  for (int64_t t = 0; t < T; ++t) {
    const int64_t id = ids[t];
    if (id < 0 || id >= m.vocab) return Status::kTokenId;
    float *y = out + t * H;
    if (m.words_kind == WeightKind::kInt8) {
      const int8_t *row = static_cast<const int8_t *>(m.words) + id * H;
      const float scale = m.words_scale[id];
      for (int64_t h = 0; h < H; ++h) y[h] = static_cast<float>(row[h]) * scale;
    } else if (m.words_kind == WeightKind::kBfloat16) {
      const uint16_t *row = static_cast<const uint16_t *>(m.words) + id * H;
      for (int64_t h = 0; h < H; ++h) y[h] = bf16_value(row[h]);
    } else {
      std::memcpy(y, static_cast<const float *>(m.words) + id * H, sizeof(float) * H);
    }
    if (m.positions != nullptr) {
      if (positions[t] < 0 || positions[t] >= m.max_positions) return Status::kPosition;
      const float *p = m.positions + static_cast<int64_t>(positions[t]) * H;
      for (int64_t h = 0; h < H; ++h) y[h] = y[h] + p[h];
    }
  }
  return 0;
}

}  // namespace

// The rows `ids` [T] of a bfloat16 table [V, H] widened to float32 (exact): the token lookup of a bf16 model built for
// inference, whose table is held once, as bfloat16 (gptlocal_rows_bf16_fwd; the native step's embed does the same).
// An id outside the table fails the call with nothing written.
int gptlocal_core_rows_bf16_fwd(const uint16_t *table, const int32_t *ids, float *rows, int64_t V, int64_t H,
                                int64_t T, const ThreadOptions &options) {
  for (int64_t t = 0; t < T; ++t) {
    if (ids[t] < 0 || ids[t] >= V) return Status::kTokenId;
  }
  run_chunks(threads_for(options.threads, T * H), T, [&](int, int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint16_t *row = table + static_cast<int64_t>(ids[t]) * H;
      float *out = rows + t * H;
      for (int64_t h = 0; h < H; ++h) out[h] = bf16_value(row[h]);
    }
  });
  return 0;
}

int64_t gptlocal_decoder_workspace(const DecoderModel *model, int64_t rows, int64_t batch) {
  Arena arena(nullptr, 0);
  step_buffers(*model, rows, batch, &arena);
  layer_workspace(shape_of(*model), rows, &arena);
  return arena.used();
}

int gptlocal_decoder_step(const DecoderModel *model, const DecoderLayer *layers, const DecoderCache *cache,
                          const DecoderCall *call) {
  const DecoderModel &m = *model;
  const int64_t B = call->batch, S = call->width, T = B * S, H = m.hidden, R = m.rotary_dim;
  if (call->failed_layer != nullptr) *call->failed_layer = -1;
  if (B <= 0 || S <= 0) return Status::kBadCall;
  Arena arena(static_cast<char *>(call->work), call->work_bytes);
  StepBuffers s = step_buffers(m, T, B, &arena);
  const int64_t mark = arena.used();
  if (arena.overflow()) return Status::kWorkspace;
  for (int64_t b = 0; b < B; ++b) {  // every slot, position and logits column checked before anything is written
    if (call->slots[b] < 0 || call->slots[b] >= cache->slots || call->last[b] < 0 || call->last[b] >= S) {
      return Status::kCacheIndex;
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    if (call->positions[t] < 0 || call->positions[t] >= cache->length) return Status::kCacheIndex;
  }
  int status = embed(m, call->ids, call->positions, T, s.hidden[0]);
  if (status != 0) return status;
  if (R != 0) {  // the rows' cos and sin, from the runner's tables by position
    for (int64_t t = 0; t < T; ++t) {
      std::memcpy(s.cos + t * R, cache->cos + static_cast<int64_t>(call->positions[t]) * R, sizeof(float) * R);
      std::memcpy(s.sin + t * R, cache->sin + static_cast<int64_t>(call->positions[t]) * R, sizeof(float) * R);
    }
  }
  const Rows rows{B, S, call->slots, call->positions, cache->length, nullptr, 0};
  const LayerShape shape = shape_of(m);
  const int64_t per_layer = static_cast<int64_t>(cache->slots) * m.groups * cache->length * m.head_dim;
  int current = 0;
  for (int64_t layer = 0; layer < m.layers; ++layer) {
    Arena scratch = arena.from(mark);
    status = layer_forward(shape, layers[layer], rows, s.hidden[current], s.hidden[1 - current],
                           cache->keys + layer * per_layer, cache->values + layer * per_layer, s.cos, s.sin,
                           &scratch);
    if (status != Status::kOk) {  // the part's own status; the layer beside it
      if (call->failed_layer != nullptr) *call->failed_layer = static_cast<int32_t>(layer);
      return status;
    }
    current = 1 - current;
  }
  // the final norm and the head on each sequence's chosen row only
  for (int64_t b = 0; b < B; ++b) {
    std::memcpy(s.selected + b * H, s.hidden[current] + (b * S + call->last[b]) * H, sizeof(float) * H);
  }
  const int elementwise = threads_for(m.threads, B * H);
  status = norm_forward(m.norm, s.selected, m.final_weight, m.final_bias, s.normed, s.moments, B, H, m.epsilon,
                        elementwise);
  if (status != Status::kOk) return status;
  float *logits = call->logits != nullptr ? call->logits : s.logits;
  status = linear(m.head_kind, m.precision, m.threads, m.head, m.head_scale, nullptr, s.normed, logits, B, H, m.vocab,
                  s.convert);
  if (status != Status::kOk) return status;
  if (call->tokens != nullptr) {  // greedy: each row's first largest logit (numpy's and MindSpore's argmax)
    for (int64_t b = 0; b < B; ++b) {
      const float *row = logits + b * m.vocab;
      call->tokens[b] = static_cast<int32_t>(std::max_element(row, row + m.vocab) - row);
    }
  }
  return 0;
}

// The decoder's Linear alone (`linear` above), for tests: y [T, N] = x W^T (+ b) for a weight of `kind` (0 float32, 1
// bfloat16 bits, 2 int8 with its per-row `scale`) at the model's `precision`: each ISA tier's few-row GEMMs (rows_plain,
// rows_avx2, int8_rows_plain, int8_rows_avx2) against the plain path by value (tests/kernels/test_cpu_isa.py).
int gptlocal_decoder_linear(int kind, int precision, int threads, const void *w, const float *scale, const float *b,
                            const float *x, float *y, int64_t T, int64_t K, int64_t N) {
  std::vector<float> rounded(static_cast<size_t>(T * K)), scales(static_cast<size_t>(T));
  std::vector<int8_t> q(static_cast<size_t>(T * K)), aq(static_cast<size_t>(T * K));
  return linear(kind, precision, threads, w, scale, b, x, y, T, K, N,
                Convert{rounded.data(), q.data(), aq.data(), scales.data()});
}
