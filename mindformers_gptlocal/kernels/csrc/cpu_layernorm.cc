// LayerNorm over the last axis for CPU, forward and backward: the typed cores of gptlocal_layernorm_fwd / _bwd
// (kernels/abi/table.py; kernels/cells/norm_gelu.py CPULayerNorm; the decode layer's norms, cpu_decode_layer.cc).
//
// Why: in a profiled training step (`python benchmarks/op_profile.py train`) MindSpore 2.7.2's CPU
// LayerNormGrad takes 5-9 ms on [1024, 256]; here the forward is one pass over the rows, the backward two (its row
// sums, then dx and the parameter-gradient sums).
//
// The rows' loops are common.h's norm_rows / norm_grad_rows (RMSNorm's too, cpu_rmsnorm.cc, not centered).
// Rows are split into `threads` contiguous chunks, one thread each (common.h run_chunks: the library's worker pool);
// the parameter-gradient sums over rows are added chunk by chunk in a fixed order (sum_partials), so the results
// depend only on the thread count, never on scheduling (a resumed run is bit-exact).
//
// forward:  x [T, H] (T: the leading axes), gamma [H], beta [H] -> y [T, H], mean [T], rstd [T]
// backward: x, gamma, mean, rstd, dy -> dx [T, H], dgamma [H], dbeta [H]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

int gptlocal_core_layernorm_fwd(const float *x, const float *gamma, const float *beta, float *y, float *mean,
                                float *rstd, int64_t T, int64_t H, const LayerNormOptions &options) {
  run_chunks(threads_for(options.threads, T * H), T, [&](int, int64_t begin, int64_t end) {
    norm_rows(true, x, gamma, beta, y, mean, rstd, begin, end, H, options.epsilon);
  });
  return 0;
}

int gptlocal_core_layernorm_bwd(const float *x, const float *gamma, const float *mean, const float *rstd,
                                const float *dy, float *dx, float *dgamma, float *dbeta, int64_t T, int64_t H,
                                const LayerNormOptions &options) {
  const int threads = threads_for(options.threads, T * H);
  std::vector<float> partial(static_cast<size_t>(2 * threads * H));  // dgamma's chunks, then dbeta's
  const int chunks = run_chunks(threads, T, [&](int chunk, int64_t begin, int64_t end) {
    norm_grad_rows(true, x, gamma, mean, rstd, dy, dx, partial.data() + chunk * H,
                   partial.data() + (threads + chunk) * H, begin, end, H);
  });
  sum_partials(partial.data(), chunks, H, dgamma);
  sum_partials(partial.data() + threads * H, chunks, H, dbeta);
  return 0;
}
