// Linear's GEMM for CPU, y = x W^T with W stored [out, in], forward and backward, as MindSpore AOT kernels
// (gpt_local, kernels/linear.py; model/layers.py Linear).
//
// Built with the other sources into one library by mindformers_gptlocal/kernels/build.py. Why: in a profiled
// Llama-style 124M forward (docs/performance.md) MindSpore 2.7.2's CPU MatMul is 85% of the op time, and oneDNN's
// sgemm (the MindSpore wheel's libdnnl.so.2, sequential when called like this) on the same shapes was faster per
// call. The work is split into `threads` contiguous column blocks, one std::thread each (common.h's reasons), each
// one dnnl_sgemm call writing its own block: no sum crosses threads, so results depend only on the thread count.
//
// gptlocal_linear_fwd: x [T, K], w [N, K], args (LinearArgs, common.h: threads) -> y [T, N] = x w^T; or, with five
//   parameters, x, w, b [N], args -> y = x w^T + b: each thread writes b into its column block's rows, then its
//   sgemm adds x w^T to them (beta 1), so the bias costs no node and no pass of its own (Linear's bias inside)
// gptlocal_linear_bwd: x, w, dy [T, N], args -> dx [T, K] = dy w, dw [N, K] = dy^T x
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace {

// Runs work(begin, end) over `columns` split into at most `threads` blocks of whole 16-column groups.
template <class Work>
void lin_blocks(int threads, int64_t columns, Work work) {
  const int64_t groups = (columns + 15) / 16;
  const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, groups)));
  const int64_t step = (groups + count - 1) / count * 16;
  std::vector<std::thread> pool;
  for (int t = 1; t < count; ++t) {
    const int64_t begin = std::min<int64_t>(columns, t * step), end = std::min<int64_t>(columns, (t + 1) * step);
    if (begin < end) pool.emplace_back([&work, begin, end] {
      SequentialGemm one;
      work(begin, end);
    });
  }
  SequentialGemm one;
  work(0, std::min<int64_t>(columns, step));
  for (auto &thread : pool) thread.join();
}

int lin_threads(float requested, int64_t work) {  // a GEMM below ~256K multiply-adds: one thread
  const int threads = std::max(1, static_cast<int>(requested));
  return work < (int64_t(1) << 18) ? 1 : threads;
}


}  // namespace

extern "C" int gptlocal_linear_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  (void)stream;
  (void)extra;
  const bool has_bias = nparam == 5;
  if ((nparam != 4 && !has_bias) || !all_float32(nparam, dtypes) || ndims[0] != 2 || ndims[1] != 2) return 1;
  const int64_t T = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (shapes[1][1] != K || (has_bias && (ndims[2] != 1 || shapes[2][0] != N))) return 2;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float *b = has_bias ? static_cast<const float *>(params[2]) : nullptr;
  const LinearArgs *args = args_at<LinearArgs>(has_bias ? 3 : 2, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *y = static_cast<float *>(params[has_bias ? 4 : 3]);
  if (T == 0 || N == 0) return 0;
  lin_blocks(lin_threads(args->threads, T * N * std::max<int64_t>(K, 1)), N, [&](int64_t n0, int64_t n1) {
    if (b != nullptr) {
      for (int64_t t = 0; t < T; ++t) std::copy(b + n0, b + n1, y + t * N + n0);
    } else if (K == 0) {
      for (int64_t t = 0; t < T; ++t) std::fill(y + t * N + n0, y + t * N + n1, 0.0f);
    }
    if (K > 0) dnnl_sgemm('N', 'T', T, n1 - n0, K, 1.0f, x, K, w + n0 * K, K, b != nullptr ? 1.0f : 0.0f, y + n0, N);
  });
  return 0;
}

extern "C" int gptlocal_linear_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 6 || !all_float32(nparam, dtypes) || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2) return 1;
  const int64_t T = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  const LinearArgs *args = args_at<LinearArgs>(3, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *dx = static_cast<float *>(params[4]);
  float *dw = static_cast<float *>(params[5]);
  if (T == 0 || N == 0) {  // nothing flows back
    std::fill(dx, dx + T * K, 0.0f);
    std::fill(dw, dw + N * K, 0.0f);
    return 0;
  }
  if (K == 0) return 0;
  const int threads = lin_threads(args->threads, T * N * K);
  lin_blocks(threads, K, [&](int64_t k0, int64_t k1) {  // dx[:, k0:k1] = dy w[:, k0:k1]
    dnnl_sgemm('N', 'N', T, k1 - k0, N, 1.0f, dy, N, w + k0, K, 0.0f, dx + k0, K);
  });
  lin_blocks(threads, N, [&](int64_t n0, int64_t n1) {  // dw[n0:n1] = dy[:, n0:n1]^T x
    dnnl_sgemm('T', 'N', n1 - n0, K, T, 1.0f, dy + n0, N, x, K, 0.0f, dw + n0 * K, K);
  });
  return 0;
}
