// LoRA's input dropout for CPU, forward and backward, as MindSpore AOT kernels (gpt_local, kernels/lora_dropout.py).
//
// Why: in a profiled LoRA training step (docs/performance.md, "Finetuning") MindSpore 2.7.2's CPU Dropout kernel
// drawing lora_dropout's masks for the inputs of the adapted Linears was the largest cost the LoRA branch adds
// (tiny 4 x 256: 8% of the step's op time, more than every other LoRA op together), and it keeps a float mask
// of the input's size for the backward. Here the mask is a counter-based hash of (seed, site, call, element):
// one vectorised pass, nothing kept but two numbers, and the backward draws the same mask again.
//
// keep(i) = mix(mix(i + k0) ^ k1) >= p * 2^32 (mix: a 32-bit integer finaliser, "lowbias32"), k0 from the seed
// and the site (one number per LoRA Linear), k1 from the call: each site counts its forward calls, so every
// step gets new masks; the call number is an output (`key`) that the backward reads, so a recomputed or reordered
// backward sees its forward's mask. Kept elements are scaled by 1 / (1 - p).
//
// gptlocal_lora_dropout_fwd: x [..., F] float32, config float32 [4] (p, site, seed, threads)
//                            -> y [..., F], key float32 [2] (k0, k1 as exact small integers, < 2^24)
// gptlocal_lora_dropout_bwd: dy [..., F], key [2], config [4] -> dx [..., F]
#include <atomic>
#include <cstdint>

#include "common.h"

namespace {

constexpr int kSites = 1 << 16;
std::atomic<uint32_t> g_calls[kSites];  // per site: forward calls so far (zero-initialised, static storage)

inline uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// out[j] = keep(begin + j) ? in[j] * scale : 0 for j < n.
VEC_CLONES void drop_span(const float *in, float *out, int64_t begin, int64_t n, uint32_t k0, uint32_t k1,
                          uint32_t threshold, float scale) {
  const uint32_t first = static_cast<uint32_t>(begin);
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t h = mix32(mix32(first + static_cast<uint32_t>(j) + k0) ^ k1);
    out[j] = h >= threshold ? in[j] * scale : 0.0f;
  }
}

struct Params {
  uint32_t k0, k1, threshold;
  float scale;
  int threads;
};

Params params_from(const float *config, uint32_t k0, uint32_t k1) {
  const double p = config[0];
  Params q;
  q.k0 = k0;
  q.k1 = k1 * 0x9E3779B9U;
  q.threshold = static_cast<uint32_t>(std::min(4294967295.0, p * 4294967296.0));
  q.scale = static_cast<float>(1.0 / (1.0 - p));
  q.threads = std::max(1, static_cast<int>(config[3]));
  return q;
}

uint32_t site_key(const float *config) {
  const uint32_t site = static_cast<uint32_t>(config[1]), seed = static_cast<uint32_t>(config[2]);
  return (mix32(seed * 0x85EBCA6BU + 0x165667B1U) ^ (site * 0xC2B2AE35U)) & 0xFFFFFFU;  // < 2^24: exact in float
}

int64_t elements(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int axis = 0; axis < ndim; ++axis) n *= shape[axis];
  return n;
}

void run(const float *in, float *out, int64_t n, const Params &q) {
  const int threads = n < 65536 ? 1 : q.threads;
  const int64_t chunk = ((n + threads - 1) / threads + 15) / 16 * 16;
  run_parallel(threads, threads, [&](std::atomic<int64_t> &, int t) {
    const int64_t begin = t * chunk, end = std::min<int64_t>(n, begin + chunk);
    if (begin < end) drop_span(in + begin, out + begin, begin, end - begin, q.k0, q.k1, q.threshold, q.scale);
  });
}


}  // namespace

extern "C" int gptlocal_lora_dropout_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 4 || !all_float32(nparam, dtypes)) return 1;
  const float *x = static_cast<const float *>(params[0]);
  const float *config = static_cast<const float *>(params[1]);
  float *y = static_cast<float *>(params[2]);
  float *key = static_cast<float *>(params[3]);
  const uint32_t site = static_cast<uint32_t>(config[1]) % kSites;
  const uint32_t call = g_calls[site].fetch_add(1, std::memory_order_relaxed) & 0xFFFFFFU;
  const uint32_t k0 = site_key(config);
  key[0] = static_cast<float>(k0);
  key[1] = static_cast<float>(call);
  run(x, y, elements(ndims[0], shapes[0]), params_from(config, k0, call));
  return 0;
}

extern "C" int gptlocal_lora_dropout_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 4 || !all_float32(nparam, dtypes)) return 1;
  const float *dy = static_cast<const float *>(params[0]);
  const float *key = static_cast<const float *>(params[1]);
  const float *config = static_cast<const float *>(params[2]);
  float *dx = static_cast<float *>(params[3]);
  run(dy, dx, elements(ndims[0], shapes[0]),
      params_from(config, static_cast<uint32_t>(key[0]), static_cast<uint32_t>(key[1])));
  return 0;
}
