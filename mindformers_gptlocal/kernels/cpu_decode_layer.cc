// One GPT-2 decoder layer of a decode step (one new token per row) in one call, as a MindSpore AOT kernel
// (gpt_local, kernels/decode_layer.py; model/gpt.py GPTLocalBlock).
//
// Why: the plain decode graph runs ~20-30 small MindSpore ops a layer (norm, GEMM, bias add, reshapes and
// transposes of the heads, the cache writes, the masked softmax over the cache, ...); for one token a row each costs
// more in dispatch than in arithmetic. Here the layer is one node:
//   LayerNorm -> x Wqkv^T + b -> this token's K, V written IN PLACE into the layer's caches at (slot, head,
//   position) -> each head's query over its row's cached keys 0..position (+ the additive bias of those keys) ->
//   ctx Wproj^T + b -> + hidden -> LayerNorm -> x W1^T, bias + GeLU -> x W2^T + b -> + residual.
// The norms, GEMMs and bias + GeLU are the library's own kernels (cpu_norm_gelu.cc, cpu_linear.cc: their AOT entry
// points called directly, so the same code and the same column-block threading over oneDNN's sgemm); the cache
// write and the attention over the cache are here.
//
// gptlocal_decode_layer_fwd inputs (all float32 but write_index):
//   0 hidden [B, 1, H]        1 ln1 gamma [H]     2 ln1 beta [H]
//   3 Wqkv [Q, H]             4 bqkv [Q]          (Q = (N + 2G) D, group-major [G, (N/G q heads, k, v), D])
//   5 Wproj [H, N D]          6 bproj [H]         7 ln2 gamma [H]     8 ln2 beta [H]
//   9 W1 [I, H]              10 b1 [I]           11 W2 [H, I]       12 b2 [H]
//  13 key cache [Bc, G, L, D] 14 value cache [Bc, G, L, D]  (Parameters, written IN PLACE)
//  15 write_index int32 [B, G, 1, 3] ((slot, head, position), KVCache.write_index)
//  16 bias [B or 1, 1, 1, L]   (KVCache.attention_bias: 0 on rows 0..position, MASK_VALUE after)
//  17 args: DecodeLayerArgs (common.h: epsilon, scale, form 0 tanh / 1 quick GeLU, threads, precision: the GEMMs'
//     LinearArgs precision, 0 float32, 1 bf16 x bf16 -> f32, 2 the same emulated)
// output: 18 new hidden [B, 1, H]
// gptlocal_decode_layer_int8_fwd: the same layer of an int8 model (model/quant_cells.py QuantLinear: each weight int8
// [out, in] followed by its float32 per-channel scales [out]; its GEMMs are cpu_linear_int8.cc's, the input
// quantized per row): 0 hidden, 1-2 ln1, 3 Wqkv int8, 4 its scales, 5 bqkv, 6 Wproj int8, 7 scales, 8 bproj,
// 9-10 ln2, 11 W1 int8, 12 scales, 13 b1, 14 W2 int8, 15 scales, 16 b2, 17-18 the caches, 19 write_index, 20 bias,
// 21 args -> 22 new hidden.
// gptlocal_decode_layer_bf16w_fwd: the float32 layout with the four weights held as bfloat16 (a bf16 model built for
// inference, provider.py bf16_weights; precision 1 or 2): its GEMMs are cpu_linear.cc's gptlocal_linear_bf16w_fwd,
// the numbers of that model's plain decode graph.
// Row b's query attends to its slot's keys 0..position (what the bias keeps; the keys after it are masked by the
// bias in the plain graph, and skipped here). Scratch: per-thread buffers kept across calls (grown, never shrunk).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common.h"

typedef int (*AotKernel)(int, void **, int *, int64_t **, const char **, void *, void *);
extern "C" int gptlocal_layernorm_fwd(int, void **, int *, int64_t **, const char **, void *, void *);
extern "C" int gptlocal_bias_gelu_fwd(int, void **, int *, int64_t **, const char **, void *, void *);
extern "C" int gptlocal_linear_fwd(int, void **, int *, int64_t **, const char **, void *, void *);
extern "C" int gptlocal_linear_bf16w_fwd(int, void **, int *, int64_t **, const char **, void *, void *);
extern "C" int gptlocal_int8_linear_fwd(int, void **, int *, int64_t **, const char **, void *, void *);

namespace {

// One call of another AOT kernel of this library on float32 buffers of rank <= 2 (the argument structs included).
class SubCall {
 public:
  SubCall &add(const void *data, int64_t rows, int64_t cols = -1, const char *dtype = "float32") {
    params_[count_] = const_cast<void *>(data);
    dims_[count_][0] = rows;
    dims_[count_][1] = cols;
    ndims_[count_] = cols < 0 ? 1 : 2;
    shapes_[count_] = dims_[count_];
    dtypes_[count_] = dtype;
    ++count_;
    return *this;
  }
  template <class Args>
  SubCall &args(const Args &value) {
    return add(&value, static_cast<int64_t>(sizeof(Args) / sizeof(float)));
  }
  int run(AotKernel kernel, void *stream, void *extra) {
    return kernel(count_, params_, ndims_, shapes_, dtypes_, stream, extra);
  }

 private:
  void *params_[8];
  int ndims_[8];
  int64_t dims_[8][2];
  int64_t *shapes_[8];
  const char *dtypes_[8];
  int count_ = 0;
};

VEC_CLONES float dot_row(const float *a, const float *b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

VEC_CLONES void add_scaled(float *acc, const float *x, float f, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) acc[j] += f * x[j];
}

VEC_CLONES void add_into(float *y, const float *x, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) y[j] += x[j];
}

// softmax(q k_j * scale + bias_j) v_j over keys j = 0..count-1 into out [D]; scores: [count] scratch.
void attend(const float *q, const float *K, const float *V, const float *bias, int64_t count, int64_t D, float scale,
            float *scores, float *out) {
  float m = -INFINITY;
  for (int64_t j = 0; j < count; ++j) {
    const float s = dot_row(q, K + j * D, D) * scale + bias[j];
    scores[j] = s;
    m = s > m ? s : m;
  }
  float sum = 0.0f;
  for (int64_t j = 0; j < count; ++j) {
    const float e = exp_neg(scores[j] - m);
    scores[j] = e;
    sum += e;
  }
  std::fill(out, out + D, 0.0f);
  for (int64_t j = 0; j < count; ++j) add_scaled(out, V + j * D, scores[j], D);
  const float inv = 1.0f / sum;
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

// The calling thread's scratch, kept across calls (a decode step calls each layer once a token: no allocation
// after the first calls).
std::vector<float> &scratch(size_t floats) {
  thread_local std::vector<float> buffer;
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer;
}

// Where each input of a layer's call sits and the weights' dtype: the float32 layout (gptlocal_decode_layer_fwd), the
// same with bfloat16 weights (gptlocal_decode_layer_bf16w_fwd) or the int8 one, whose weights are each followed by
// their scales (scale -1: none).
struct Slots {
  int nparam, ln1, qkv_w, qkv_s, qkv_b, proj_w, proj_s, proj_b, ln2, fc1_w, fc1_s, fc1_b, fc2_w, fc2_s, fc2_b, key,
      value, index, bias, args, out;
  const char *weights;  // the four weights' dtype
  bool int8() const { return qkv_s >= 0; }
  bool bf16() const { return std::strcmp(weights, "bfloat16") == 0; }
  bool is_weight(int i) const { return i == qkv_w || i == proj_w || i == fc1_w || i == fc2_w; }
};
constexpr Slots FLOAT_SLOTS{19, 1, 3, -1, 4, 5, -1, 6, 7, 9, -1, 10, 11, -1, 12, 13, 14, 15, 16, 17, 18, "float32"};
constexpr Slots BF16_SLOTS{19, 1, 3, -1, 4, 5, -1, 6, 7, 9, -1, 10, 11, -1, 12, 13, 14, 15, 16, 17, 18, "bfloat16"};
constexpr Slots INT8_SLOTS{23, 1, 3, 4, 5, 6, 7, 8, 9, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, "int8"};

int decode_layer(const Slots &s, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                 void *stream, void *extra) {
  if (nparam != s.nparam) return 1;
  for (int i = 0; i < nparam; ++i) {
    const char *want = i == s.index ? "int32" : (s.is_weight(i) ? s.weights : "float32");
    if (std::strcmp(dtypes[i], want) != 0) return 1;
  }
  const DecodeLayerArgs *args = args_at<DecodeLayerArgs>(s.args, params, ndims, shapes, dtypes);
  const int precision = args == nullptr ? -1 : static_cast<int>(args->precision);
  // the GEMMs' precision: float32 weights any (0, or rounded to bf16 at each call), bf16 ones 1 or 2, int8 ones 0
  if (precision < 0 || precision > 2 || (s.bf16() && precision == 0) || (s.int8() && precision != 0)) return 1;
  if (ndims[0] != 3 || shapes[0][1] != 1 || ndims[s.key] != 4 || ndims[s.value] != 4) return 1;
  const int64_t B = shapes[0][0], H = shapes[0][2];
  const int64_t Bc = shapes[s.key][0], G = shapes[s.key][1], L = shapes[s.key][2], D = shapes[s.key][3];
  const int64_t Q = shapes[s.qkv_w][0], ND = shapes[s.proj_w][1], I = shapes[s.fc1_w][0];
  for (int axis = 0; axis < 4; ++axis) {
    if (shapes[s.value][axis] != shapes[s.key][axis]) return 2;
  }
  if (G <= 0 || D <= 0 || ND % D != 0) return 2;
  const int64_t N = ND / D, group = N / G;
  if (N % G != 0 || Q != (N + 2 * G) * D) return 2;
  const bool scales_ok = !s.int8() || (shapes[s.qkv_s][0] == Q && shapes[s.proj_s][0] == H &&
                                       shapes[s.fc1_s][0] == I && shapes[s.fc2_s][0] == H);
  const bool shapes_ok = scales_ok && shapes[s.ln1][0] == H && shapes[s.ln1 + 1][0] == H && shapes[s.qkv_w][1] == H &&
                         shapes[s.qkv_b][0] == Q && shapes[s.proj_w][0] == H && shapes[s.proj_b][0] == H &&
                         shapes[s.ln2][0] == H && shapes[s.ln2 + 1][0] == H && shapes[s.fc1_w][1] == H &&
                         shapes[s.fc1_b][0] == I && shapes[s.fc2_w][0] == H && shapes[s.fc2_w][1] == I &&
                         shapes[s.fc2_b][0] == H && ndims[s.index] == 4 && shapes[s.index][0] == B &&
                         shapes[s.index][1] == G && shapes[s.index][2] == 1 && shapes[s.index][3] == 3 &&
                         ndims[s.bias] == 4 && (shapes[s.bias][0] == 1 || shapes[s.bias][0] == B) &&
                         shapes[s.bias][3] == L && ndims[s.out] == 3 && shapes[s.out][0] == B && shapes[s.out][2] == H;
  if (!shapes_ok) return 2;
  const float *hidden = static_cast<const float *>(params[0]);
  float *key_cache = static_cast<float *>(params[s.key]);
  float *value_cache = static_cast<float *>(params[s.value]);
  const int32_t *index = static_cast<const int32_t *>(params[s.index]);
  const float *bias = static_cast<const float *>(params[s.bias]);
  float *out = static_cast<float *>(params[s.out]);
  if (B == 0) return 0;
  // where each row writes and how many keys it reads: every (slot, head, position) checked before anything is written
  int64_t keys = 0;  // key rows read, over rows and heads: the attention's work
  for (int64_t bg = 0; bg < B * G; ++bg) {
    const int32_t *at = index + bg * 3;
    if (at[0] < 0 || at[0] >= Bc || at[1] != bg % G || at[2] < 0 || at[2] >= L) return 4;
    keys += (at[2] + 1) * group;
  }

  const int threads = std::max(1, static_cast<int>(args->threads));
  std::vector<float> &buffer = scratch(static_cast<size_t>(B * (3 * H + Q + ND + I + 2)));
  float *normed = buffer.data(), *qkv = normed + B * H, *context = qkv + B * Q, *mid = context + B * ND,
        *inner = mid + B * H, *moments = inner + B * I, *swap = moments + 2 * B;  // swap: [B, H]
  const LayerNormArgs norm_args{args->epsilon, args->threads};
  const LinearArgs linear_args{args->threads, args->precision};
  const Int8LinearArgs int8_args{args->threads};
  const BiasGeluArgs gelu_args{args->form, args->threads};
  auto norm = [&](const float *x, int gamma, float *y) {
    return SubCall().add(x, B, H).add(params[gamma], H).add(params[gamma + 1], H).args(norm_args)
        .add(y, B, H).add(moments, B).add(moments + B, B).run(gptlocal_layernorm_fwd, stream, extra);
  };
  // x W^T (+ b): the GEMM kernel (float32 or bf16 weights, in `precision`), or the int8 one over the weight and its
  // scales (the slot after it)
  auto linear = [&](const float *x, int64_t in, int weight, int64_t width, const float *b, float *y) {
    SubCall call;
    call.add(x, B, in).add(params[weight], width, in, s.weights);
    if (s.int8()) call.add(params[weight + 1], width);
    if (b != nullptr) call.add(b, width);
    if (s.int8()) return call.args(int8_args).add(y, B, width).run(gptlocal_int8_linear_fwd, stream, extra);
    return call.args(linear_args).add(y, B, width)
        .run(s.bf16() ? gptlocal_linear_bf16w_fwd : gptlocal_linear_fwd, stream, extra);
  };

  // LayerNorm, QKV
  int status = norm(hidden, s.ln1, normed);
  if (status == 0) status = linear(normed, H, s.qkv_w, Q, static_cast<const float *>(params[s.qkv_b]), qkv);
  if (status != 0) return 10 + status;
  // this token's keys and values into the caches, in place
  for (int64_t bg = 0; bg < B * G; ++bg) {
    const int32_t *at = index + bg * 3;
    const int64_t b = bg / G, g = bg % G;
    const int64_t row = ((static_cast<int64_t>(at[0]) * G + g) * L + at[2]) * D;
    const float *k = qkv + b * Q + (g * (group + 2) + group) * D;
    std::memcpy(key_cache + row, k, sizeof(float) * D);
    std::memcpy(value_cache + row, k + D, sizeof(float) * D);
  }
  // each (row, head): its query over its slot's keys 0..position
  const int64_t tasks = B * N;
  run_parallel(threads_for(args->threads, keys * D), tasks, [&](std::atomic<int64_t> &next, int) {
    std::vector<float> scores(static_cast<size_t>(L));
    for (int64_t task = next.fetch_add(1); task < tasks; task = next.fetch_add(1)) {
      const int64_t b = task / N, n = task % N, g = n / group;
      const int32_t *at = index + (b * G + g) * 3;
      const int64_t base = (static_cast<int64_t>(at[0]) * G + g) * L * D;
      attend(qkv + b * Q + (g * (group + 2) + n % group) * D, key_cache + base, value_cache + base,
             bias + (shapes[s.bias][0] == 1 ? 0 : b) * L, at[2] + 1, D, args->scale, scores.data(),
             context + b * ND + n * D);
    }
  });
  // projection + residual, LayerNorm, fc1 + bias + GeLU, fc2 + residual
  status = linear(context, ND, s.proj_w, H, static_cast<const float *>(params[s.proj_b]), mid);
  if (status != 0) return 20 + status;
  for (int64_t b = 0; b < B; ++b) add_into(mid + b * H, hidden + b * H, H);
  status = norm(mid, s.ln2, normed);
  if (status == 0) status = linear(normed, H, s.fc1_w, I, nullptr, inner);
  if (status == 0) {
    status = SubCall().add(inner, B, I).add(params[s.fc1_b], I).args(gelu_args).add(inner, B, I)
                 .run(gptlocal_bias_gelu_fwd, stream, extra);
  }
  if (status == 0) status = linear(inner, I, s.fc2_w, H, static_cast<const float *>(params[s.fc2_b]), swap);
  if (status != 0) return 30 + status;
  for (int64_t b = 0; b < B; ++b) {
    const float *x = swap + b * H, *r = mid + b * H;
    float *y = out + b * H;
    for (int64_t h = 0; h < H; ++h) y[h] = r[h] + x[h];
  }
  return 0;
}

}  // namespace

extern "C" int gptlocal_decode_layer_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  return decode_layer(FLOAT_SLOTS, nparam, params, ndims, shapes, dtypes, stream, extra);
}

extern "C" int gptlocal_decode_layer_bf16w_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                               const char **dtypes, void *stream, void *extra) {
  return decode_layer(BF16_SLOTS, nparam, params, ndims, shapes, dtypes, stream, extra);
}

extern "C" int gptlocal_decode_layer_int8_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                              const char **dtypes, void *stream, void *extra) {
  return decode_layer(INT8_SLOTS, nparam, params, ndims, shapes, dtypes, stream, extra);
}
