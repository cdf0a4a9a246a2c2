// The LM head and its cross-entropy loss fused, for CPU training: the typed cores of gptlocal_head_loss_fwd / _bwd
// (kernels/abi/table.py; kernels/cells/head_loss.py CPUHeadLoss; model/gpt.py's training loss).
//
// Why: the plain path's head + loss (x w^T, LogSoftmax, GatherD, and their gradients) keeps [T, V] float32 tensors
// across the step (the logits, the log-probabilities the backward reads, their gradient: each 103 MB at GPT-2's
// vocabulary and 2 x 256 tokens) and passes over them several times. Here the forward runs over chunks of rows: a
// chunk's logits, their softmax, its rows' losses and, at once, the loss's gradient with respect to the logits
// (row_weight (softmax - onehot)) through the two GEMMs of the backward, so no [T, V] tensor exists. The forward
// returns the loss and its gradients with respect to x and w; the backward scales them by the loss's incoming
// gradient (the loss scale, an accumulation's weight). Three GEMMs, as the plain path's, through oneDNN's sgemm on
// the library's worker threads; the chunk's logits in a buffer of this file, kept between calls (at most
// kChunkFloats floats unless one row is longer).
//
// forward:  x [T, H], w [V, H], labels [T] (int32), row_weight [T]
//             -> loss [1] = sum_t row_weight[t] (logsumexp_v (x_t . w_v) - x_t . w_label[t]),
//                gx [T, H] = d loss / d x, gw [V, H] = d loss / d w;
//           a row of weight 0 adds nothing (its label is not read: -100 and the like are fine); any other row's label
//           must be in [0, V), else the call fails (status 1) with nothing written. HeadLossOptions.rows: the rows of
//           a chunk (0: chunks of equal rows, as many as fit kChunkFloats, at least 64).
// backward: gx, gw, dloss [1] -> dx = dloss gx, dw = dloss gw.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "common.h"

namespace {

constexpr int64_t kChunkFloats = int64_t(1) << 24;  // 64 MB of logits a chunk
constexpr int64_t kMinChunkRows = 64;

// Row l [V] of logits -> the row's loss (logsumexp - l[label]) and, in place, the loss's gradient
// weight (softmax(l) - onehot(label)).
VEC_FN(double, softmax_grad_row, (float *l, int64_t V, int32_t label, float weight), (l, V, label, weight)) {
  float m = l[0];
  for (int64_t v = 1; v < V; ++v) m = std::max(m, l[v]);
  const float picked = l[label];
  const float sum = exp_sum(l, V, m);
  const float scale = weight / sum;
#pragma omp simd
  for (int64_t v = 0; v < V; ++v) l[v] *= scale;
  l[label] -= weight;
  return static_cast<double>(m) + std::log(static_cast<double>(sum)) - static_cast<double>(picked);
}

}  // namespace

int gptlocal_core_head_loss_fwd(const float *x, const float *w, const int32_t *labels, const float *row_weight,
                                float *loss, float *gx, float *gw, int64_t T, int64_t H, int64_t V,
                                const HeadLossOptions &options) {
  if (H <= 0 || V <= 0) return Status::kBadShape;
  for (int64_t t = 0; t < T; ++t) {
    if (row_weight[t] != 0.0f && (labels[t] < 0 || labels[t] >= V)) return Status::kTokenId;
  }
  if (T == 0) {  // nothing flows back
    std::fill(gw, gw + V * H, 0.0f);
    *loss = 0.0f;
    return 0;
  }
  const int threads = std::max(1, options.threads);
  int64_t rows = options.rows > 0 ? options.rows : std::max(kMinChunkRows, kChunkFloats / V);
  rows = std::max<int64_t>(1, std::min(rows, T));
  if (options.rows <= 0) {  // chunks of equal rows
    const int64_t chunks = (T + rows - 1) / rows;
    rows = (T + chunks - 1) / chunks;
  }
  thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(rows * V)) buffer.resize(static_cast<size_t>(rows * V));
  std::vector<double> row_loss(static_cast<size_t>(T), 0.0);
  float *l = buffer.data();
  for (int64_t t0 = 0; t0 < T; t0 += rows) {
    const int64_t n = std::min(rows, T - t0);
    const float *xc = x + t0 * H;
    const int gemm = gemm_threads(threads, n * V * H);
    column_blocks(gemm, V, [&](int64_t v0, int64_t v1) {  // l[:, v0:v1] = xc w[v0:v1]^T
      dnnl_sgemm('N', 'T', n, v1 - v0, H, 1.0f, xc, H, w + v0 * H, H, 0.0f, l + v0, V);
    });
    run_chunks(threads_for(threads, n * V), n, [&](int, int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        float *row = l + r * V;
        const float weight = row_weight[t0 + r];
        if (weight == 0.0f) {
          std::fill(row, row + V, 0.0f);
        } else {
          row_loss[t0 + r] = weight * softmax_grad_row(row, V, labels[t0 + r], weight);
        }
      }
    });
    column_blocks(gemm, H, [&](int64_t k0, int64_t k1) {  // gx[t0:t0+n, k0:k1] = g w[:, k0:k1]
      dnnl_sgemm('N', 'N', n, k1 - k0, V, 1.0f, l, V, w + k0, H, 0.0f, gx + t0 * H + k0, H);
    });
    const float beta = t0 == 0 ? 0.0f : 1.0f;  // gw sums the chunks' g^T xc
    column_blocks(gemm, V, [&](int64_t v0, int64_t v1) {
      dnnl_sgemm('T', 'N', v1 - v0, H, n, 1.0f, l + v0, V, xc, H, beta, gw + v0 * H, H);
    });
  }
  double total = 0.0;  // in row order: the same loss whatever the threads and the chunk
  for (int64_t t = 0; t < T; ++t) total += row_loss[t];
  *loss = static_cast<float>(total);
  return 0;
}

int gptlocal_core_head_loss_bwd(const float *gx, const float *gw, const float *dloss, float *dx, float *dw, int64_t T,
                                int64_t H, int64_t V, const HeadLossOptions &options) {
  const float scale = *dloss;
  const auto scaled = [&](const float *in, float *out, int64_t count) {
    run_chunks(threads_for(options.threads, count), count, [&](int, int64_t begin, int64_t end) {
#pragma omp simd
      for (int64_t i = begin; i < end; ++i) out[i] = scale * in[i];
    });
  };
  scaled(gx, dx, T * H);
  scaled(gw, dw, V * H);
  return 0;
}
