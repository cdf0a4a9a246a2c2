// Linear's GEMM for CPU, y = x W^T with W stored [out, in], forward and backward, as MindSpore AOT kernels
// (gpt_local, kernels/linear.py; model/layers.py Linear).
//
// Built with the other sources into one library by mindformers_gptlocal/kernels/build.py. Why: in a profiled
// Llama-style 124M forward (docs/performance.md) MindSpore 2.7.2's CPU MatMul is 85% of the op time, and oneDNN's
// sgemm (the MindSpore wheel's libdnnl.so.2, sequential when called like this) on the same shapes was faster per
// call. The work is split into `threads` contiguous column blocks, one std::thread each (common.h's reasons), each
// one dnnl_sgemm call writing its own block: no sum crosses threads, so results depend only on the thread count.
//
// gptlocal_linear_fwd: x [T, K], w [N, K], args (LinearArgs, common.h: threads) -> y [T, N] = x w^T; or, with five
//   parameters, x, w, b [N], args -> y = x w^T + b: each thread writes b into its column block's rows, then its
//   sgemm adds x w^T to them (beta 1), so the bias costs no node and no pass of its own (Linear's bias inside)
// gptlocal_linear_bwd: x, w, dy [T, N], args -> dx [T, K] = dy w, dw [N, K] = dy^T x
//
// LinearArgs.precision 1 (compute_dtype: bfloat16 on CPU): every GEMM above, forward and both backward, takes its
// two float32 operands rounded to bfloat16 (common.h bf16_bits: to nearest even; converted once per call, in
// parallel, into bf16 buffers the column blocks share) and runs oneDNN's dnnl_gemm_bf16bf16f32 (float32
// accumulation and output; the bias, dx and dw stay float32). The weight is converted at every call (as PyTorch's
// autocast does): nothing is cached between calls. Where oneDNN refuses that GEMM (a non-success status: a CPU
// without the ISA it needs) the block runs the emulation instead: the same rounded operands widened back to
// float32 (exact) and dnnl_sgemm, the same numbers up to the order of the sums. precision 2 forces the emulation
// (tests; gptlocal_linear_bf16_native says which one precision 1 gets on this CPU).
//
// gptlocal_linear_bf16w_fwd: x [T, K] float32, w [N, K] bfloat16, [b [N] float32,] args -> y [T, N] float32, the
// forward of precision 1 or 2 above on a weight already held as bfloat16 (an inference build of a bf16 model:
// model/layers.py Linear, kernels/provider.py bf16_weights): x is rounded per call as above, the weight is used as
// it is (no conversion per call), so the numbers are those of gptlocal_linear_fwd on the float32 weight the bf16
// one widens to. Inference only: no backward. precision 0 is refused (the call fails).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

#include "common.h"

namespace {

// oneDNN's bf16 GEMM (row-major, like dnnl_sgemm): exported by every oneDNN 3.x library but declared in no
// header of the 3.2 package, so declared here, under our own name bound to its symbol.
extern "C" dnnl_status_t gptlocal_dnnl_gemm_bf16(char transa, char transb, dim_t M, dim_t N, dim_t K, float alpha,
                                                 const uint16_t *A, dim_t lda, const uint16_t *B, dim_t ldb,
                                                 float beta, float *C, dim_t ldc) __asm__("dnnl_gemm_bf16bf16f32");

// rows x cols of bf16 bits with leading dimension ld -> a dense float32 copy (exact).
std::vector<float> lin_widen(const uint16_t *in, int64_t rows, int64_t cols, int64_t ld) {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = bf16_value(in[r * ld + c]);
  }
  return out;
}

// C = op(A) op(B) + beta C on bfloat16 operands, float32 accumulation and C: oneDNN's bf16 GEMM where `native` and
// it succeeds, else the emulation (the operands widened to float32, dnnl_sgemm).
void lin_gemm_bf16(bool native, char ta, char tb, int64_t M, int64_t N, int64_t K, const uint16_t *A, int64_t lda,
                   const uint16_t *B, int64_t ldb, float beta, float *C, int64_t ldc) {
  if (native && gptlocal_dnnl_gemm_bf16(ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc) == dnnl_success) return;
  const std::vector<float> a = ta == 'N' ? lin_widen(A, M, K, lda) : lin_widen(A, K, M, lda);
  const std::vector<float> b = tb == 'N' ? lin_widen(B, K, N, ldb) : lin_widen(B, N, K, ldb);
  dnnl_sgemm(ta, tb, M, N, K, 1.0f, a.data(), ta == 'N' ? K : M, b.data(), tb == 'N' ? N : K, beta, C, ldc);
}

// True where oneDNN's bf16 GEMM runs on this CPU: one 1 x 1 x 2 product, checked by value, once per process.
bool lin_bf16_native() {
  static const bool native = [] {
    const uint16_t a[2] = {bf16_bits(1.5f), bf16_bits(-2.0f)}, b[2] = {bf16_bits(2.0f), bf16_bits(0.25f)};
    float c = 0.0f;
    SequentialGemm one;
    return gptlocal_dnnl_gemm_bf16('N', 'T', 1, 1, 2, 1.0f, a, 2, b, 2, 0.0f, &c, 1) == dnnl_success && c == 2.5f;
  }();
  return native;
}

// The n float32 values at `in` as bf16 bits, converted on up to `threads` threads.
std::vector<uint16_t> lin_to_bf16(int threads, const float *in, int64_t n) {
  std::vector<uint16_t> out(static_cast<size_t>(n));
  const int64_t blocks = (n + 65535) / 65536;
  run_chunks(threads, blocks, [&](int, int64_t b0, int64_t b1) {
    const int64_t begin = b0 * 65536, end = std::min<int64_t>(n, b1 * 65536);
    if (begin < end) to_bf16(in + begin, end - begin, out.data() + begin);
  });
  return out;
}

int lin_threads(float requested, int64_t work) {  // a GEMM below ~256K multiply-adds: one thread
  const int threads = std::max(1, static_cast<int>(requested));
  return work < (int64_t(1) << 18) ? 1 : threads;
}

// The forward of gptlocal_linear_fwd (`bf16_weight` false: w float32, converted to bf16 at every call under
// precision 1, 2) and of gptlocal_linear_bf16w_fwd (true: w already bf16 bits, precision 1 or 2 only):
// y [T, N] = x w^T (+ b), x rounded to bf16 here under precision 1, 2, the columns in `threads` blocks as above.
int lin_forward(bool bf16_weight, int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes) {
  const bool has_bias = nparam == 5;
  if (nparam != 4 && !has_bias) return 1;
  for (int i = 0; i < nparam; ++i) {  // x, w, [b,] args, y: float32 but a bf16 weight
    if (std::strcmp(dtypes[i], i == 1 && bf16_weight ? "bfloat16" : "float32") != 0) return 1;
  }
  if (ndims[0] != 2 || ndims[1] != 2) return 1;
  const int64_t T = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  if (shapes[1][1] != K || (has_bias && (ndims[2] != 1 || shapes[2][0] != N))) return 2;
  const float *x = static_cast<const float *>(params[0]);
  const float *w = bf16_weight ? nullptr : static_cast<const float *>(params[1]);
  const float *b = has_bias ? static_cast<const float *>(params[2]) : nullptr;
  const LinearArgs *args = args_at<LinearArgs>(has_bias ? 3 : 2, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  const int precision = static_cast<int>(args->precision);
  if (bf16_weight && precision != 1 && precision != 2) return 1;
  float *y = static_cast<float *>(params[has_bias ? 4 : 3]);
  if (T == 0 || N == 0) return 0;
  const int threads = lin_threads(args->threads, T * N * std::max<int64_t>(K, 1));
  std::vector<uint16_t> xb, converted;  // x as bf16; a float32 weight as bf16, at every call (precision 1, 2)
  const uint16_t *wb = bf16_weight ? static_cast<const uint16_t *>(params[1]) : nullptr;
  if (precision != 0 && K > 0) {
    xb = lin_to_bf16(threads, x, T * K);
    if (!bf16_weight) {
      converted = lin_to_bf16(threads, w, N * K);
      wb = converted.data();
    }
  }
  const bool native = precision == 1 && lin_bf16_native();
  column_blocks(threads, N, [&](int64_t n0, int64_t n1) {
    if (b != nullptr) {
      for (int64_t t = 0; t < T; ++t) std::copy(b + n0, b + n1, y + t * N + n0);
    } else if (K == 0) {
      for (int64_t t = 0; t < T; ++t) std::fill(y + t * N + n0, y + t * N + n1, 0.0f);
    }
    if (K == 0) return;
    const float beta = b != nullptr ? 1.0f : 0.0f;
    if (precision == 0) {
      dnnl_sgemm('N', 'T', T, n1 - n0, K, 1.0f, x, K, w + n0 * K, K, beta, y + n0, N);
    } else {
      lin_gemm_bf16(native, 'N', 'T', T, n1 - n0, K, xb.data(), K, wb + n0 * K, K, beta, y + n0, N);
    }
  });
  return 0;
}

}  // namespace

extern "C" int gptlocal_linear_fwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return lin_forward(false, nparam, params, ndims, shapes, dtypes);
}

extern "C" int gptlocal_linear_bf16w_fwd(int nparam, void **params, int *ndims, int64_t **shapes,
                                         const char **dtypes, void *stream, void *extra) {
  (void)stream;
  (void)extra;
  return lin_forward(true, nparam, params, ndims, shapes, dtypes);
}

extern "C" int gptlocal_linear_bwd(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                   void *stream, void *extra) {
  (void)stream;
  (void)extra;
  if (nparam != 6 || !all_float32(nparam, dtypes) || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2) return 1;
  const int64_t T = shapes[0][0], K = shapes[0][1], N = shapes[1][0];
  const float *x = static_cast<const float *>(params[0]);
  const float *w = static_cast<const float *>(params[1]);
  const float *dy = static_cast<const float *>(params[2]);
  const LinearArgs *args = args_at<LinearArgs>(3, params, ndims, shapes, dtypes);
  if (args == nullptr) return 1;
  float *dx = static_cast<float *>(params[4]);
  float *dw = static_cast<float *>(params[5]);
  if (T == 0 || N == 0) {  // nothing flows back
    std::fill(dx, dx + T * K, 0.0f);
    std::fill(dw, dw + N * K, 0.0f);
    return 0;
  }
  if (K == 0) return 0;
  const int threads = lin_threads(args->threads, T * N * K);
  const int precision = static_cast<int>(args->precision);
  if (precision == 0) {
    column_blocks(threads, K, [&](int64_t k0, int64_t k1) {  // dx[:, k0:k1] = dy w[:, k0:k1]
      dnnl_sgemm('N', 'N', T, k1 - k0, N, 1.0f, dy, N, w + k0, K, 0.0f, dx + k0, K);
    });
    column_blocks(threads, N, [&](int64_t n0, int64_t n1) {  // dw[n0:n1] = dy[:, n0:n1]^T x
      dnnl_sgemm('T', 'N', n1 - n0, K, T, 1.0f, dy + n0, N, x, K, 0.0f, dw + n0 * K, K);
    });
    return 0;
  }
  const std::vector<uint16_t> xb = lin_to_bf16(threads, x, T * K), wb = lin_to_bf16(threads, w, N * K),
                              dyb = lin_to_bf16(threads, dy, T * N);
  const bool native = precision == 1 && lin_bf16_native();
  column_blocks(threads, K, [&](int64_t k0, int64_t k1) {
    lin_gemm_bf16(native, 'N', 'N', T, k1 - k0, N, dyb.data(), N, wb.data() + k0, K, 0.0f, dx + k0, K);
  });
  column_blocks(threads, N, [&](int64_t n0, int64_t n1) {
    lin_gemm_bf16(native, 'T', 'N', n1 - n0, K, T, dyb.data() + n0, N, xb.data(), K, 0.0f, dw + n0 * K, K);
  });
  return 0;
}

// 1 where LinearArgs.precision 1 runs oneDNN's bf16 GEMM on this CPU, 0 where it runs the emulation (kernels/linear.py
// says so once per process).
extern "C" int gptlocal_linear_bf16_native() { return lin_bf16_native() ? 1 : 0; }

// The forward with the bias under a name of its own: MindSpore keys an AOT Custom's backward by its function, so two
// Customs of one symbol (kernels/linear.py: without and with the bias) would share one bprop in a compiled training
// graph (a TypeError on the argument count).
extern "C" int gptlocal_linear_fwd_bias(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                        void *stream, void *extra) {
  return nparam == 5 ? gptlocal_linear_fwd(nparam, params, ndims, shapes, dtypes, stream, extra) : 1;
}
