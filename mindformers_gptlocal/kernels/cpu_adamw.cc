// AdamW's update of one float32 parameter in place, as a MindSpore AOT kernel (gpt_local, kernels/adamw.py;
// training/optim.py GPTLocalAdamW).
//
// Why: MindSpore's CPU AdamWeightDecay took 544 ms of a 2.46 s GPT-2 small training step (bf16 GEMMs, 2 x 256
// tokens, 2 threads: `benchmarks/train_step_profile.py --shape small --batch 2 --compute-dtype bfloat16`), ~3x what
// reading the parameter, its gradient and both moments and writing three of them back costs at this machine's memory
// bandwidth. Here the same update is one pass over the four arrays, split into contiguous chunks over the library's
// worker threads (common.h fork_join), the loop vectorized.
//
// The update is AdamWeightDecay's (MindSpore's nnacl AdamWeightDecayFp32), the same formula in the same order:
//   m += (g - m) (1 - beta1);  v += (g g - v) (1 - beta2);  w -= lr (m / (sqrt(v) + eps) + decay w)
// GPTLocalAdamW folds the bias corrections into lr, eps and decay (optim.py), as it does for AdamWeightDecay.
//
// gptlocal_adamw_fwd inputs: 0 w, 1 m, 2 v (float32, any shape, the same element count; written IN PLACE),
// 3 g (float32, the same count), 4 lr, 5 beta1, 6 beta2, 7 eps, 8 decay (float32, one element each: graph values),
// 9 args AdamWArgs (threads); output 10: a status token, int32 [1] (0).
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

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

int64_t count(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int axis = 0; axis < ndim; ++axis) n *= shape[axis];
  return n;
}

}  // namespace

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
  const int64_t n = count(ndims[0], shapes[0]);
  for (int i = 1; i < 4; ++i) {
    if (count(ndims[i], shapes[i]) != n) return 2;
  }
  for (int i = 4; i < 9; ++i) {
    if (count(ndims[i], shapes[i]) != 1) return 2;
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
