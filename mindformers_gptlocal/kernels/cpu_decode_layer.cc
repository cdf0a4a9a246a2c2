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
//  17 args: DecodeLayerArgs (common.h: epsilon, scale, form 0 tanh / 1 quick GeLU, threads)
// output: 18 new hidden [B, 1, H]
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

namespace {

// One call of another AOT kernel of this library on float32 buffers of rank <= 2 (the argument structs included).
class SubCall {
 public:
  SubCall &add(const void *data, int64_t rows, int64_t cols = -1) {
    params_[count_] = const_cast<void *>(data);
    dims_[count_][0] = rows;
    dims_[count_][1] = cols;
    ndims_[count_] = cols < 0 ? 1 : 2;
    shapes_[count_] = dims_[count_];
    dtypes_[count_] = "float32";
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

}  // namespace

extern "C" int gptlocal_decode_layer_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                         void *stream, void *extra) {
  if (nparam != 19) return 1;
  for (int i = 0; i < nparam; ++i) {
    if (std::strcmp(dtypes[i], i == 15 ? "int32" : "float32") != 0) return 1;
  }
  const DecodeLayerArgs *args = args_at<DecodeLayerArgs>(17, params, ndims, shapes, dtypes);
  if (args == nullptr || ndims[0] != 3 || shapes[0][1] != 1 || ndims[13] != 4 || ndims[14] != 4) return 1;
  const int64_t B = shapes[0][0], H = shapes[0][2];
  const int64_t Bc = shapes[13][0], G = shapes[13][1], L = shapes[13][2], D = shapes[13][3];
  const int64_t Q = shapes[3][0], ND = shapes[5][1], I = shapes[9][0];
  for (int axis = 0; axis < 4; ++axis) {
    if (shapes[14][axis] != shapes[13][axis]) return 2;
  }
  if (G <= 0 || D <= 0 || ND % D != 0) return 2;
  const int64_t N = ND / D, group = N / G;
  if (N % G != 0 || Q != (N + 2 * G) * D) return 2;
  const bool shapes_ok = shapes[1][0] == H && shapes[2][0] == H && shapes[3][1] == H && shapes[4][0] == Q &&
                         shapes[5][0] == H && shapes[6][0] == H && shapes[7][0] == H && shapes[8][0] == H &&
                         shapes[9][1] == H && shapes[10][0] == I && shapes[11][0] == H && shapes[11][1] == I &&
                         shapes[12][0] == H && ndims[15] == 4 && shapes[15][0] == B && shapes[15][1] == G &&
                         shapes[15][2] == 1 && shapes[15][3] == 3 && ndims[16] == 4 &&
                         (shapes[16][0] == 1 || shapes[16][0] == B) && shapes[16][3] == L && ndims[18] == 3 &&
                         shapes[18][0] == B && shapes[18][2] == H;
  if (!shapes_ok) return 2;
  const float *hidden = static_cast<const float *>(params[0]);
  float *key_cache = static_cast<float *>(params[13]);
  float *value_cache = static_cast<float *>(params[14]);
  const int32_t *index = static_cast<const int32_t *>(params[15]);
  const float *bias = static_cast<const float *>(params[16]);
  float *out = static_cast<float *>(params[18]);
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
  const LinearArgs linear_args{args->threads};
  const BiasGeluArgs gelu_args{args->form, args->threads};
  auto norm = [&](const float *x, int gamma, float *y) {
    return SubCall().add(x, B, H).add(params[gamma], H).add(params[gamma + 1], H).args(norm_args)
        .add(y, B, H).add(moments, B).add(moments + B, B).run(gptlocal_layernorm_fwd, stream, extra);
  };
  auto linear = [&](const float *x, int64_t in, int weight, int64_t width, const float *b, float *y) {
    SubCall call;
    call.add(x, B, in).add(params[weight], width, in);
    if (b != nullptr) call.add(b, width);
    return call.args(linear_args).add(y, B, width).run(gptlocal_linear_fwd, stream, extra);
  };

  // LayerNorm, QKV
  int status = norm(hidden, 1, normed);
  if (status == 0) status = linear(normed, H, 3, Q, static_cast<const float *>(params[4]), qkv);
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
             bias + (shapes[16][0] == 1 ? 0 : b) * L, at[2] + 1, D, args->scale, scores.data(),
             context + b * ND + n * D);
    }
  });
  // projection + residual, LayerNorm, fc1 + bias + GeLU, fc2 + residual
  status = linear(context, ND, 5, H, static_cast<const float *>(params[6]), mid);
  if (status != 0) return 20 + status;
  for (int64_t b = 0; b < B; ++b) add_into(mid + b * H, hidden + b * H, H);
  status = norm(mid, 7, normed);
  if (status == 0) status = linear(normed, H, 9, I, nullptr, inner);
  if (status == 0) {
    status = SubCall().add(inner, B, I).add(params[10], I).args(gelu_args).add(inner, B, I)
                 .run(gptlocal_bias_gelu_fwd, stream, extra);
  }
  if (status == 0) status = linear(inner, I, 11, H, static_cast<const float *>(params[12]), swap);
  if (status != 0) return 30 + status;
  for (int64_t b = 0; b < B; ++b) {
    const float *x = swap + b * H, *r = mid + b * H;
    float *y = out + b * H;
    for (int64_t h = 0; h < H; ++h) y[h] = r[h] + x[h];
  }
  return 0;
}
