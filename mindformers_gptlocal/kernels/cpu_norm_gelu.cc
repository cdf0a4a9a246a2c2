// LayerNorm and bias + GeLU for CPU, forward and backward, as MindSpore AOT kernels (gpt_local, kernels/fused.py).
//
// Built with cpu_attention.cc into one library by mindformers_gptlocal/kernels/build.py; called through
// ops.Custom("lib.so:gptlocal_layernorm_fwd", ..., func_type="aot", bprop=...) inside the compiled graph.
// Why: in a profiled training step (docs/performance.md, "Where the training step goes") MindSpore 2.7.2's CPU
// LayerNormGrad takes 5-9 ms on [1024, 256] and the tanh GeLU composed from Sigmoid/Mul/Add plus the bias
// BroadcastTo + Add are a dozen passes over the [T, 4H] activations; here each is one pass (two for the
// LayerNorm backward's parameter sums).
//
// Rows are split into `threads` contiguous chunks, one thread each (common.h fork_join: the library's worker
// pool); the parameter-gradient sums over rows are added chunk by chunk in a fixed
// order, so the results depend only on the thread count, never on scheduling (a resumed run is bit-exact).
//
// gptlocal_layernorm_fwd: x [..., H], gamma [H], beta [H], args (LayerNormArgs, common.h: epsilon, threads)
//                         -> y [..., H], mean [...], rstd [...]
// gptlocal_layernorm_bwd: x, gamma, mean, rstd, dy, args -> dx [..., H], dgamma [H], dbeta [H]
// gptlocal_bias_gelu_fwd: x [..., F], bias [F], args (BiasGeluArgs: form 0 tanh / 1 quick, threads) -> y [..., F]
//                         y = gelu(x + bias), the tanh or quick form (common.h gelu_tanh, gelu_quick)
// gptlocal_bias_gelu_bwd: x, bias, dy, args -> dx [..., F], dbias [F]
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace {

VEC_CLONES void layernorm_rows(const float *x, const float *gamma, const float *beta, float *y, float *mean,
                              float *rstd, int64_t begin, int64_t end, int64_t H, float eps) {
  for (int64_t row = begin; row < end; ++row) {
    const float *xr = x + row * H;
    float *yr = y + row * H;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < H; ++j) sum += xr[j];
    const float mu = sum / static_cast<float>(H);
    float var = 0.0f;
#pragma omp simd reduction(+ : var)
    for (int64_t j = 0; j < H; ++j) var += (xr[j] - mu) * (xr[j] - mu);
    const float inv = 1.0f / std::sqrt(var / static_cast<float>(H) + eps);
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) yr[j] = (xr[j] - mu) * inv * gamma[j] + beta[j];
    mean[row] = mu;
    rstd[row] = inv;
  }
}

VEC_CLONES void layernorm_grad_rows(const float *x, const float *gamma, const float *mean, const float *rstd,
                                   const float *dy, float *dx, float *dgamma, float *dbeta, int64_t begin,
                                   int64_t end, int64_t H) {
  std::fill(dgamma, dgamma + H, 0.0f);
  std::fill(dbeta, dbeta + H, 0.0f);
  const float inv_h = 1.0f / static_cast<float>(H);
  for (int64_t row = begin; row < end; ++row) {
    const float *xr = x + row * H;
    const float *dyr = dy + row * H;
    float *dxr = dx + row * H;
    const float mu = mean[row], inv = rstd[row];
    float a = 0.0f, c = 0.0f;
#pragma omp simd reduction(+ : a, c)
    for (int64_t j = 0; j < H; ++j) {
      const float g = dyr[j] * gamma[j];
      a += g;
      c += g * (xr[j] - mu) * inv;
    }
    a *= inv_h;
    c *= inv_h;
#pragma omp simd
    for (int64_t j = 0; j < H; ++j) {
      const float xhat = (xr[j] - mu) * inv;
      dxr[j] = inv * (dyr[j] * gamma[j] - a - xhat * c);
      dgamma[j] += dyr[j] * xhat;
      dbeta[j] += dyr[j];
    }
  }
}

VEC_CLONES void bias_gelu_rows(const float *x, const float *bias, float *y, int64_t begin, int64_t end, int64_t F,
                              bool quick) {
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

VEC_CLONES void bias_gelu_grad_rows(const float *x, const float *bias, const float *dy, float *dx, float *dbias,
                                   int64_t begin, int64_t end, int64_t F, bool quick) {
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

// out[j] = sum over chunks of partial[chunk * n + j], chunks in order.
void sum_partials(const std::vector<float> &partial, int chunks, int64_t n, float *out) {
  std::memcpy(out, partial.data(), sizeof(float) * n);
  for (int t = 1; t < chunks; ++t) {
    const float *p = partial.data() + t * n;
    for (int64_t j = 0; j < n; ++j) out[j] += p[j];
  }
}

}  // namespace

extern "C" int gptlocal_layernorm_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 7 || !all_float32(nparam, dtypes)) return 1;
  const int64_t H = shapes[0][ndims[0] - 1], T = leading(ndims[0], shapes[0]);
  if (shapes[1][0] != H || shapes[2][0] != H) return 2;
  const LayerNormArgs *args = args_at<LayerNormArgs>(3, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *gamma = static_cast<const float *>(params[1]);
  const float *beta = static_cast<const float *>(params[2]);
  float *y = static_cast<float *>(params[4]);
  float *mean = static_cast<float *>(params[5]);
  float *rstd = static_cast<float *>(params[6]);
  const float eps = args->epsilon;
  run_chunks(threads_for(args->threads, T * H), T, [&](int, int64_t begin, int64_t end) {
    layernorm_rows(x, gamma, beta, y, mean, rstd, begin, end, H, eps);
  });
  return 0;
}

extern "C" int gptlocal_layernorm_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 9 || !all_float32(nparam, dtypes)) return 1;
  const int64_t H = shapes[0][ndims[0] - 1], T = leading(ndims[0], shapes[0]);
  const float *x = static_cast<const float *>(params[0]);
  const float *gamma = static_cast<const float *>(params[1]);
  const float *mean = static_cast<const float *>(params[2]);
  const float *rstd = static_cast<const float *>(params[3]);
  const float *dy = static_cast<const float *>(params[4]);
  const LayerNormArgs *args = args_at<LayerNormArgs>(5, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *dx = static_cast<float *>(params[6]);
  float *dgamma = static_cast<float *>(params[7]);
  float *dbeta = static_cast<float *>(params[8]);
  const int threads = threads_for(args->threads, T * H);
  std::vector<float> partial(static_cast<size_t>(2 * threads * H));
  const int chunks = run_chunks(threads, T, [&](int chunk, int64_t begin, int64_t end) {
    layernorm_grad_rows(x, gamma, mean, rstd, dy, dx, partial.data() + chunk * H,
                        partial.data() + (threads + chunk) * H, begin, end, H);
  });
  std::vector<float> second(partial.begin() + threads * H, partial.end());
  sum_partials(partial, chunks, H, dgamma);
  sum_partials(second, chunks, H, dbeta);
  return 0;
}

extern "C" int gptlocal_bias_gelu_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 4 || !all_float32(nparam, dtypes)) return 1;
  const int64_t F = shapes[0][ndims[0] - 1], T = leading(ndims[0], shapes[0]);
  if (shapes[1][0] != F) return 2;
  const float *x = static_cast<const float *>(params[0]);
  const float *bias = static_cast<const float *>(params[1]);
  const BiasGeluArgs *args = args_at<BiasGeluArgs>(2, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *y = static_cast<float *>(params[3]);
  const bool quick = args->form != 0.0f;
  run_chunks(threads_for(args->threads, T * F), T, [&](int, int64_t begin, int64_t end) {
    bias_gelu_rows(x, bias, y, begin, end, F, quick);
  });
  return 0;
}

extern "C" int gptlocal_bias_gelu_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 6 || !all_float32(nparam, dtypes)) return 1;
  const int64_t F = shapes[0][ndims[0] - 1], T = leading(ndims[0], shapes[0]);
  const float *x = static_cast<const float *>(params[0]);
  const float *bias = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  const BiasGeluArgs *args = args_at<BiasGeluArgs>(3, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *dx = static_cast<float *>(params[4]);
  float *dbias = static_cast<float *>(params[5]);
  const bool quick = args->form != 0.0f;
  const int threads = threads_for(args->threads, T * F);
  std::vector<float> partial(static_cast<size_t>(threads * F));
  const int chunks = run_chunks(threads, T, [&](int chunk, int64_t begin, int64_t end) {
    bias_gelu_grad_rows(x, bias, dy, dx, partial.data() + chunk * F, begin, end, F, quick);
  });
  sum_partials(partial, chunks, F, dbias);
  return 0;
}
