// An int8 model's Linear for CPU, y = x W^T (+ b) with W stored int8 [out, in] and one float32 scale per output
// channel, inference only, and its exact int8 x int8 -> int32 product: the typed cores of gptlocal_int8_linear_fwd
// and gptlocal_int8_matmul_fwd (gpt_local, kernels/abi/table.py; kernels/cells/linear_int8.py; model/quant_cells.py; the int8
// decode layer's GEMMs, cpu_decode_layer.cc).
//
// The scheme (CTranslate2's int8): the weight is quantized once (`gptlocal quantize`: symmetric per output channel,
// scale[n] = max_k |W[n, k]| / 127, W_q = round(W / scale), in [-127, 127]); each call quantizes x the same way per
// row (x_scale[t] = max_k |x[t, k]| / 127, x_q = round(x * (127 / max))), multiplies x_q W_q^T exactly in int32 and
// writes y[t, n] = acc[t, n] * (x_scale[t] * scale[n]) (+ b[n]). A row of zeros has scale 0 and gives b. The
// columns are split into `threads` contiguous blocks of whole 16-column groups, one thread each (common.h
// fork_join), each block's product and scaling written by its thread: every path gives the exact int32 product,
// so the results depend on nothing but the inputs (not the path, not the thread count).
//
// The exact product, by method (Int8Options.method; 0 chooses by this CPU, int8_method):
// 2 oneDNN's dnnl_gemm_s8s8s32, where oneDNN has VNNI (common.h s8_gemm_exact, checked once by value at the
//   extremes): fast and exact there. Without VNNI (AVX2, AVX-512 before VNNI) it sums product pairs in int16 with
//   saturation and is wrong on full-range operands, so it is never chosen there.
// 1 the dot loop, everywhere else, for any number of rows: x widened to int16 once per call; each weight row
//   multiplied with four rows of x at a time (the last rows, a decode step's one, with four weight rows at a time),
//   int16 pairs summed into int32: GCC vectorises `int32 += int16 * int16` to vpmovsxbw + vpmaddwd in the AVX2 /
//   AVX-512 clones, and a pair sum is at most 2 * 128 * 128, so nothing saturates; over chunks of weight rows small
//   enough to stay in L2 while the groups of rows pass over them. Measured roughly here (Zen 3, one thread, a busy
//   machine; K x N 768 x 3072 and 3072 x 768): faster than widening the weight to float32 for oneDNN's sgemm at
//   every row count tried (1.4-1.7x at 64-256 rows, ~55 against ~33 GMAC/s; 3-6x at 1-4 rows), and at one row
//   ~1.6x the time a memory copy takes per byte of the weight (~26 GB/s), the weight then in L3.
//
// x [T, K] float32, w [N, K] int8, scale [N] float32, b [N] float32 or null (ThreadOptions) -> y [T, N] float32
// int8_matmul: xq [T, K] int8, w [N, K] int8 (Int8Options) -> acc [T, N] int32 = xq w^T, exact in int32 (the dot loop
//   for any int8 operands and K below 2^31 / 2^14; oneDNN's on its range)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace {

enum Int8Method { kChoose = 0, kDotLoop = 1, kOneDNN = 2 };

constexpr int64_t kChunkBytes = 1 << 17;  // weight bytes a chunk of rows takes (kept in L2 by the dot loop)

// True where oneDNN's s8 x s8 GEMM is exact here: its ISA has VNNI (common.h s8_gemm_exact) and x = +-127 times
// w = 127 over K = 64 gives +-64 * 127 * 127 (the saturating kernels give 8160; that probe once per process).
bool onednn_s8_exact() {
  if (!s8_gemm_exact(onednn_isa())) return false;  // under the ISA cap, read at each call (common.h)
  static const bool exact = [] {
    constexpr int64_t depth = 64;
    std::vector<int8_t> a(2 * depth, 127), b(depth, 127);
    std::fill(a.begin() + depth, a.end(), static_cast<int8_t>(-127));
    int32_t c[2] = {0, 0};
    const int32_t no_offset = 0;
    SequentialGemm one;
    const dnnl_status_t status = dnnl_gemm_s8s8s32('N', 'T', 'F', 2, 1, depth, 1.0f, a.data(), depth, 0, b.data(),
                                                   depth, 0, 0.0f, c, 1, &no_offset);
    return status == dnnl_success && c[0] == depth * 127 * 127 && c[1] == -depth * 127 * 127;
  }();
  return exact;
}

// The method a call runs: `asked` (Int8Options.method), or where 0, oneDNN's where it is exact here, else the dot
// loop.
int int8_method(int asked) {
  if (asked != kChoose) return asked;
  return onednn_s8_exact() ? kOneDNN : kDotLoop;
}

VEC_FN(void, widen_to_int16, (const int8_t *in, int64_t n, int16_t *out), (in, n, out)) {
  for (int64_t i = 0; i < n; ++i) out[i] = in[i];
}

// The dot loop's kernels: sum_k x[k] w[k] in int32 for one row of x (int16) and four. Plain loops, no `omp simd`:
// GCC vectorises these int32 reductions of int16 x int8 products to vpmovsxbw + vpmaddwd on its own (with the
// pragma GCC 12 takes vpmullw / vpmulhw and unpacks, twice the work).
VEC_FN(int32_t, dot_one, (const int16_t *__restrict x, const int8_t *__restrict w, int64_t K), (x, w, K)) {
  int32_t s = 0;
  for (int64_t k = 0; k < K; ++k) s += int32_t(x[k]) * int32_t(w[k]);
  return s;
}

VEC_FN(void, dot_four, (const int16_t *__restrict x, int64_t ldx, const int8_t *__restrict w, int64_t K,
                        int32_t *__restrict out, int64_t ldo),
       (x, ldx, w, K, out, ldo)) {
  const int16_t *x0 = x, *x1 = x + ldx, *x2 = x + 2 * ldx, *x3 = x + 3 * ldx;
  int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t v = w[k];
    s0 += int32_t(x0[k]) * v;
    s1 += int32_t(x1[k]) * v;
    s2 += int32_t(x2[k]) * v;
    s3 += int32_t(x3[k]) * v;
  }
  out[0] = s0;
  out[ldo] = s1;
  out[2 * ldo] = s2;
  out[3 * ldo] = s3;
}

VEC_FN(void, dot_four_weights, (const int16_t *__restrict x, const int8_t *__restrict w, int64_t K,
                                int32_t *__restrict out),
       (x, w, K, out)) {
  const int8_t *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
  int32_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  for (int64_t k = 0; k < K; ++k) {
    const int32_t v = x[k];
    s0 += v * int32_t(w0[k]);
    s1 += v * int32_t(w1[k]);
    s2 += v * int32_t(w2[k]);
    s3 += v * int32_t(w3[k]);
  }
  out[0] = s0;
  out[1] = s1;
  out[2] = s2;
  out[3] = s3;
}

// Weight rows a chunk takes: about kChunkBytes of them, at least 16.
int64_t chunk_rows(int64_t K) { return std::max<int64_t>(16, kChunkBytes / std::max<int64_t>(K, 1)); }

// acc[t, n] (row stride ldc) = x16[t] . w[n] for every row t and n0 <= n < n1, by the dot loop.
void dot_block(const int16_t *x16, int64_t T, int64_t K, const int8_t *w, int64_t n0, int64_t n1, int32_t *acc,
               int64_t ldc) {
  const int64_t step = chunk_rows(K);
  for (int64_t c0 = n0; c0 < n1; c0 += step) {
    const int64_t c1 = std::min(n1, c0 + step);
    int64_t t = 0;
    for (; t + 4 <= T; t += 4) {
      for (int64_t n = c0; n < c1; ++n) dot_four(x16 + t * K, K, w + n * K, K, acc + t * ldc + n, ldc);
    }
    for (; t < T; ++t) {  // the last rows (a decode step's one): four weight rows at a time
      int64_t n = c0;
      for (; n + 4 <= c1; n += 4) dot_four_weights(x16 + t * K, w + n * K, K, acc + t * ldc + n);
      for (; n < c1; ++n) acc[t * ldc + n] = dot_one(x16 + t * K, w + n * K, K);
    }
  }
}

// xq [T, K] int8 times w [N, K]^T into acc [T, N] int32 by `method` (int8_method's), on column blocks; then
// `epilogue(n0, n1)` on each block, by the thread that wrote it.
template <class Epilogue>
void int8_product(int method, int threads, const int8_t *xq, int64_t T, int64_t K, const int8_t *w, int64_t N,
                  int32_t *acc, const Epilogue &epilogue) {
  std::vector<int16_t> x16;
  if (method == kDotLoop) {
    x16.resize(static_cast<size_t>(T * K));
    widen_to_int16(xq, T * K, x16.data());
  }
  const int32_t no_offset = 0;
  column_blocks(gemm_threads(threads, T * N * K), N, [&](int64_t n0, int64_t n1) {
    if (method == kDotLoop) {
      dot_block(x16.data(), T, K, w, n0, n1, acc, N);
    } else {
      dnnl_gemm_s8s8s32('N', 'T', 'F', T, n1 - n0, K, 1.0f, xq, K, 0, w + n0 * K, K, 0, 0.0f, acc + n0, N,
                        &no_offset);
    }
    epilogue(n0, n1);
  });
}

}  // namespace

int gptlocal_core_int8_linear_fwd(const float *x, const int8_t *w, const float *w_scale, const float *b, float *y,
                                  int64_t T, int64_t K, int64_t N, const ThreadOptions &options) {
  if (T == 0 || N == 0) return 0;
  if (K == 0) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t n = 0; n < N; ++n) y[t * N + n] = b != nullptr ? b[n] : 0.0f;
    }
    return 0;
  }
  std::vector<int8_t> xq(static_cast<size_t>(T * K));
  std::vector<float> x_scale(static_cast<size_t>(T));
  run_chunks(threads_for(options.threads, T * K), T, [&](int, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) quantize_row(x + t * K, K, xq.data() + t * K, x_scale.data() + t);
  });
  std::vector<int32_t> acc(static_cast<size_t>(T * N));
  int8_product(int8_method(kChoose), options.threads, xq.data(), T, K, w, N, acc.data(),
               [&](int64_t n0, int64_t n1) {
                 for (int64_t t = 0; t < T; ++t) {
                   const float xs = x_scale[t];
                   const int32_t *a = acc.data() + t * N;
                   float *out = y + t * N;
                   for (int64_t n = n0; n < n1; ++n) {
                     const float value = static_cast<float>(a[n]) * (xs * w_scale[n]);
                     out[n] = b != nullptr ? value + b[n] : value;
                   }
                 }
               });
  return 0;
}

// The exact product alone (a fused layer's GEMMs call it with its own quantized rows; tests give each method).
// method 2 where oneDNN is not exact here runs it all the same (tests show its saturation); another value fails.
int gptlocal_core_int8_matmul(const int8_t *x, const int8_t *w, int32_t *acc, int64_t T, int64_t K, int64_t N,
                              const Int8Options &options) {
  if (options.method < kChoose || options.method > kOneDNN) return Status::kBadCall;
  if (T == 0 || N == 0) return 0;
  if (K == 0) {
    std::fill(acc, acc + T * N, 0);
    return 0;
  }
  int8_product(int8_method(options.method), options.threads, x, T, K, w, N, acc, [](int64_t, int64_t) {});
  return 0;
}

int gptlocal_int8_gemm_exact(int isa) { return s8_gemm_exact(static_cast<unsigned>(isa)) ? 1 : 0; }

int gptlocal_int8_method(int asked) { return int8_method(asked); }
