// An int8 model's Linear for CPU, y = x W^T (+ b) with W stored int8 [out, in] and one float32 scale per output
// channel, inference only: the typed core of gptlocal_int8_linear_fwd (gpt_local, kernels/table.py;
// kernels/linear_int8.py; model/quant_cells.py; the int8 decode layer's GEMMs, cpu_decode_layer.cc).
//
// The scheme (CTranslate2's int8): the weight is quantized once (`gptlocal quantize`: symmetric per output channel,
// scale[n] = max_k |W[n, k]| / 127, W_q = round(W / scale)); each call quantizes x the same way per row
// (x_scale[t] = max_k |x[t, k]| / 127, x_q = round(x * (127 / max))), multiplies x_q W_q^T exactly in int32 with
// oneDNN's dnnl_gemm_s8s8s32 and writes y[t, n] = acc[t, n] * (x_scale[t] * scale[n]) (+ b[n]). A row of zeros has
// scale 0 and gives b. The columns are split into `threads` contiguous blocks of whole 16-column groups, one
// thread each (common.h fork_join), each one GEMM into its own block (as cpu_linear.cc): results depend on nothing
// but the inputs.
//
// x [T, K] float32, w [N, K] int8, scale [N] float32, b [N] float32 or null (ThreadOptions) -> y [T, N] float32
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace {

// Row t of x [T, K] as int8 (q) and its scale: max |x| / 127, x * (127 / max) rounded to nearest (ties to even,
// numpy's rint), so a row's largest element is +-127.
void quantize_row(const float *x, int64_t K, int8_t *q, float *scale) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  if (!(amax > 0.0f)) {  // zeros (or NaN: the output is then not meaningful anyway)
    std::fill(q, q + K, static_cast<int8_t>(0));
    *scale = 0.0f;
    return;
  }
  const float inverse = 127.0f / amax;
  for (int64_t k = 0; k < K; ++k) {
    const float r = std::nearbyint(x[k] * inverse);
    q[k] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
  }
  *scale = amax / 127.0f;
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
  const int threads = std::max(1, options.threads);
  std::vector<int8_t> xq(static_cast<size_t>(T * K));
  std::vector<float> x_scale(static_cast<size_t>(T));
  run_chunks(threads_for(options.threads, T * K), T, [&](int, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) quantize_row(x + t * K, K, xq.data() + t * K, x_scale.data() + t);
  });
  std::vector<int32_t> acc(static_cast<size_t>(T * N));
  const int32_t no_offset = 0;
  const int gemm_threads = T * N * K < (int64_t(1) << 18) ? 1 : threads;  // a small GEMM: one thread
  column_blocks(gemm_threads, N, [&](int64_t n0, int64_t n1) {
    dnnl_gemm_s8s8s32('N', 'T', 'F', T, n1 - n0, K, 1.0f, xq.data(), K, 0, w + n0 * K, K, 0, 0.0f,
                      acc.data() + n0, N, &no_offset);
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
