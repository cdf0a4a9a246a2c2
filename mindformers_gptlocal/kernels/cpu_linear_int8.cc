// An int8 model's Linear for CPU, y = x W^T (+ b) with W stored int8 [out, in] and one float32 scale per output
// channel, inference only, as a MindSpore AOT kernel (gpt_local, kernels/linear_int8.py; model/quant_cells.py).
//
// The scheme (CTranslate2's int8): the weight is quantized once (`gptlocal quantize`: symmetric per output channel,
// scale[n] = max_k |W[n, k]| / 127, W_q = round(W / scale)); each call quantizes x the same way per row
// (x_scale[t] = max_k |x[t, k]| / 127, x_q = round(x * (127 / max))), multiplies x_q W_q^T exactly in int32 with
// oneDNN's dnnl_gemm_s8s8s32 and writes y[t, n] = acc[t, n] * (x_scale[t] * scale[n]) (+ b[n]). A row of zeros has
// scale 0 and gives b. The columns are split into `threads` contiguous blocks of whole 16-column groups, one
// thread each (common.h fork_join), each one GEMM into its own block (as cpu_linear.cc): results depend on nothing
// but the inputs.
//
// gptlocal_int8_linear_fwd: x [T, K] float32, w [N, K] int8, scale [N] float32, args (Int8LinearArgs, common.h)
//   -> y [T, N] float32; or, with six parameters, x, w, scale, b [N] float32, args -> y = ... + b
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

bool dtypes_are(const char **dtypes, std::initializer_list<const char *> expected) {
  int i = 0;
  for (const char *name : expected) {
    if (std::strcmp(dtypes[i++], name) != 0) return false;
  }
  return true;
}

}  // namespace

extern "C" int gptlocal_int8_linear_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                        const char **dtypes, void *stream, void *extra) {
  (void)stream;
  (void)extra;
  const bool has_bias = nparam == 6;
  if (nparam != 5 && !has_bias) return 1;
  if (has_bias ? !dtypes_are(dtypes, {"float32", "int8", "float32", "float32", "float32", "float32"})
               : !dtypes_are(dtypes, {"float32", "int8", "float32", "float32", "float32"}))
    return 1;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1) return 1;
  const int64_t T = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (shapes[1][1] != K || shapes[2][0] != N || (has_bias && (ndims[3] != 1 || shapes[3][0] != N))) return 2;
  const float *x = static_cast<const float *>(params[0]);
  const int8_t *w = static_cast<const int8_t *>(params[1]);
  const float *w_scale = static_cast<const float *>(params[2]);
  const float *b = has_bias ? static_cast<const float *>(params[3]) : nullptr;
  const Int8LinearArgs *args = args_at<Int8LinearArgs>(has_bias ? 4 : 3, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *y = static_cast<float *>(params[has_bias ? 5 : 4]);
  if (T == 0 || N == 0) return 0;
  if (K == 0) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t n = 0; n < N; ++n) y[t * N + n] = b != nullptr ? b[n] : 0.0f;
    }
    return 0;
  }
  const int threads = std::max(1, static_cast<int>(args->threads));
  std::vector<int8_t> xq(static_cast<size_t>(T * K));
  std::vector<float> x_scale(static_cast<size_t>(T));
  run_chunks(threads_for(args->threads, T * K), T, [&](int, int64_t t0, int64_t t1) {
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
