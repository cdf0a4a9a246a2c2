// SwiGLU's silu(gate) * up for CPU, forward and backward: the typed cores of gptlocal_swiglu_fwd / _bwd
// (kernels/abi/table.py; kernels/cells/rms_swiglu.py CPUSwiGLU): the Llama-style MLP's gate.
//
// Why: SiLU(gate) * up from Sigmoid, Mul, Mul is three passes over [T, F] plus their gradients; here each way is
// one pass, the backward recomputing the sigmoid from gate (nothing else is kept).
//
// Elements are split into `threads` contiguous chunks (common.h run_chunks); each element's result depends on it
// alone.
//
// forward:  gate [n], up [n] (any shape, n elements) -> y [n] = silu(gate) * up, silu(g) = g * sigmoid(g)
// backward: gate, up, dy -> dgate [n], dup [n]
#include <cstdint>

#include "common.h"

namespace {

VEC_FN(void, swiglu_rows, (const float *gate, const float *up, float *y, int64_t begin, int64_t end),
       (gate, up, y, begin, end)) {
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    const float g = gate[i];
    y[i] = g * sigmoid(g) * up[i];
  }
}

VEC_FN(void, swiglu_grad_rows, (const float *gate, const float *up, const float *dy, float *dgate, float *dup,
                                int64_t begin, int64_t end),
       (gate, up, dy, dgate, dup, begin, end)) {
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

int gptlocal_core_swiglu_fwd(const float *gate, const float *up, float *y, int64_t n, const ThreadOptions &options) {
  run_chunks(threads_for(options.threads, n), n, [&](int, int64_t begin, int64_t end) {
    swiglu_rows(gate, up, y, begin, end);
  });
  return 0;
}

int gptlocal_core_swiglu_bwd(const float *gate, const float *up, const float *dy, float *dgate, float *dup,
                             int64_t n, const ThreadOptions &options) {
  run_chunks(threads_for(options.threads, n), n, [&](int, int64_t begin, int64_t end) {
    swiglu_grad_rows(gate, up, dy, dgate, dup, begin, end);
  });
  return 0;
}
