// The train step's kernels after the backward, as MindSpore AOT kernels (gpt_local, kernels/train_step.py): each
// gradient's sum of squares (the overflow check and the clip's global norm, mf/wrapper.py) and AdamW's update of one
// float32 parameter in place (training/optim.py GPTLocalAdamW). Both are one pass over memory, split into contiguous
// chunks over the library's worker threads (common.h fork_join), the loops vectorized.
//
// Why: in a GPT-2 small training step (bf16 GEMMs, 2 x 256 tokens, 2 threads: `benchmarks/train_step_profile.py
// --shape small --batch 2 --compute-dtype bfloat16`) MindSpore's CPU AdamWeightDecay took 544 ms of 2.46 s, ~3x
// what reading a parameter, its gradient and both moments and writing three of them back costs at this machine's
// memory bandwidth; the sums of squares (Square, then ReduceSum of the squares) ~120 ms, writing a gradient-sized
// temporary for each.
//
// gptlocal_square_sum_fwd: 0 x (float32, any shape), 1 args SquareSumArgs (threads) -> 2 the sum of x's squares,
// float32 [1]: accumulated in double per thread, so it is inf (or nan) where the float32 total overflows (or x holds
// a nan or an inf), as the overflow check needs.
//
// gptlocal_adamw_fwd: AdamWeightDecay's update (MindSpore's nnacl AdamWeightDecayFp32), the same formula in the same
// order:
//   m += (g - m) (1 - beta1);  v += (g g - v) (1 - beta2);  w -= lr (m / (sqrt(v) + eps) + decay w)
// GPTLocalAdamW folds the bias corrections into lr, eps and decay (optim.py), as it does for AdamWeightDecay.
// Inputs: 0 w, 1 m, 2 v (float32, any shape, the same element count; written IN PLACE), 3 g (float32, the same
// count), 4 lr, 5 beta1, 6 beta2, 7 eps, 8 decay (float32, one element each: graph values), 9 args AdamWArgs
// (threads); output 10: a status token, int32 [1] (0).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

// sum of x[i]^2, i < n: the squares and each 4096-element block's sum in float32 (vector lanes), the blocks' sums
// added in double
VEC_CLONES double square_sum_chunk(const float *x, int64_t n) {
  double total = 0.0;
  for (int64_t start = 0; start < n; start += 4096) {
    const int64_t end = std::min<int64_t>(n, start + 4096);
    float block = 0.0f;
#pragma omp simd reduction(+ : block)
    for (int64_t i = start; i < end; ++i) block += x[i] * x[i];
    total += block;
  }
  return total;
}

VEC_CLONES void adamw_chunk(float *w, float *m, float *v, const float *g, int64_t n, float lr, float beta1,
                            float beta2, float eps, float decay) {
  const float keep1 = 1.0f - beta1, keep2 = 1.0f - beta2;
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const float grad = g[i];
    const float mi = m[i] + (grad - m[i]) * keep1;
    const float vi = v[i] + (grad * grad - v[i]) * keep2;
    m[i] = mi;
    v[i] = vi;
    w[i] -= lr * (mi / (std::sqrt(vi) + eps) + decay * w[i]);
  }
}

}  // namespace

extern "C" int gptlocal_square_sum_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                       void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 3 || std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[2], "float32") != 0) return 1;
  const SquareSumArgs *args = args_at<SquareSumArgs>(1, params, ndims, shapes, dtypes);
  if (args == nullptr || elements(ndims[2], shapes[2]) != 1) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const int64_t n = elements(ndims[0], shapes[0]);
  double partial[64] = {0.0};
  const int threads = std::min(64, threads_for(args->threads, n));
  const int used = run_chunks(threads, n, [&](int chunk, int64_t begin, int64_t end) {
    partial[chunk] = square_sum_chunk(x + begin, end - begin);
  });
  double total = 0.0;
  for (int chunk = 0; chunk < used; ++chunk) total += partial[chunk];
  *static_cast<float *>(params[2]) = static_cast<float>(total);
  return 0;
}

extern "C" int gptlocal_adamw_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 11) return 1;
  for (int i = 0; i < 9; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 1;
  }
  const AdamWArgs *args = args_at<AdamWArgs>(9, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  const int64_t n = elements(ndims[0], shapes[0]);
  for (int i = 1; i < 4; ++i) {
    if (elements(ndims[i], shapes[i]) != n) return 2;
  }
  for (int i = 4; i < 9; ++i) {
    if (elements(ndims[i], shapes[i]) != 1) return 2;
  }
  float *w = static_cast<float *>(params[0]), *m = static_cast<float *>(params[1]);
  float *v = static_cast<float *>(params[2]);
  const float *g = static_cast<const float *>(params[3]);
  auto scalar = [&](int i) { return *static_cast<const float *>(params[i]); };
  const float lr = scalar(4), beta1 = scalar(5), beta2 = scalar(6), eps = scalar(7), decay = scalar(8);
  run_chunks(threads_for(args->threads, n), n, [&](int, int64_t begin, int64_t end) {
    adamw_chunk(w + begin, m + begin, v + begin, g + begin, end - begin, lr, beta1, beta2, eps, decay);
  });
  *static_cast<int32_t *>(params[10]) = 0;
  return 0;
}
