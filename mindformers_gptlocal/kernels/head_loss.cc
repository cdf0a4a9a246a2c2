// Fused output head + cross-entropy for CPU training, as a MindSpore AOT kernel: the loss of
//   logits = hidden @ weight^T,  loss = sum_r w[r] * (logsumexp(logits[r]) - logits[r, label[r]])
// and its gradients d_hidden = dlogits @ weight, d_weight = dlogits^T @ hidden (dlogits = w * (softmax - onehot)),
// without the [N, V] logits (nor the log-softmax and gradient buffers of that size).
//
// Built by mindformers_gptlocal/kernels/build.py into the same library as the attention kernel, called through
// ops.Custom("lib.so:gptlocal_head_loss", ..., func_type="aot", bprop=...) (kernels/head_loss.py).
//
// The loss is the last op of the step and linear in its output's gradient, so this one call computes the loss
// and both gradients for d_loss = 1; the bprop multiplies them by the incoming d_loss. Three GEMMs of the head's
// size in all, as the plain path's forward + backward (a backward that recomputed the logits would be four).
//
// Rows with w[r] == 0 (ignored labels, loss_mask 0) are skipped: their d_hidden is 0 and they are not computed.
// The active rows go in balanced chunks of at most C rows; per chunk a [C, V] scratch of logits (the only
// vocab-sized buffer: C x V floats, C chosen in Python from a memory budget, the buffer kept between calls).
// Per chunk, threads over vocab blocks of Vb:
//   phase 1: logits[:, block] = h_chunk @ W[block]^T (dnnl_sgemm), each row's block max and sum of exp
//            (online log-sum-exp: blocks merged as (m, s) pairs), then lse per row, nll, the loss;
//   phase 2: dlogits[:, block] = w * (exp(logits - lse) - onehot) in place, d_W[block] (+)= dlogits^T @ h_chunk
//            (each block owned by one thread: no race), and the thread's own d_h [C, H] += dlogits @ W[block];
//            the threads' d_h are summed into the chunk's rows of d_hidden.
//
// Inputs: hidden [N, H] f32, weight [V, H] f32, labels [N] int32 (0 <= label < V), w [N] f32 (row weights,
// e.g. keep / count), config f32 [3] (threads, chunk rows, vocab block).
// Outputs: loss [1] f32, d_hidden [N, H] f32, d_weight [V, H] f32. Returns 1 (MindSpore raises) on a label
// outside [0, V) in a row with w != 0, or on wrong shapes or dtypes.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "common.h"

namespace {

VEC_CLONES float row_max(const float *x, int64_t n) {
  float m = -INFINITY;
  for (int64_t j = 0; j < n; ++j) m = x[j] > m ? x[j] : m;
  return m;
}

VEC_CLONES float row_exp_sum(const float *x, int64_t n, float m) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t j = 0; j < n; ++j) s += exp_neg(x[j] - m);
  return s;
}

// x[j] <- w * exp(x[j] - lse)
VEC_CLONES void row_softmax_scaled(float *x, int64_t n, float lse, float w) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) x[j] = w * exp_neg(x[j] - lse);
}

VEC_CLONES void add_into(float *dst, const float *src, int64_t n) {
#pragma omp simd
  for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
}

// The [chunk, V] logits scratch, kept between calls (one per process, behind a lock): a fresh 32 MB buffer
// each call cost its page faults and zero fill every step (~10% of the tiny model's head on this CPU).
std::mutex scratch_mutex;
std::vector<float> scratch_logits;

}  // namespace

extern "C" int gptlocal_head_loss(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                  void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 8) return 1;
  if (ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 1 || ndims[3] != 1) return 1;
  if (std::strcmp(dtypes[0], "float32") != 0 || std::strcmp(dtypes[1], "float32") != 0 ||
      std::strcmp(dtypes[2], "int32") != 0 || std::strcmp(dtypes[3], "float32") != 0)
    return 1;
  const int64_t N = shapes[0][0], H = shapes[0][1], V = shapes[1][0];
  if (shapes[1][1] != H || shapes[2][0] != N || shapes[3][0] != N || V <= 0) return 1;
  const float *hidden = static_cast<const float *>(params[0]);
  const float *weight = static_cast<const float *>(params[1]);
  const int32_t *labels = static_cast<const int32_t *>(params[2]);
  const float *w = static_cast<const float *>(params[3]);
  const float *cfg = static_cast<const float *>(params[4]);
  float *loss_out = static_cast<float *>(params[5]);
  float *d_hidden = static_cast<float *>(params[6]);
  float *d_weight = static_cast<float *>(params[7]);
  const int threads = std::max(1, static_cast<int>(cfg[0]));
  const int64_t chunk = std::max<int64_t>(1, static_cast<int64_t>(cfg[1]));
  const int64_t vb = std::max<int64_t>(1, std::min<int64_t>(V, static_cast<int64_t>(cfg[2])));
  const int64_t vblocks = (V + vb - 1) / vb;

  std::vector<int64_t> active;
  active.reserve(static_cast<size_t>(N));
  for (int64_t r = 0; r < N; ++r) {
    if (w[r] == 0.0f) continue;
    if (labels[r] < 0 || labels[r] >= V) return 1;
    active.push_back(r);
  }
  std::memset(d_hidden, 0, sizeof(float) * static_cast<size_t>(N * H));
  loss_out[0] = 0.0f;
  if (active.empty()) {
    std::memset(d_weight, 0, sizeof(float) * static_cast<size_t>(V * H));
    return 0;
  }
  const int64_t count = static_cast<int64_t>(active.size()), chunks = (count + chunk - 1) / chunk;
  const int64_t rows_max = (count + chunks - 1) / chunks;  // balanced chunks of at most `chunk` rows
  const int team = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, vblocks)));
  std::lock_guard<std::mutex> hold(scratch_mutex);
  const size_t scratch = static_cast<size_t>(rows_max * V);
  if (scratch_logits.size() < scratch) scratch_logits.resize(scratch);
  float *const logits = scratch_logits.data();
  std::vector<float> h_chunk(static_cast<size_t>(rows_max * H));
  std::vector<float> block_m(static_cast<size_t>(vblocks * rows_max)), block_s(static_cast<size_t>(vblocks * rows_max));
  std::vector<float> lse(static_cast<size_t>(rows_max)), rw(static_cast<size_t>(rows_max));
  std::vector<std::vector<float>> dh(static_cast<size_t>(team));
  double loss = 0.0;
  bool first = true;
  for (size_t c0 = 0; c0 < active.size(); c0 += static_cast<size_t>(rows_max), first = false) {
    const int64_t rows = std::min<int64_t>(rows_max, static_cast<int64_t>(active.size() - c0));
    for (int64_t r = 0; r < rows; ++r) {  // the chunk's active rows, contiguous
      std::memcpy(h_chunk.data() + r * H, hidden + active[c0 + r] * H, sizeof(float) * static_cast<size_t>(H));
      rw[r] = w[active[c0 + r]];
    }
    // phase 1: logits block by block, each row's (max, sum of exp) per block
    run_parallel(team, vblocks, [&](std::atomic<int64_t> &next, int) {
      for (int64_t blk = next.fetch_add(1); blk < vblocks; blk = next.fetch_add(1)) {
        const int64_t j0 = blk * vb, cols = std::min<int64_t>(vb, V - j0);
        float *out = logits + j0;
        dnnl_sgemm('N', 'T', rows, cols, H, 1.0f, h_chunk.data(), H, weight + j0 * H, H, 0.0f, out, V);
        for (int64_t r = 0; r < rows; ++r) {
          const float m = row_max(out + r * V, cols);
          block_m[blk * rows_max + r] = m;
          block_s[blk * rows_max + r] = row_exp_sum(out + r * V, cols, m);
        }
      }
    });
    for (int64_t r = 0; r < rows; ++r) {  // merge the blocks' (max, sum): log-sum-exp of the whole row
      float m = -INFINITY;
      for (int64_t blk = 0; blk < vblocks; ++blk) m = std::max(m, block_m[blk * rows_max + r]);
      double s = 0.0;
      for (int64_t blk = 0; blk < vblocks; ++blk)
        s += static_cast<double>(block_s[blk * rows_max + r]) *
             std::exp(static_cast<double>(block_m[blk * rows_max + r] - m));
      lse[r] = m + static_cast<float>(std::log(s));
      const int32_t label = labels[active[c0 + r]];
      loss += static_cast<double>(rw[r]) * (static_cast<double>(lse[r]) - logits[r * V + label]);
    }
    // phase 2: dlogits in place, then d_weight per block (owned) and d_hidden per thread
    // blocks dealt to the threads statically (t, t + team, ...): each thread's d_h sums the same blocks in the
    // same order on every call, so d_hidden is bitwise reproducible (resume stays bit-exact)
    run_parallel(team, team, [&](std::atomic<int64_t> &, int t) {
      std::vector<float> &mine = dh[static_cast<size_t>(t)];
      mine.assign(static_cast<size_t>(rows * H), 0.0f);
      for (int64_t blk = t; blk < vblocks; blk += team) {
        const int64_t j0 = blk * vb, cols = std::min<int64_t>(vb, V - j0);
        float *g = logits + j0;
        for (int64_t r = 0; r < rows; ++r) {
          row_softmax_scaled(g + r * V, cols, lse[r], rw[r]);
          const int64_t label = labels[active[c0 + r]];
          if (label >= j0 && label < j0 + cols) g[r * V + (label - j0)] -= rw[r];
        }
        dnnl_sgemm('T', 'N', cols, H, rows, 1.0f, g, V, h_chunk.data(), H, first ? 0.0f : 1.0f,
                   d_weight + j0 * H, H);
        dnnl_sgemm('N', 'N', rows, H, cols, 1.0f, g, V, weight + j0 * H, H, 1.0f, mine.data(), H);
      }
    });
    for (int t = 0; t < team; ++t) {
      for (int64_t r = 0; r < rows; ++r)
        add_into(d_hidden + active[c0 + r] * H, dh[static_cast<size_t>(t)].data() + r * H, H);
    }
  }
  loss_out[0] = static_cast<float>(loss);
  return 0;
}
