// A gradient's sum of squares for CPU: the typed core of gptlocal_square_sum_fwd (gpt_local, kernels/abi/table.py;
// kernels/cells/train_step.py CPUSquareSum): the train step's overflow check and the clip's global norm (mf/wrapper.py).
// One read-only pass, split into contiguous chunks over the library's worker threads (common.h run_chunks).
//
// Why: in a GPT-2 small training step (bf16 GEMMs, 2 x 256 tokens, 2 threads: `benchmarks/op_profile.py
// train --shape small --batch 2 --compute-dtype bfloat16`) the sums of squares as Square, then ReduceSum of the squares
// took ~120 ms, writing a gradient-sized temporary for each.
//
// x [n] (float32, any shape) -> total [1]: the sum of x's squares, accumulated in double per thread, so it is inf (or
// nan) where the float32 total overflows (or x holds a nan or an inf), as the overflow check needs.
#include <algorithm>
#include <cstdint>

#include "common.h"

namespace {

// sum of x[i]^2, i < n: the squares and each 4096-element block's sum in float32 (vector lanes), the blocks' sums
// added in double
VEC_FN(double, square_sum_chunk, (const float *x, int64_t n), (x, n)) {
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

}  // namespace

int gptlocal_core_square_sum_fwd(const float *x, float *total, int64_t n, const ThreadOptions &options) {
  double partial[64] = {0.0};
  const int threads = std::min(64, threads_for(options.threads, n));
  const int used = run_chunks(threads, n, [&](int chunk, int64_t begin, int64_t end) {
    partial[chunk] = square_sum_chunk(x + begin, end - begin);
  });
  double sum = 0.0;
  for (int chunk = 0; chunk < used; ++chunk) sum += partial[chunk];
  *total = static_cast<float>(sum);
  return 0;
}
