// Fused causal attention for CPU, forward and backward (FlashAttention-2's scheme), as MindSpore AOT kernels.
//
// Built by mindformers_gptlocal/kernels/abi/build.py with the system g++ (-O3 -fPIC -shared -fopenmp), called
// through ops.Custom("lib.so:gptlocal_attention_fwd", ..., func_type="aot", bprop=...) (kernels/cells/attention.py); the
// entry points are generated from kernels/abi/table.py and call the typed cores here.
//
// Query blocks x key blocks with an online softmax: the forward keeps only the output and the row logsumexp
// (no [B, N, S, S] buffer); the backward recomputes each block's probabilities from the logsumexp. Blocks past
// the diagonal are skipped; key j > query i is masked in the diagonal blocks (causal by construction); the
// additive bias [Bb, 1, S, S] (Bb 1 or B: gpt_local's causal, packed-document or reset mask) is added to
// every score block that is computed, so the probabilities are the plain path's softmax over the same
// numbers. GQA: query head n reads key/value head n / (N / G), no repeat. Dropout on the probabilities
// reproduces gpt_local's counter masks (model/dropout.py) element for element: element (b, n, i, j) of the
// [B, N, S, S] probabilities is dropped or kept by T1[(idx + a) % P1] vs T2[(idx + b) % P2], idx its flat
// index, a and b the step/site offsets computed in the graph.
//
// GEMMs go through oneDNN's dnnl_sgemm (build.py: the onednn-cpu-gomp package's libdnnl.so.3, or MindSpore 2.9's
// already-loaded copy of that soname), one sequential call per worker (common.h SequentialGemm) inside our threads:
// run_parallel, over (batch, head, query block) forward and (batch, key/value head) backward. The elementwise
// loops (scale, max, exp, sums, dropout) are written for the auto-vectoriser and compiled for a baseline x86-64
// plus AVX2 and AVX-512 versions, the one run chosen by the library's ISA decision (common.h VEC_FN), so one
// cached library is right on any x86-64 CPU.
//
// Forward: q [B,N,S,D] k [B,G,S,D] v [B,G,S,D] bias [Bb,1,S,S] t1 [P1] t2 [P2] (0/1 float32 dropout tables, or [1]
// each with no dropout) offsets int32 [2] (a, b), AttentionOptions (scale, dropout scale, dropout mode 0 none / 1
// keep where the bits agree / 2 keep where they differ, threads, query block, key block) -> out [B,N,S,D],
// lse [B,N,S]. Backward: the forward's inputs, then out, lse, dout -> dq, dk, dv.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <algorithm>
#include <atomic>
#include <thread>

#include "common.h"

namespace {

inline void gemm(char ta, char tb, dim_t M, dim_t N, dim_t K, float alpha, const float *A, dim_t lda,
                 const float *B, dim_t ldb, float beta, float *C, dim_t ldc) {
  if (M <= 0 || N <= 0) return;
  dnnl_sgemm(ta, tb, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

// Adds the bias row, masks keys past the query (causal), returns the row max.
VEC_FN(float, bias_mask_max, (float *s, const float *bias, int n, int valid), (s, bias, n, valid)) {
  float m = -INFINITY;
  for (int j = 0; j < n; ++j) {
    float v = s[j] + bias[j];
    v = j < valid ? v : -INFINITY;
    s[j] = v;
    m = v > m ? v : m;
  }
  return m;
}

VEC_FN(void, mul_into, (float *dst, const float *a, const float *b, int n), (dst, a, b, n)) {
#pragma omp simd
  for (int j = 0; j < n; ++j) dst[j] = a[j] * b[j];
}

VEC_FN(void, scale_row, (float *x, int n, float f), (x, n, f)) {
#pragma omp simd
  for (int j = 0; j < n; ++j) x[j] *= f;
}

// dS = P * (dP - D) in place of dp
VEC_FN(void, softmax_grad, (float *dp, const float *p, int n, float row), (dp, p, n, row)) {
#pragma omp simd
  for (int j = 0; j < n; ++j) dp[j] = p[j] * (dp[j] - row);
}

VEC_FN(float, dot, (const float *a, const float *b, int n), (a, b, n)) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int j = 0; j < n; ++j) s += a[j] * b[j];
  return s;
}

// The options as the loops read them, the query heads a key/value head serves, the query blocks, the dropout.
struct Plan {
  float scale;
  int threads, bq, bk;
  int64_t group, qblocks;
  Dropout drop;
};

// The plan of a call, or false where the kernel cannot compute it (key/value heads that do not divide the query
// heads, a bias of another batch, dropout without its tables).
bool read_plan(int64_t B, int64_t N, int64_t S, int64_t G, int64_t Bb, const float *t1, const float *t2,
               const int32_t *offsets, int64_t P1, int64_t P2, const AttentionOptions &options, Plan *sh) {
  if (G <= 0 || N % G != 0 || (Bb != 1 && Bb != B)) return false;
  const int bq = std::max(1, options.query_block);
  *sh = Plan{options.scale, std::max(1, options.threads), bq, std::max(1, options.key_block), N / G,
             (S + bq - 1) / bq, Dropout{}};
  sh->drop.scale = options.dropout_scale;
  sh->drop.mode = options.dropout_mode;
  sh->drop.t1 = t1;
  sh->drop.t2 = t2;
  sh->drop.p1 = P1;
  sh->drop.p2 = P2;
  sh->drop.a = offsets[0];
  sh->drop.b = offsets[1];
  return sh->drop.mode == 0 || (P1 >= 2 && P2 >= 2);
}

}  // namespace

int gptlocal_core_attention_fwd(const float *q, const float *k, const float *v, const float *bias, const float *t1,
                                const float *t2, const int32_t *offsets, float *out, float *lse, int64_t B, int64_t N,
                                int64_t S, int64_t D, int64_t G, int64_t Bb, int64_t P1, int64_t P2,
                                const AttentionOptions &options) {
  Plan sh;
  if (!read_plan(B, N, S, G, Bb, t1, t2, offsets, P1, P2, options, &sh)) return Status::kBadCall;
  const int bq = sh.bq, bk = sh.bk;
  const int64_t group = sh.group, qblocks = sh.qblocks, tasks = B * N * qblocks;
  run_parallel(sh.threads, tasks, [&](std::atomic<int64_t> &next, int) {
    std::vector<float> scores(static_cast<size_t>(bq) * bk), keep(static_cast<size_t>(bk)),
        dropped(static_cast<size_t>(bq) * bk), acc(static_cast<size_t>(bq) * D), row_max(bq), row_sum(bq);
    for (int64_t task = next.fetch_add(1); task < tasks; task = next.fetch_add(1)) {
      // the last query blocks (the most key blocks) first
      const int64_t qb = qblocks - 1 - task % qblocks, bn = task / qblocks, b = bn / N, n = bn % N;
      const int64_t i0 = qb * bq, i1 = std::min<int64_t>(S, i0 + bq), rows = i1 - i0;
      const float *Q = q + (bn * S + i0) * D;
      const float *K = k + ((b * G + n / group) * S) * D;
      const float *V = v + ((b * G + n / group) * S) * D;
      const float *bias_rows = bias + ((Bb == 1 ? 0 : b) * S) * S;
      std::fill(acc.begin(), acc.begin() + rows * D, 0.0f);
      std::fill(row_max.begin(), row_max.end(), -INFINITY);
      std::fill(row_sum.begin(), row_sum.end(), 0.0f);
      for (int64_t j0 = 0; j0 < i1; j0 += bk) {
        const int64_t cols = std::min<int64_t>(bk, i1 - j0);
        gemm('N', 'T', rows, cols, D, sh.scale, Q, D, K + j0 * D, D, 0.0f, scores.data(), cols);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r;
          float *s = scores.data() + r * cols;
          const int valid = static_cast<int>(std::min<int64_t>(cols, i - j0 + 1));  // keys j <= i
          const float block_max = bias_mask_max(s, bias_rows + i * S + j0, static_cast<int>(cols), valid);
          const float m_new = std::max(row_max[r], block_max);
          const float correction = row_max[r] == -INFINITY ? 0.0f : exp_neg(row_max[r] - m_new);
          const float sum = exp_sum(s, cols, m_new);
          row_sum[r] = row_sum[r] * correction + sum;
          row_max[r] = m_new;
          if (correction != 1.0f) scale_row(acc.data() + r * D, static_cast<int>(D), correction);
          if (sh.drop.mode != 0) {
            drop_row(sh.drop, (bn * S + i) * S + j0, static_cast<int>(cols), keep.data());
            mul_into(dropped.data() + r * cols, s, keep.data(), static_cast<int>(cols));
          }
        }
        gemm('N', 'N', rows, D, cols, 1.0f, sh.drop.mode != 0 ? dropped.data() : scores.data(), cols,
             V + j0 * D, D, 1.0f, acc.data(), D);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = 1.0f / row_sum[r];
        float *o = out + (bn * S + i0 + r) * D;
        const float *a = acc.data() + r * D;
        for (int64_t d = 0; d < D; ++d) o[d] = a[d] * inv;
        lse[bn * S + i0 + r] = row_max[r] + std::log(row_sum[r]);
      }
    }
  });
  return 0;
}

int gptlocal_core_attention_bwd(const float *q, const float *k, const float *v, const float *bias, const float *t1,
                                const float *t2, const int32_t *offsets, const float *out, const float *lse,
                                const float *dout, float *dq, float *dk, float *dv, int64_t B, int64_t N, int64_t S,
                                int64_t D, int64_t G, int64_t Bb, int64_t P1, int64_t P2,
                                const AttentionOptions &options) {
  Plan sh;
  if (!read_plan(B, N, S, G, Bb, t1, t2, offsets, P1, P2, options, &sh)) return Status::kBadCall;
  const int bq = sh.bq, bk = sh.bk;
  const int64_t group = sh.group, qblocks = sh.qblocks;
  const int64_t tasks = B * G;  // each task owns its key/value head's dK and dV (and its query heads' dQ)
  run_parallel(sh.threads, tasks, [&](std::atomic<int64_t> &next, int) {
    std::vector<float> probs(static_cast<size_t>(bq) * bk), grad(static_cast<size_t>(bq) * bk),
        keep(static_cast<size_t>(bq) * bk), used(static_cast<size_t>(bq) * bk), delta(bq);
    for (int64_t task = next.fetch_add(1); task < tasks; task = next.fetch_add(1)) {
      const int64_t b = task / G, g = task % G;
      const float *K = k + (task * S) * D, *V = v + (task * S) * D;
      float *dK = dk + (task * S) * D, *dV = dv + (task * S) * D;
      std::fill(dK, dK + S * D, 0.0f);
      std::fill(dV, dV + S * D, 0.0f);
      const float *bias_rows = bias + ((Bb == 1 ? 0 : b) * S) * S;
      for (int64_t n = g * group; n < (g + 1) * group; ++n) {
        const int64_t bn = b * N + n;
        float *dQ = dq + (bn * S) * D;
        std::fill(dQ, dQ + S * D, 0.0f);
        for (int64_t qb = 0; qb < qblocks; ++qb) {
          const int64_t i0 = qb * bq, i1 = std::min<int64_t>(S, i0 + bq), rows = i1 - i0;
          const float *Q = q + (bn * S + i0) * D, *dO = dout + (bn * S + i0) * D, *O = out + (bn * S + i0) * D;
          for (int64_t r = 0; r < rows; ++r) delta[r] = dot(dO + r * D, O + r * D, static_cast<int>(D));
          for (int64_t j0 = 0; j0 < i1; j0 += bk) {
            const int64_t cols = std::min<int64_t>(bk, i1 - j0);
            gemm('N', 'T', rows, cols, D, sh.scale, Q, D, K + j0 * D, D, 0.0f, probs.data(), cols);
            for (int64_t r = 0; r < rows; ++r) {
              const int64_t i = i0 + r;
              float *p = probs.data() + r * cols;
              const int valid = static_cast<int>(std::min<int64_t>(cols, i - j0 + 1));
              bias_mask_max(p, bias_rows + i * S + j0, static_cast<int>(cols), valid);
              exp_sum(p, cols, lse[bn * S + i]);  // P = exp(S - lse)
              if (sh.drop.mode != 0) {
                drop_row(sh.drop, (bn * S + i) * S + j0, static_cast<int>(cols), keep.data() + r * cols);
                mul_into(used.data() + r * cols, p, keep.data() + r * cols, static_cast<int>(cols));
              }
            }
            const float *p_used = sh.drop.mode != 0 ? used.data() : probs.data();
            gemm('T', 'N', cols, D, rows, 1.0f, p_used, cols, dO, D, 1.0f, dV + j0 * D, D);  // dV += P^T dO
            gemm('N', 'T', rows, cols, D, 1.0f, dO, D, V + j0 * D, D, 0.0f, grad.data(), cols);  // dP = dO V^T
            for (int64_t r = 0; r < rows; ++r) {
              float *dp = grad.data() + r * cols;
              if (sh.drop.mode != 0) mul_into(dp, dp, keep.data() + r * cols, static_cast<int>(cols));
              softmax_grad(dp, probs.data() + r * cols, static_cast<int>(cols), delta[r]);
            }
            gemm('N', 'N', rows, D, cols, sh.scale, grad.data(), cols, K + j0 * D, D, 1.0f, dQ + i0 * D, D);
            gemm('T', 'N', cols, D, rows, sh.scale, grad.data(), cols, Q, D, 1.0f, dK + j0 * D, D);
          }
        }
      }
    }
  });
  return 0;
}
