// RMSNorm over the last axis for CPU, forward and backward: the typed cores of gptlocal_rmsnorm_fwd / _bwd
// (kernels/table.py; kernels/rms_swiglu.py CPURMSNorm): the Llama-style block's norm.
//
// Why: MindSpore's RMSNorm from Square, ReduceMean, Add, Rsqrt, Mul, Mul is six passes over [T, H] (and more in its
// backward); here the forward is one pass, the backward two (its row sum, then dx and the weight-gradient sum).
//
// Rows are split into `threads` contiguous chunks (common.h run_chunks); the weight-gradient sum over rows is added
// chunk by chunk in a fixed order (sum_partials), so results depend only on the thread count.
//
// forward:  x [T, H] (T: the leading axes), weight [H] -> y [T, H] = x * rsqrt(mean(x^2) + eps) * weight, rstd [T]
// backward: x, weight, rstd, dy -> dx [T, H], dweight [H]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

VEC_CLONES void rmsnorm_rows(const float *x, const float *w, float *y, float *rstd, int64_t begin, int64_t end,
                            int64_t H, float eps) {
  for (int64_t row = begin; row < end; ++row) {
    const float *xr = x + row * H;
    float *yr = y + row * H;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < H; ++j) sum += xr[j] * xr[j];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) yr[j] = (xr[j] * inv) * w[j];
    rstd[row] = inv;
  }
}

VEC_CLONES void rmsnorm_grad_rows(const float *x, const float *w, const float *rstd, const float *dy, float *dx,
                                 float *dw, int64_t begin, int64_t end, int64_t H) {
  std::fill(dw, dw + H, 0.0f);
  const float inv_h = 1.0f / static_cast<float>(H);
  for (int64_t row = begin; row < end; ++row) {
    const float *xr = x + row * H;
    const float *dyr = dy + row * H;
    float *dxr = dx + row * H;
    const float inv = rstd[row];
    float c = 0.0f;
#pragma omp simd reduction(+ : c)
    for (int64_t j = 0; j < H; ++j) c += dyr[j] * w[j] * xr[j];
    c *= inv * inv_h;  // mean(g * xhat), g = dy * w, xhat = x * inv
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const float xhat = xr[j] * inv;
      dxr[j] = inv * (dyr[j] * w[j] - xhat * c);
      dw[j] += dyr[j] * xhat;
    }
  }
}

}  // namespace

int gptlocal_core_rmsnorm_fwd(const float *x, const float *weight, float *y, float *rstd, int64_t T, int64_t H,
                              const RMSNormOptions &options) {
  run_chunks(threads_for(options.threads, T * H), T, [&](int, int64_t begin, int64_t end) {
    rmsnorm_rows(x, weight, y, rstd, begin, end, H, options.epsilon);
  });
  return 0;
}

int gptlocal_core_rmsnorm_bwd(const float *x, const float *weight, const float *rstd, const float *dy, float *dx,
                              float *dweight, int64_t T, int64_t H, const RMSNormOptions &options) {
  const int threads = threads_for(options.threads, T * H);
  std::vector<float> partial(static_cast<size_t>(threads * H));
  const int chunks = run_chunks(threads, T, [&](int chunk, int64_t begin, int64_t end) {
    rmsnorm_grad_rows(x, weight, rstd, dy, dx, partial.data() + chunk * H, begin, end, H);
  });
  sum_partials(partial.data(), chunks, H, dweight);
  return 0;
}
