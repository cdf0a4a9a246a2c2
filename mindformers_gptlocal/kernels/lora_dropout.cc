// LoRA's input dropout for CPU, forward and backward, as MindSpore AOT kernels (gpt_local, kernels/lora_dropout.py).
//
// Why: in a profiled LoRA training step (docs/performance.md, "Finetuning") MindSpore 2.7.2's CPU Dropout kernel
// drawing lora_dropout's masks for the inputs of the adapted Linears was the largest cost the LoRA branch adds
// (tiny 4 x 256: 8% of the step's op time, more than every other LoRA op together), and it keeps a float mask
// of the input's size for the backward; the plain counter dropout (model/dropout.py CounterDropout, which
// resumes) builds input-sized tiles of its two bit tables in the graph. Here the mask is the counter dropout's,
// drawn in one pass (common.h drop_row): element i of the flattened input is kept by T1[(i + a) % P1] vs
// T2[(i + b) % P2], (a, b) = CounterDropout.offsets(step) of this LoRA Linear's site and the model's forward
// counter (dropout_step, saved with training checkpoints), so a resumed run draws the uninterrupted run's masks
// and the plain path's (CounterDropout) values are matched bit for bit. The backward gets the same inputs and
// draws the same mask again: nothing of the input's size is kept, and a recomputed forward draws it again too.
//
// gptlocal_lora_dropout_fwd: x [..., F] float32, t1 [P1], t2 [P2] (0/1 float32 tables), offsets int32 [2] (a, b),
//                            args (LoRADropoutArgs, common.h: dropout scale 1 / (1 - p), mode 1 keep where the
//                            bits agree / 2 where they differ, threads) -> y [..., F]
// gptlocal_lora_dropout_bwd: dy [..., F], t1, t2, offsets, args -> dx [..., F]
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

constexpr int64_t kSpan = 4096;  // elements per mask span (a stack buffer)

// out[j] = in[j] * keep(begin + j) for j < n.
VEC_CLONES void apply_span(const float *in, float *out, const float *keep, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = in[j] * keep[j];
}

bool dtypes_ok(const char **dtypes) {  // x, t1, t2 float32, offsets int32, args float32, out float32
  return std::strcmp(dtypes[0], "float32") == 0 && std::strcmp(dtypes[1], "float32") == 0 &&
         std::strcmp(dtypes[2], "float32") == 0 && std::strcmp(dtypes[3], "int32") == 0 &&
         std::strcmp(dtypes[4], "float32") == 0 && std::strcmp(dtypes[5], "float32") == 0;
}

int run(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  if (nparam != 6 || !dtypes_ok(dtypes)) return 1;
  const float *in = static_cast<const float *>(params[0]);
  const int32_t *offsets = static_cast<const int32_t *>(params[3]);
  const LoRADropoutArgs *args = args_at<LoRADropoutArgs>(4, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *out = static_cast<float *>(params[5]);
  Dropout d;
  d.t1 = static_cast<const float *>(params[1]);
  d.t2 = static_cast<const float *>(params[2]);
  d.p1 = elements(ndims[1], shapes[1]);
  d.p2 = elements(ndims[2], shapes[2]);
  d.a = offsets[0];
  d.b = offsets[1];
  d.scale = args->scale;
  d.mode = static_cast<int>(args->mode);
  if ((d.mode != 1 && d.mode != 2) || d.a < 0 || d.b < 0 || d.a >= d.p1 || d.b >= d.p2) return 1;
  const int64_t n = elements(ndims[0], shapes[0]);
  const int64_t spans = (n + kSpan - 1) / kSpan;
  run_parallel(threads_for(args->threads, n), spans, [&](std::atomic<int64_t> &next, int) {
    float keep[kSpan];
    for (int64_t s = next++; s < spans; s = next++) {
      const int64_t begin = s * kSpan, count = std::min<int64_t>(kSpan, n - begin);
      drop_row(d, begin, static_cast<int>(count), keep);
      apply_span(in + begin, out + begin, keep, count);
    }
  });
  return 0;
}

}  // namespace

extern "C" int gptlocal_lora_dropout_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return run(nparam, params, ndims, shapes, dtypes);
}

extern "C" int gptlocal_lora_dropout_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return run(nparam, params, ndims, shapes, dtypes);
}
