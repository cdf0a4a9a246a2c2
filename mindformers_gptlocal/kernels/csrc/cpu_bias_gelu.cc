// Bias + GeLU for CPU, forward and backward: the typed cores of gptlocal_bias_gelu_fwd / _bwd (kernels/abi/table.py;
// kernels/cells/norm_gelu.py CPUBiasGeLU; the decode layer's MLP, cpu_decode_layer.cc).
//
// Why: the tanh GeLU composed from Sigmoid/Mul/Add plus the bias BroadcastTo + Add are a dozen passes over the
// [T, 4H] activations of the MLP (`python benchmarks/op_profile.py train`); here each way is one pass.
//
// Rows are split into `threads` contiguous chunks (common.h run_chunks); the bias gradient's sum over rows is added
// chunk by chunk in a fixed order (sum_partials), so the results depend only on the thread count.
//
// forward:  x [T, F] (T: the leading axes), bias [F] -> y [T, F] = gelu(x + bias), BiasGeluOptions.form 0 tanh, 1
//           quick (common.h gelu_tanh, gelu_quick); y may be x (in place: the decode layer)
// backward: x, bias, dy -> dx [T, F], dbias [F]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

VEC_FN(void, bias_gelu_rows, (const float *x, const float *bias, float *y, int64_t begin, int64_t end, int64_t F,
                              bool quick),
       (x, bias, y, begin, end, F, quick)) {
  for (int64_t row = begin; row < end; ++row) {
    const float *xr = x + row * F;
    float *yr = y + row * F;
    if (quick) {
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) yr[j] = gelu_quick(xr[j] + bias[j]);
    } else {
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) yr[j] = gelu_tanh(xr[j] + bias[j]);
    }
  }
}

VEC_FN(void, bias_gelu_grad_rows, (const float *x, const float *bias, const float *dy, float *dx, float *dbias,
                                   int64_t begin, int64_t end, int64_t F, bool quick),
       (x, bias, dy, dx, dbias, begin, end, F, quick)) {
  std::fill(dbias, dbias + F, 0.0f);
  for (int64_t row = begin; row < end; ++row) {
    const float *xr = x + row * F;
    const float *dyr = dy + row * F;
    float *dxr = dx + row * F;
    if (quick) {
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        const float g = gelu_quick_grad(xr[j] + bias[j], dyr[j]);
        dxr[j] = g;
        dbias[j] += g;
      }
    } else {
#pragma omp simd
      for (int64_t j = 0; j < F; ++j) {
        const float g = gelu_tanh_grad(xr[j] + bias[j], dyr[j]);
        dxr[j] = g;
        dbias[j] += g;
      }
    }
  }
}

}  // namespace

int gptlocal_core_bias_gelu_fwd(const float *x, const float *bias, float *y, int64_t T, int64_t F,
                                const BiasGeluOptions &options) {
  const bool quick = options.form != MlpForm::kTanh;
  run_chunks(threads_for(options.threads, T * F), T, [&](int, int64_t begin, int64_t end) {
    bias_gelu_rows(x, bias, y, begin, end, F, quick);
  });
  return 0;
}

int gptlocal_core_bias_gelu_bwd(const float *x, const float *bias, const float *dy, float *dx, float *dbias,
                                int64_t T, int64_t F, const BiasGeluOptions &options) {
  const bool quick = options.form != MlpForm::kTanh;
  const int threads = threads_for(options.threads, T * F);
  std::vector<float> partial(static_cast<size_t>(threads * F));
  const int chunks = run_chunks(threads, T, [&](int chunk, int64_t begin, int64_t end) {
    bias_gelu_grad_rows(x, bias, dy, dx, partial.data() + chunk * F, begin, end, F, quick);
  });
  sum_partials(partial.data(), chunks, F, dbias);
  return 0;
}
