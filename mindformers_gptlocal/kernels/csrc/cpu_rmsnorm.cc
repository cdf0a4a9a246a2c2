// RMSNorm over the last axis for CPU, forward and backward: the typed cores of gptlocal_rmsnorm_fwd / _bwd
// (kernels/abi/table.py; kernels/cells/rms_swiglu.py CPURMSNorm): the Llama-style block's norm.
//
// Why: MindSpore's RMSNorm from Square, ReduceMean, Add, Rsqrt, Mul, Mul is six passes over [T, H] (and more in its
// backward); here the forward is one pass, the backward two (its row sum, then dx and the weight-gradient sum).
//
// The rows' loops are common.h's norm_rows / norm_grad_rows (LayerNorm's, not centered: the mean is 0, no beta).
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

int gptlocal_core_rmsnorm_fwd(const float *x, const float *weight, float *y, float *rstd, int64_t T, int64_t H,
                              const RMSNormOptions &options) {
  run_chunks(threads_for(options.threads, T * H), T, [&](int, int64_t begin, int64_t end) {
    norm_rows(false, x, weight, nullptr, y, nullptr, rstd, begin, end, H, options.epsilon);
  });
  return 0;
}

int gptlocal_core_rmsnorm_bwd(const float *x, const float *weight, const float *rstd, const float *dy, float *dx,
                              float *dweight, int64_t T, int64_t H, const RMSNormOptions &options) {
  const int threads = threads_for(options.threads, T * H);
  std::vector<float> partial(static_cast<size_t>(threads * H));
  const int chunks = run_chunks(threads, T, [&](int chunk, int64_t begin, int64_t end) {
    norm_grad_rows(false, x, weight, nullptr, rstd, dy, dx, partial.data() + chunk * H, nullptr, begin, end,
                   H);
  });
  sum_partials(partial.data(), chunks, H, dweight);
  return 0;
}
