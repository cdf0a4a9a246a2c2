// One decoder layer of a decode step (one new token per row) in one MindSpore node, for every layout the model
// builds: the typed cores of gptlocal_decode_layer_fwd, _int8_fwd and _bf16w_fwd (gpt_local, kernels/abi/table.py;
// kernels/cells/decode_layer.py; model/gpt.py GPTLocalBlock). A thin caller of the native runner's layer function
// (cpu_decoder.cc layer_forward: norms, GEMMs, rope, the in-place cache write, attention over each row's cached
// positions, the residuals, the MLP), so the compiled decode graph and the native runner compute a layer one way.
//
// Why a node: the plain decode graph runs ~20-30 small MindSpore ops a layer; for one token a row each costs more in
// dispatch than in arithmetic. The runtime's compiled runner (runtime/runner.py) runs this node in its decode graphs;
// the native runner (runtime/native.py) calls the layer function directly.
//
// The tensors (kernels/abi/table.py decode_layer_inputs; the parameters, from kernels/abi/layer_table.py, reach the core as one
// DecoderLayer): hidden [B, 1, H]; norm1 weight [H] and bias (LayerNorm; else a
// placeholder); each Linear's weight [out, in] (float32, bfloat16 bits or int8), its float32 scales (int8; else a
// placeholder) and its bias (where the options say the layer has one; else a placeholder): qkv [Q, H]
// (Q = (N + 2G) D, group-major), proj [H, N D], fc1 [I, H], gate [I, H] (SwiGLU; else a placeholder), fc2 [H, I];
// norm2 weight, bias; the key and value caches [Bc, G, L, D] (Parameters, written IN PLACE); write_index int32
// [B, G, 1, 3] ((slot, head, position), KVCache.write_index); bias [B or 1, 1, 1, L] (KVCache.attention_bias: each
// row reads its rows 0..position, the bias added to their scores); cos, sin [B, 1, 1, R] of each row's position
// (rope; else placeholders) -> the new hidden [B, 1, H]. DecodeLayerOptions: epsilon, scale, form (an MlpForm),
// threads, precision (LinearOptions': float32 weights 0 or a bf16 model's 1 / 2; bf16 weights 1 or 2; int8 0), norm
// (a NormKind), rotary_dim (0: none), parallel_residual, qkv_bias,
// bias (proj, fc1, gate, fc2). Inference only (no dropout, no backward). Scratch: one per-thread buffer, grown, kept.
#include <cstdint>
#include <vector>

#include "common.h"
#include "cpu_decoder.h"

namespace {

using gptlocal::decoder::Arena;
using gptlocal::decoder::LayerShape;
using gptlocal::decoder::LayerWeights;
using gptlocal::decoder::Rows;

// The weights' dtypes: the precisions each takes.
bool precision_fits(int weights, int precision) {
  switch (weights) {
    case WeightKind::kFloat32: return precision >= 0 && precision <= 2;
    case WeightKind::kBfloat16: return precision == 1 || precision == 2;
    case WeightKind::kInt8: return precision == 0;
    default: return false;
  }
}

// The layer's core: its Parameters as the tensors hand them (cores.h's DecoderLayer, generated from
// kernels/abi/layer_table.py, the placeholders dropped here by the options), the caches, the rows' write index.
int decode_layer(int weights, const float *hidden, const DecoderLayer &given, float *key_cache, float *value_cache,
                 const int32_t *index, const float *attention_bias, const float *cos, const float *sin, float *out,
                 int64_t B, int64_t H, int64_t Q, int64_t ND, int64_t I, int64_t Bc, int64_t G, int64_t L, int64_t D,
                 int64_t Bb, const DecodeLayerOptions &o) {
  if (!precision_fits(weights, o.precision)) return Status::kBadCall;
  if (G <= 0 || D <= 0 || ND % D != 0 || (Bb != 1 && Bb != B)) return Status::kBadShape;
  const int64_t N = ND / D;
  if (N % G != 0 || Q != (N + 2 * G) * D) return Status::kBadShape;
  if (B == 0) return Status::kOk;
  // each row's slot and position (the same for every head of the row), checked before anything is written
  std::vector<int32_t> slot(static_cast<size_t>(B)), pos(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    slot[b] = index[b * G * 3];
    pos[b] = index[b * G * 3 + 2];
    for (int64_t g = 0; g < G; ++g) {
      const int32_t *at = index + (b * G + g) * 3;
      if (at[0] != slot[b] || at[1] != g || at[2] != pos[b] || at[0] < 0 || at[0] >= Bc || at[2] < 0 || at[2] >= L) {
        return Status::kCacheIndex;
      }
    }
  }
  const bool layer_norm = o.norm == NormKind::kLayerNorm, int8 = weights == WeightKind::kInt8;
  const bool gated = o.form == MlpForm::kSwiglu;
  const LayerShape shape{static_cast<int32_t>(H), static_cast<int32_t>(N), static_cast<int32_t>(G),
                         static_cast<int32_t>(D), static_cast<int32_t>(I), o.norm, o.rotary_dim, o.form,
                         o.parallel_residual, weights, o.precision, o.threads, o.epsilon};
  auto bias = [](const float *b, bool present) { return present ? b : nullptr; };
  auto scales = [int8](const float *s) { return int8 ? s : nullptr; };
  LayerWeights w = given;
  w.scale = o.scale;
  w.norm1_bias = bias(given.norm1_bias, layer_norm);
  w.norm2_bias = bias(given.norm2_bias, layer_norm);
  w.qkv_scale = scales(given.qkv_scale);
  w.qkv_bias = bias(given.qkv_bias, o.qkv_bias != 0);
  w.proj_scale = scales(given.proj_scale);
  w.proj_bias = bias(given.proj_bias, o.bias != 0);
  w.fc1_scale = scales(given.fc1_scale);
  w.fc1_bias = bias(given.fc1_bias, o.bias != 0);
  w.gate = gated ? given.gate : nullptr;
  w.gate_scale = gated ? scales(given.gate_scale) : nullptr;
  w.gate_bias = bias(given.gate_bias, gated && o.bias);
  w.fc2_scale = scales(given.fc2_scale);
  w.fc2_bias = bias(given.fc2_bias, o.bias != 0);
  drop_absent(w, o.absent);  // every parameter the model handed a placeholder (layer_table.py LAYER's, by name)
  const Rows rows{B, 1, slot.data(), pos.data(), L, attention_bias, Bb == 1 ? 0 : L};
  Arena counting(nullptr, 0);
  const int64_t bytes = gptlocal::decoder::layer_workspace(shape, B, &counting);
  thread_local std::vector<char> workspace;  // grown, kept: a decode step calls each layer once a token
  if (workspace.size() < static_cast<size_t>(bytes) + 64) workspace.resize(static_cast<size_t>(bytes) + 64);
  char *base = workspace.data() + (64 - reinterpret_cast<uintptr_t>(workspace.data()) % 64) % 64;
  Arena arena(base, bytes);
  return gptlocal::decoder::layer_forward(shape, w, rows, hidden, out, key_cache, value_cache,
                                          o.rotary_dim ? cos : nullptr, o.rotary_dim ? sin : nullptr, &arena);
}

}  // namespace

// The float32 layer, the bfloat16-weight one and the int8 one: one body, three typed cores (the table's three
// entries; DecoderLayer holds any weight dtype).
int gptlocal_core_decode_layer_fwd(const float *hidden, const DecoderLayer &layer, float *key_cache, float *value_cache,
                                   const int32_t *write_index, const float *bias, const float *cos, const float *sin,
                                   float *out, int64_t B, int64_t H, int64_t Q, int64_t ND, int64_t I, int64_t Bc,
                                   int64_t G, int64_t L, int64_t D, int64_t Bb, const DecodeLayerOptions &options) {
  return decode_layer(WeightKind::kFloat32, hidden, layer, key_cache, value_cache, write_index, bias, cos, sin, out, B,
                      H, Q, ND, I, Bc, G, L, D, Bb, options);
}

int gptlocal_core_decode_layer_bf16w_fwd(const float *hidden, const DecoderLayer &layer, float *key_cache,
                                         float *value_cache, const int32_t *write_index, const float *bias,
                                         const float *cos, const float *sin, float *out, int64_t B, int64_t H,
                                         int64_t Q, int64_t ND, int64_t I, int64_t Bc, int64_t G, int64_t L, int64_t D,
                                         int64_t Bb, const DecodeLayerOptions &options) {
  return decode_layer(WeightKind::kBfloat16, hidden, layer, key_cache, value_cache, write_index, bias, cos, sin, out,
                      B, H, Q, ND, I, Bc, G, L, D, Bb, options);
}

int gptlocal_core_decode_layer_int8_fwd(const float *hidden, const DecoderLayer &layer, float *key_cache,
                                        float *value_cache, const int32_t *write_index, const float *bias,
                                        const float *cos, const float *sin, float *out, int64_t B, int64_t H,
                                        int64_t Q, int64_t ND, int64_t I, int64_t Bc, int64_t G, int64_t L, int64_t D,
                                        int64_t Bb, const DecodeLayerOptions &options) {
  return decode_layer(WeightKind::kInt8, hidden, layer, key_cache, value_cache, write_index, bias, cos, sin, out, B, H,
                      Q, ND, I, Bc, G, L, D, Bb, options);
}
