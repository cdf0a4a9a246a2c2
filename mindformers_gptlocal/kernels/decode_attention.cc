// Decode attention for CPU: one query row per sequence over its cached keys/values (gpt_local's KV cache), as a
// MindSpore AOT kernel (kernels/decode_attention.py, used by model/attention.py on the KV-cache path at S = 1).
//
// Inputs: q [B, N, 1, D], k [B, G, L, D], v [B, G, L, D] (the cache Parameters as stored; G key/value heads, GQA:
// query head n reads head n / (N / G)), bias [Bb, 1, 1, L] (Bb 1 or B: the additive mask the plain path adds),
// config float32 [2] (scale, threads). Output: out [B, N, 1, D].
// Same numbers as the plain path's BatchMatMul + scale + bias + softmax + BatchMatMul: scores q.k_j * scale +
// bias_j, softmax over j, sum of p_j v_j. Rows whose bias is at or below -1e8 (gpt_local's MASK_VALUE is -1e9:
// rows past the sequence's position, exactly 0 after the plain softmax) are not read at all, and the rows are
// read only up to the last unmasked one, so a step costs O(position), not O(cache length). One task per (batch,
// key/value head): its group's query heads share each read of the cached rows (two dnnl_sgemm calls).
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

namespace {

constexpr float HIDDEN = -1.0e8f;  // bias at or below: a masked row (MASK_VALUE = -1e9)

}  // namespace

extern "C" int gptlocal_decode_attention(int nparam, void **params, int *ndims, int64_t **shapes,
                                         const char **dtypes, void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 6) return 1;
  for (int i = 0; i < 4; ++i)
    if (ndims[i] != 4 || std::strcmp(dtypes[i], "float32") != 0) return 2;
  const int64_t B = shapes[0][0], N = shapes[0][1], D = shapes[0][3];
  const int64_t G = shapes[1][1], L = shapes[1][2], Bb = shapes[3][0];
  if (shapes[0][2] != 1 || shapes[1][0] != B || shapes[1][3] != D || G <= 0 || N % G != 0) return 3;
  if (shapes[2][0] != B || shapes[2][1] != G || shapes[2][2] != L || shapes[2][3] != D) return 3;
  if ((Bb != 1 && Bb != B) || shapes[3][3] != L) return 4;
  const float *q = static_cast<const float *>(params[0]);
  const float *k = static_cast<const float *>(params[1]);
  const float *v = static_cast<const float *>(params[2]);
  const float *bias = static_cast<const float *>(params[3]);
  const float *cfg = static_cast<const float *>(params[4]);
  float *out = static_cast<float *>(params[5]);
  const float scale = cfg[0];
  const int threads = std::max(1, static_cast<int>(cfg[1]));
  const int64_t group = N / G;
  run_parallel(threads, B * G, [&](std::atomic<int64_t> &next, int) {
    std::vector<float> scores;
    for (int64_t task = next.fetch_add(1); task < B * G; task = next.fetch_add(1)) {
      const int64_t b = task / G, g = task % G;
      const float *row_bias = bias + (Bb == 1 ? 0 : b) * L;
      int64_t end = L;  // rows past the last unmasked one are never read
      while (end > 0 && row_bias[end - 1] <= HIDDEN) --end;
      const float *Q = q + (b * N + g * group) * D;  // the group's query heads, [group, D]
      float *O = out + (b * N + g * group) * D;
      if (end == 0) {  // every row masked: the plain softmax is uniform over all L rows
        end = L;
      }
      const float *K = k + task * L * D, *V = v + task * L * D;
      scores.resize(static_cast<size_t>(group * end));
      dnnl_sgemm('N', 'T', group, end, D, scale, Q, D, K, D, 0.0f, scores.data(), end);
      for (int64_t h = 0; h < group; ++h) {
        float *s = scores.data() + h * end;
        float m = -INFINITY;
        for (int64_t j = 0; j < end; ++j) {
          s[j] += row_bias[j];
          m = s[j] > m ? s[j] : m;
        }
        float sum = 0.0f;
        for (int64_t j = 0; j < end; ++j) {
          const float e = std::exp(s[j] - m);
          s[j] = e;
          sum += e;
        }
        const float inv = 1.0f / sum;
        for (int64_t j = 0; j < end; ++j) s[j] *= inv;
      }
      dnnl_sgemm('N', 'N', group, D, end, 1.0f, scores.data(), end, V, D, 0.0f, O, D);
    }
  });
  return 0;
}
