// LoRA's input dropout for CPU, forward and backward: the typed core of gptlocal_lora_dropout_fwd / _bwd (gpt_local,
// kernels/abi/table.py; kernels/cells/lora_dropout.py).
//
// Why: in a profiled LoRA training step (`benchmarks/op_profile.py train --lora`) MindSpore 2.7.2's CPU Dropout kernel
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
// forward: x [..., F] float32, t1 [P1], t2 [P2] (0/1 float32 tables), offsets int32 [2] (a, b), LoRADropoutOptions
//          (dropout scale 1 / (1 - p), mode 1 keep where the bits agree / 2 where they differ, threads) -> y
// backward: dy, t1, t2, offsets -> dx, the same core
#include <cstdint>
#include <cstring>

#include "common.h"

namespace {

constexpr int64_t kSpan = 4096;  // elements per mask span (a stack buffer)

// out[j] = in[j] * keep(begin + j) for j < n.
VEC_FN(void, apply_span, (const float *in, float *out, const float *keep, int64_t n), (in, out, keep, n)) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) out[j] = in[j] * keep[j];
}

}  // namespace

// x [n] (any shape), the tables t1 [P1], t2 [P2], offsets (a, b) -> y [n] = x * keep; the backward is the same call
// on dy (the same mask drawn again).
int gptlocal_core_lora_dropout(const float *x, const float *t1, const float *t2, const int32_t *offsets, float *y,
                               int64_t n, int64_t P1, int64_t P2, const LoRADropoutOptions &options) {
  Dropout d;
  d.t1 = t1;
  d.t2 = t2;
  d.p1 = P1;
  d.p2 = P2;
  d.a = offsets[0];
  d.b = offsets[1];
  d.scale = options.scale;
  d.mode = options.mode;
  if ((d.mode != 1 && d.mode != 2) || d.a < 0 || d.b < 0 || d.a >= d.p1 || d.b >= d.p2) return Status::kDropoutOffsets;
  const int64_t spans = (n + kSpan - 1) / kSpan;
  run_parallel(threads_for(options.threads, n), spans, [&](std::atomic<int64_t> &next, int) {
    float keep[kSpan];
    for (int64_t s = next++; s < spans; s = next++) {
      const int64_t begin = s * kSpan, count = std::min<int64_t>(kSpan, n - begin);
      drop_row(d, begin, static_cast<int>(count), keep);
      apply_span(x + begin, y + begin, keep, count);
    }
  });
  return 0;
}
