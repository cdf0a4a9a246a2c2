// An int8 model's Linear for CPU, y = x W^T (+ b) with W stored int8 [out, in] and one float32 scale per output
// channel, inference only, and its exact int8 x int8 -> int32 product: the typed cores of gptlocal_int8_linear_fwd
// and gptlocal_int8_matmul_fwd (gpt_local, kernels/abi/table.py; kernels/cells/linear_int8.py; model/quant_cells.py; the int8
// decode layer's GEMMs, cpu_decode_layer.cc).
//
// The scheme (CTranslate2's int8): the weight is quantized once (`gptlocal quantize`: symmetric per output channel,
// scale[n] = max_k |W[n, k]| / 127, W_q = round(W / scale), in [-127, 127]); each call quantizes x the same way per
// row (x_scale[t] = max_k |x[t, k]| / 127, x_q = round(x * (127 / max))), multiplies x_q W_q^T exactly in int32 and
// writes y[t, n] = acc[t, n] * (x_scale[t] * scale[n]) (+ b[n]). A row of zeros has scale 0 and gives b. The
// columns are split into `threads` contiguous blocks of whole 16-column groups, one thread each (common.h
// fork_join), each block's product and scaling written by its thread: every path gives the exact int32 product,
// so the results depend on nothing but the inputs (not the path, not the thread count).
//
// The exact product, by method (Int8Options.method; 0 chooses by this CPU, int8_method):
// 2 oneDNN's dnnl_gemm_s8s8s32, where oneDNN has VNNI (common.h s8_gemm_exact, checked once by value at the
//   extremes): fast and exact there. Without VNNI (AVX2, AVX-512 before VNNI) it sums product pairs in int16 with
//   saturation and is wrong on full-range operands, so it is never chosen there.
// 1 the int8 GEMM of the native decoder (cpu_decoder.h int8_gemm / int8_sums, the one the decoder's Linears run),
//   everywhere else: AVX2's maddubs/madd tiles of 4 rows by 16-column blocks where the ISA decision allows it, else
//   the plain loops (the plain loops too for an exact product whose operands hold -128, outside the scheme's range).
//
// x [T, K] float32, w [N, K] int8, scale [N] float32, b [N] float32 or null (ThreadOptions) -> y [T, N] float32
// int8_matmul: xq [T, K] int8, w [N, K] int8 (Int8Options) -> acc [T, N] int32 = xq w^T, exact in int32 (method 1
//   for any int8 operands and K below 2^31 / 2^14; oneDNN's on its range)
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"
#include "cpu_decoder.h"

namespace {

enum Int8Method { kChoose = 0, kDotLoop = 1, kOneDNN = 2 };

// True where oneDNN's s8 x s8 GEMM is exact here: its ISA has VNNI (common.h s8_gemm_exact) and x = +-127 times
// w = 127 over K = 64 gives +-64 * 127 * 127 (the saturating kernels give 8160; that probe once per process).
bool onednn_s8_exact() {
  if (!s8_gemm_exact(onednn_isa())) return false;  // under the ISA cap, read at each call (common.h)
  static const bool exact = [] {
    constexpr int64_t depth = 64;
    std::vector<int8_t> a(2 * depth, 127), b(depth, 127);
    std::fill(a.begin() + depth, a.end(), static_cast<int8_t>(-127));
    int32_t c[2] = {0, 0};
    const int32_t no_offset = 0;
    SequentialGemm one;
    const dnnl_status_t status = dnnl_gemm_s8s8s32('N', 'T', 'F', 2, 1, depth, 1.0f, a.data(), depth, 0, b.data(),
                                                   depth, 0, 0.0f, c, 1, &no_offset);
    return status == dnnl_success && c[0] == depth * 127 * 127 && c[1] == -depth * 127 * 127;
  }();
  return exact;
}

// The method a call runs: `asked` (Int8Options.method), or where 0, oneDNN's where it is exact here, else the dot
// loop.
int int8_method(int asked) {
  if (asked != kChoose) return asked;
  return onednn_s8_exact() ? kOneDNN : kDotLoop;
}

// xq [T, K] int8 times w [N, K]^T into acc [T, N] int32 by oneDNN's s8s8s32 on column blocks; then
// `epilogue(n0, n1)` on each block, by the thread that wrote it.
template <class Epilogue>
void onednn_product(int threads, const int8_t *xq, int64_t T, int64_t K, const int8_t *w, int64_t N, int32_t *acc,
                    const Epilogue &epilogue) {
  const int32_t no_offset = 0;
  column_blocks(gemm_threads(threads, T * N * K), N, [&](int64_t n0, int64_t n1) {
    dnnl_gemm_s8s8s32('N', 'T', 'F', T, n1 - n0, K, 1.0f, xq, K, 0, w + n0 * K, K, 0, 0.0f, acc + n0, N,
                      &no_offset);
    epilogue(n0, n1);
  });
}

// |q| of n int8 values (the AVX2 tier's operand; -128 stays -128, read as 128 unsigned).
void magnitudes(const int8_t *q, int64_t n, int8_t *aq) {
  for (int64_t i = 0; i < n; ++i) aq[i] = static_cast<int8_t>(q[i] < 0 ? -q[i] : q[i]);
}

}  // namespace

int gptlocal_core_int8_linear_fwd(const float *x, const int8_t *w, const float *w_scale, const float *b, float *y,
                                  int64_t T, int64_t K, int64_t N, const ThreadOptions &options) {
  if (T == 0 || N == 0) return 0;
  if (K == 0) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t n = 0; n < N; ++n) y[t * N + n] = b != nullptr ? b[n] : 0.0f;
    }
    return 0;
  }
  std::vector<int8_t> xq(static_cast<size_t>(T * K)), aq(static_cast<size_t>(T * K));
  std::vector<float> x_scale(static_cast<size_t>(T));
  run_chunks(threads_for(options.threads, T * K), T, [&](int, int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      quantize_row(x + t * K, K, xq.data() + t * K, x_scale.data() + t);
      magnitudes(xq.data() + t * K, K, aq.data() + t * K);
    }
  });
  if (int8_method(kChoose) == kDotLoop) {
    gptlocal::decoder::int8_gemm(gemm_threads(options.threads, T * N * K), xq.data(), aq.data(), x_scale.data(), w,
                                 w_scale, b, y, T, K, N);
    return 0;
  }
  std::vector<int32_t> acc(static_cast<size_t>(T * N));
  onednn_product(options.threads, xq.data(), T, K, w, N, acc.data(), [&](int64_t n0, int64_t n1) {
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t n = n0; n < n1; ++n) y[t * N + n] = gptlocal::decoder::int8_output(acc[t * N + n], x_scale[t],
                                                                                       w_scale[n], b, n);
    }
  });
  return 0;
}

// The exact product alone (tests give each method). method 2 where oneDNN is not exact here runs it all the same
// (tests show its saturation); another value fails.
int gptlocal_core_int8_matmul(const int8_t *x, const int8_t *w, int32_t *acc, int64_t T, int64_t K, int64_t N,
                              const Int8Options &options) {
  if (options.method < kChoose || options.method > kOneDNN) return Status::kBadCall;
  if (T == 0 || N == 0) return 0;
  if (K == 0) {
    std::fill(acc, acc + T * N, 0);
    return 0;
  }
  if (int8_method(options.method) == kOneDNN) {
    onednn_product(options.threads, x, T, K, w, N, acc, [](int64_t, int64_t) {});
    return 0;
  }
  const auto full = [](const int8_t *v, int64_t n) { return std::find(v, v + n, int8_t(-128)) != v + n; };
  std::vector<int8_t> aq(static_cast<size_t>(T * K));
  magnitudes(x, T * K, aq.data());
  gptlocal::decoder::int8_sums(gemm_threads(options.threads, T * N * K), x, aq.data(), w, acc, T, K, N,
                               !full(x, T * K) && !full(w, N * K));
  return 0;
}

int gptlocal_int8_gemm_exact(int isa) { return s8_gemm_exact(static_cast<unsigned>(isa)) ? 1 : 0; }

int gptlocal_int8_method(int asked) { return int8_method(asked); }
