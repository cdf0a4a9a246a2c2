// Rotary position embedding for CPU, forward and backward: the typed cores of gptlocal_rope_fwd / _bwd (gpt_local,
// kernels/abi/table.py; what model/attention.py ParallelAttention._rotate computes, Hugging Face's rotate_half form).
//
// x [B, N, S, D] (queries or keys, N heads), cos and sin [Bc, 1, S, R] (RotaryEmbedding: each row's positions; Bc 1
// or B) -> y [B, N, S, D]: the first R channels of each head turned, h = R / 2,
//   y[:h] = x[:h] cos[:h] - x[h:R] sin[:h],   y[h:R] = x[h:R] cos[h:R] + x[:h] sin[h:R],   y[R:] = x[R:]
// and the backward, the transposed rotation of dy:
//   dx[:h] = dy[:h] cos[:h] + dy[h:R] sin[h:R],   dx[h:R] = dy[h:R] cos[h:R] - dy[:h] sin[:h],   dx[R:] = dy[R:]
// (cos and sin get no gradient: they come from integer positions). One pass over x; the (row, head, position)
// vectors split into contiguous chunks over the library's worker threads (common.h run_chunks), each element's
// result depending on its inputs alone. R must be even, 0 < R <= D.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

// One head's vector at one position: `backward` the transposed rotation (a constant of each call: the loop unswitched).
VEC_FN(void, rotate, (const float *x, const float *c, const float *s, float *y, int64_t half, int64_t R, int64_t D,
                      bool backward),
       (x, c, s, y, half, R, D, backward)) {
#pragma omp simd
  for (int64_t j = 0; j < half; ++j) {
    const float a = x[j], b = x[j + half];
    y[j] = backward ? a * c[j] + b * s[j + half] : a * c[j] - b * s[j];
    y[j + half] = backward ? b * c[j + half] - a * s[j] : b * c[j + half] + a * s[j + half];
  }
  if (R < D) std::memcpy(y + R, x + R, sizeof(float) * (D - R));
}

template <bool backward>
int rope(const float *x, const float *cos, const float *sin, float *y, int64_t B, int64_t N, int64_t S, int64_t D,
         int64_t Bc, int64_t R, const ThreadOptions &options) {
  if ((Bc != 1 && Bc != B) || R <= 0 || R > D || R % 2 != 0) return Status::kBadShape;
  const int64_t vectors = B * N * S;
  run_chunks(threads_for(options.threads, vectors * D), vectors, [&](int, int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t b = v / (N * S), position = v % S;
      const int64_t table = ((Bc == 1 ? 0 : b) * S + position) * R;
      rotate(x + v * D, cos + table, sin + table, y + v * D, R / 2, R, D, backward);
    }
  });
  return 0;
}

}  // namespace

int gptlocal_core_rope_fwd(const float *x, const float *cos, const float *sin, float *y, int64_t B, int64_t N,
                           int64_t S, int64_t D, int64_t Bc, int64_t R, const ThreadOptions &options) {
  return rope<false>(x, cos, sin, y, B, N, S, D, Bc, R, options);
}

int gptlocal_core_rope_bwd(const float *dy, const float *cos, const float *sin, float *dx, int64_t B, int64_t N,
                           int64_t S, int64_t D, int64_t Bc, int64_t R, const ThreadOptions &options) {
  return rope<true>(dy, cos, sin, dx, B, N, S, D, Bc, R, options);
}
