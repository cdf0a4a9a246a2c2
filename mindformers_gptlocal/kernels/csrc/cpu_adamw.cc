// AdamW's update of one float32 parameter in place for CPU: the typed core of gptlocal_adamw_fwd (gpt_local,
// kernels/abi/table.py; kernels/cells/train_step.py CPUAdamW; training/optim.py GPTLocalAdamW). One pass over memory, split
// into contiguous chunks over the library's worker threads (common.h run_chunks), the loop vectorized.
//
// Why: in a GPT-2 small training step (bf16 GEMMs, 2 x 256 tokens, 2 threads: `benchmarks/op_profile.py
// train --shape small --batch 2 --compute-dtype bfloat16`) MindSpore's CPU AdamWeightDecay took 544 ms of 2.46 s, ~3x
// what reading a parameter, its gradient and both moments and writing three of them back costs at this machine's
// memory bandwidth.
//
// AdamWeightDecay's update (MindSpore's nnacl AdamWeightDecayFp32), the same formula in the same order:
//   m += (g - m) (1 - beta1);  v += (g g - v) (1 - beta2);  w -= lr (m / (sqrt(v) + eps) + decay w)
// GPTLocalAdamW folds the bias corrections into lr, eps and decay (optim.py), as it does for AdamWeightDecay.
// w, m, v [n] (written in place), g [n]; lr, beta1, beta2, eps, decay: one element each (graph values).
#include <cmath>
#include <cstdint>

#include "common.h"

namespace {

VEC_FN(void, adamw_chunk, (float *w, float *m, float *v, const float *g, int64_t n, float lr, float beta1, float beta2,
                           float eps, float decay),
       (w, m, v, g, n, lr, beta1, beta2, eps, decay)) {
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

int gptlocal_core_adamw_fwd(float *w, float *m, float *v, const float *g, const float *lr, const float *beta1,
                            const float *beta2, const float *eps, const float *decay, int64_t n,
                            const ThreadOptions &options) {
  const float rate = *lr, keep1 = *beta1, keep2 = *beta2, epsilon = *eps, weight_decay = *decay;
  run_chunks(threads_for(options.threads, n), n, [&](int, int64_t begin, int64_t end) {
    adamw_chunk(w + begin, m + begin, v + begin, g + begin, end - begin, rate, keep1, keep2, epsilon, weight_decay);
  });
  return 0;
}
