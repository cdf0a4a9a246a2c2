// RMSNorm and SwiGLU's silu(gate) * up for CPU, forward and backward, as MindSpore AOT kernels (gpt_local,
// kernels/rms_swiglu.py): the Llama-style block's two elementwise stages.
//
// Built with the other sources into one library by mindformers_gptlocal/kernels/build.py; called through
// ops.Custom("lib.so:gptlocal_rmsnorm_fwd", ..., func_type="aot", bprop=...) inside the compiled graph.
// Why: MindSpore's RMSNorm from Square, ReduceMean, Add, Rsqrt, Mul, Mul is six passes over [T, H] (and more in
// its backward), SiLU(gate) * up from Sigmoid, Mul, Mul three passes over [T, F] plus their gradients; here each
// is one pass (the RMSNorm backward two: its row sum, then dx and the weight-gradient sum).
//
// Rows are split into `threads` contiguous chunks, one thread each (common.h fork_join); the weight-gradient
// sum over rows is added chunk by chunk in a fixed order, so results depend only on the thread count.
//
// gptlocal_rmsnorm_fwd: x [..., H], weight [H], args (RMSNormArgs, common.h: epsilon, threads) -> y [..., H], rstd [...]
//                       y = x * rsqrt(mean(x^2) + eps) * weight
// gptlocal_rmsnorm_bwd: x, weight, rstd, dy, args -> dx [..., H], dweight [H]
// gptlocal_swiglu_fwd:  gate [..., F], up [..., F], args (SwiGLUArgs: threads) -> y = silu(gate) * up
// gptlocal_swiglu_bwd:  gate, up, dy, args -> dgate [..., F], dup [..., F]  (sigmoid recomputed from gate)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
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

VEC_CLONES void swiglu_rows(const float *gate, const float *up, float *y, int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float g = gate[i];
    y[i] = g * sigmoid(g) * up[i];
  }
}

VEC_CLONES void swiglu_grad_rows(const float *gate, const float *up, const float *dy, float *dgate, float *dup,
                                int64_t begin, int64_t end) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float g = gate[i];
    const float s = sigmoid(g);
    const float silu = g * s;
    dup[i] = dy[i] * silu;
    dgate[i] = dy[i] * up[i] * (s + silu * (1.0f - s));
  }
}

}  // namespace

extern "C" int gptlocal_rmsnorm_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 5 || !all_float32(nparam, dtypes)) return 1;
  const int64_t H = shapes[0][ndims[0] - 1], T = leading(ndims[0], shapes[0]);
  if (shapes[1][0] != H) return 2;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const RMSNormArgs *args = args_at<RMSNormArgs>(2, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *y = static_cast<float *>(params[3]);
  float *rstd = static_cast<float *>(params[4]);
  const float eps = args->epsilon;
  run_chunks(threads_for(args->threads, T * H), T, [&](int, int64_t begin, int64_t end) {
    rmsnorm_rows(x, w, y, rstd, begin, end, H, eps);
  });
  return 0;
}

extern "C" int gptlocal_rmsnorm_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                    void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 7 || !all_float32(nparam, dtypes)) return 1;
  const int64_t H = shapes[0][ndims[0] - 1], T = leading(ndims[0], shapes[0]);
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float *rstd = static_cast<const float *>(params[2]);
  const float *dy = static_cast<const float *>(params[3]);
  const RMSNormArgs *args = args_at<RMSNormArgs>(4, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *dx = static_cast<float *>(params[5]);
  float *dw = static_cast<float *>(params[6]);
  const int threads = threads_for(args->threads, T * H);
  std::vector<float> partial(static_cast<size_t>(threads * H));
  const int chunks = run_chunks(threads, T, [&](int chunk, int64_t begin, int64_t end) {
    rmsnorm_grad_rows(x, w, rstd, dy, dx, partial.data() + chunk * H, begin, end, H);
  });
  std::memcpy(dw, partial.data(), sizeof(float) * H);
  for (int t = 1; t < chunks; ++t) {
    const float *p = partial.data() + t * H;
    for (int64_t j = 0; j < H; ++j) dw[j] += p[j];
  }
  return 0;
}

extern "C" int gptlocal_swiglu_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 4 || !all_float32(nparam, dtypes)) return 1;
  if (ndims[0] != ndims[1]) return 2;
  int64_t total = 1;  // every element: gate and up have one shape
  for (int axis = 0; axis < ndims[0]; ++axis) {
    if (shapes[0][axis] != shapes[1][axis]) return 2;
    total *= shapes[0][axis];
  }
  const float *gate = static_cast<const float *>(params[0]);
  const float *up = static_cast<const float *>(params[1]);
  const SwiGLUArgs *args = args_at<SwiGLUArgs>(2, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *y = static_cast<float *>(params[3]);
  run_chunks(threads_for(args->threads, total), total, [&](int, int64_t begin, int64_t end) {
    swiglu_rows(gate, up, y, begin, end);
  });
  return 0;
}

extern "C" int gptlocal_swiglu_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 6 || !all_float32(nparam, dtypes)) return 1;
  const int64_t total = elements(ndims[0], shapes[0]);
  const float *gate = static_cast<const float *>(params[0]);
  const float *up = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  const SwiGLUArgs *args = args_at<SwiGLUArgs>(3, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *dgate = static_cast<float *>(params[4]);
  float *dup = static_cast<float *>(params[5]);
  run_chunks(threads_for(args->threads, total), total, [&](int, int64_t begin, int64_t end) {
    swiglu_grad_rows(gate, up, dy, dgate, dup, begin, end);
  });
  return 0;
}
