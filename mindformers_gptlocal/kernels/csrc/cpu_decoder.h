// The decoder layer's C++ interface, shared by the native runner's step (cpu_decoder.cc) and the graph's decode-layer
// node (cpu_decode_layer.cc): one layer function for every layout the model builds (cpu_decoder.cc has the whole
// story). Included after common.h (cores.h's option structs).
#pragma once

#include <cstdint>

namespace gptlocal {
namespace decoder {

// A layer's sizes and layout choices (cores.h's codes): norm a NormKind; rotary_dim 0 (learned positions) or the
// rope's channels; form an MlpForm; weights a WeightKind (int8: + scales);
// precision: LinearOptions' (float32 weights: 0, or 1 / 2 a bf16 model's rounding at each GEMM).
struct LayerShape {
  int32_t hidden, heads, groups, head_dim, inter, norm, rotary_dim, form, parallel_residual, weights, precision,
      threads;
  float epsilon;
};

// A layer's attention scale and Parameters: cores.h's DecoderLayer, generated from kernels/abi/layer_table.py LAYER (each
// Linear's weight of the shape's dtype, its int8 scales (or null) and its bias (or null); the norms' weights and
// (LayerNorm) biases; gate: SwiGLU's gate Linear (MlpForm::kSwiglu), else null).
using LayerWeights = ::DecoderLayer;

// The call's token rows: B sequences of S rows, sequence b in cache slot slot[b], row (b, s) at position pos[b S + s]
// of a cache of `length` rows a slot. bias: null, or an additive bias [length] a sequence at bias + b bias_stride
// (the graph's KVCache.attention_bias, 0 on the rows each reads) added to the scores of the rows 0..position read.
struct Rows {
  int64_t B, S;
  const int32_t *slot, *pos;
  int64_t length;
  const float *bias;
  int64_t bias_stride;
};

// A bump allocator over a caller's buffer (64-byte aligned pieces); with a null base it only counts.
class Arena {
 public:
  Arena(char *base, int64_t size) : base_(base), size_(size) {}
  template <class T>
  T *take(int64_t count) {
    const int64_t bytes = ((count > 1 ? count : 1) * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
    T *at = base_ == nullptr ? nullptr : reinterpret_cast<T *>(base_ + used_);
    used_ += bytes;
    if (base_ != nullptr && used_ > size_) overflow_ = true;
    return at;
  }
  int64_t used() const { return used_; }
  bool overflow() const { return overflow_; }
  // The same buffer from `mark` on (a layer's temporaries after the step's own).
  Arena from(int64_t mark) const {
    Arena rest(base_, size_);
    rest.used_ = mark;
    return rest;
  }

 private:
  char *base_;
  int64_t size_;
  int64_t used_ = 0;
  bool overflow_ = false;
};

// The one int8 GEMM (the decoder's Linears here, cpu_linear_int8.cc's Linear and exact product): q [T, K] int8 (aq:
// its |q|) times w [N, K]^T exactly in int32, on `threads` column blocks (common.h column_blocks), AVX2's
// maddubs/madd where the ISA decision allows it (operands in [-127, 127]) else the plain loops. int8_gemm: the int8
// scheme's y [T, N] = acc xs[t] ws[n] (+ b[n]) (q a quantize_row's rows); int8_sums: acc [T, N] itself,
// scheme_range false (an operand may be -128) the plain loops.
// The int8 scheme's output of one exact int32 sum: y = acc x_scale w_scale (+ b[n]).
inline float int8_output(int32_t acc, float x_scale, float w_scale, const float *b, int64_t n) {
  const float value = static_cast<float>(acc) * (x_scale * w_scale);
  return b != nullptr ? value + b[n] : value;
}

void int8_gemm(int threads, const int8_t *q, const int8_t *aq, const float *xs, const int8_t *w, const float *ws,
               const float *b, float *y, int64_t T, int64_t K, int64_t N);
void int8_sums(int threads, const int8_t *q, const int8_t *aq, const int8_t *w, int32_t *acc, int64_t T, int64_t K,
               int64_t N, bool scheme_range);

// The bytes layer_forward carves for T rows (added to what `arena` has counted; returns the total).
int64_t layer_workspace(const LayerShape &shape, int64_t T, Arena *arena);

// One layer over `rows`: x [T, H] -> out [T, H] (out may not be x), this call's keys and values written in place into
// the layer's caches [slots, G, length, D] at (slot, group, position); cos, sin [T, rotary_dim] each row's (rope).
// Status::kOk, or the failing part's Status with the caches possibly written.
int layer_forward(const LayerShape &shape, const LayerWeights &weights, const Rows &rows, const float *x, float *out,
                  float *keys, float *values, const float *cos, const float *sin, Arena *arena);

}  // namespace decoder
}  // namespace gptlocal
