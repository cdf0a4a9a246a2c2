// Linear's GEMM for CPU, y = x W^T with W stored [out, in], forward and backward: the typed cores of the
// gptlocal_linear_* kernels (gpt_local, kernels/abi/table.py; kernels/cells/linear.py; model/layers.py Linear; the decode
// layer's GEMMs, cpu_decode_layer.cc).
//
// Built with the other sources into one library by mindformers_gptlocal/kernels/abi/build.py. Why: in a profiled
// Llama-style 124M forward (`python benchmarks/op_profile.py llama`) MindSpore 2.7.2's CPU MatMul is 85% of the op
// time, and oneDNN's sgemm (the MindSpore wheel's libdnnl.so.2, sequential when called like this) on the same shapes
// was faster per call. The work is split into `threads` contiguous column blocks, one thread each (common.h
// fork_join), each one dnnl_sgemm call writing its own block: no sum crosses threads, so results depend only on the
// thread count.
//
// The typed cores (kernels/abi/table.py has each entry point's tensors; LinearOptions: threads, precision):
// linear_fwd: x [T, K], w [N, K], b [N] or null -> y [T, N] = x w^T (+ b): each thread writes b into its column
//   block's rows, then its sgemm adds x w^T to them (beta 1), so the bias costs no node and no pass of its own
//   (Linear's bias inside); the entry points gptlocal_linear_fwd (with or without b) and gptlocal_linear_fwd_bias
// linear_bwd: x, w, dy [T, N] -> dx [T, K] = dy w, dw [N, K] = dy^T x
//
// GEMM epilogues (kernels/cells/linear.py CPULinearEpilogue; cpu_kernels.gemm_epilogue), the bias written as above:
// linear_gelu_fwd: x, w, b (LinearGeluOptions: threads, precision, form) -> y = gelu(h), h = x w^T + b [T, N] (the
//   GeLU of common.h applied to each column block right after its GEMM); linear_gelu_bwd: x, w, h, dy -> dx, dw, db
//   from dh = dy * gelu'(h) (and dh [T, N] itself: its scratch output)
// linear_residual_fwd: x, w, b, residual [T, N] -> y = residual + x w^T + b (the block's residual + b written, then
//   the GEMM with beta 1); its backward is linear_bwd's
//
// LinearOptions.precision 1 (compute_dtype: bfloat16 on CPU): every GEMM above, forward and both backward, takes its
// two float32 operands rounded to bfloat16 (common.h bf16_bits: to nearest even; converted once per call, in
// parallel, into bf16 buffers the column blocks share) and runs oneDNN's dnnl_gemm_bf16bf16f32 (float32
// accumulation and output; the bias, dx and dw stay float32). The weight is converted at every call (as PyTorch's
// autocast does): nothing is cached between calls. The emulation: the same rounded operands widened back to
// float32 (exact) and dnnl_sgemm, the same numbers up to the order of the sums. precision 1 runs oneDNN's GEMM only
// where oneDNN's ISA runs its bf16 kernels (common.h bf16_gemm_fast: avx512_core on; below, oneDNN answers through
// its reference GEMM, right but ~100x slower than the emulation), else the emulation, and a block whose oneDNN call
// fails (a non-success status) runs the emulation too. precision 2 forces the emulation (tests;
// gptlocal_linear_bf16_native says which one precision 1 gets on this CPU).
//
// linear_bf16w_fwd: x [T, K] float32, w [N, K] bfloat16, b [N] float32 or null -> y [T, N] float32, the forward of
// precision 1 or 2 above on a weight already held as bfloat16 (an inference build of a bf16 model:
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

// True where oneDNN's bf16 GEMM runs fast on this CPU: its ISA has what the GEMM's kernels need (common.h
// bf16_gemm_fast: a CPU without it gets a right answer ~100x slower, oneDNN's reference GEMM) and one 1 x 1 x 2
// product checked by value (a oneDNN that refuses or errs); once per process.
bool lin_bf16_native() {
  if (!bf16_gemm_fast(onednn_isa())) return false;  // under the ISA cap, read at each call (common.h)
  static const bool works = [] {
    const uint16_t a[2] = {bf16_bits(1.5f), bf16_bits(-2.0f)}, b[2] = {bf16_bits(2.0f), bf16_bits(0.25f)};
    float c = 0.0f;
    SequentialGemm one;
    return gptlocal_dnnl_gemm_bf16('N', 'T', 1, 1, 2, 1.0f, a, 2, b, 2, 0.0f, &c, 1) == dnnl_success && c == 2.5f;
  }();
  return works;
}

// What a GEMM call converts to bf16: its input x, its weight, the output's gradient dy.
enum Converted { kInput = 0, kWeight = 1, kOutputGrad = 2 };

// The n float32 values at `in` as bf16 bits, converted on up to `threads` threads into this thread's buffer for
// `what`, kept across calls (grown, never shrunk, never zeroed again): a new buffer at every call cost about as much
// as the conversion (zeroed, or page-faulted in: GPT-2's 77 MB head weight). Valid until this thread's next
// conversion of the same kind.
const uint16_t *lin_to_bf16(Converted what, int threads, const float *in, int64_t n) {
  thread_local std::vector<uint16_t> buffers[3];
  std::vector<uint16_t> &buffer = buffers[what];
  if (buffer.size() < static_cast<size_t>(n)) buffer.resize(static_cast<size_t>(n));
  uint16_t *out = buffer.data();
  const int64_t blocks = (n + 65535) / 65536;
  run_chunks(threads, blocks, [&](int, int64_t b0, int64_t b1) {
    const int64_t begin = b0 * 65536, end = std::min<int64_t>(n, b1 * 65536);
    if (begin < end) to_bf16(in + begin, end - begin, out + begin);
  });
  return out;
}


// y [T, N] = x w^T over column blocks, each block's GEMM accumulating onto what `init(n0, n1)` wrote there (beta
// 1: the bias rows, or residual + bias) and, when `init` is null, onto zeros (beta 0); then `epilogue(n0, n1)` on
// the block just written (the GeLU), while it is the last thing this thread touched. precision: LinearOptions'; w_bf16:
// the weight already as bf16 bits (gptlocal_linear_bf16w_fwd; precision 1, 2), else null (w converted per call).
template <class Init, class Epilogue>
void lin_forward(int requested, int precision, int64_t T, int64_t N, int64_t K, const float *x, const float *w,
                 const uint16_t *w_bf16, float *y, const Init *init, const Epilogue &epilogue) {
  if (T == 0 || N == 0) return;
  const int threads = gemm_threads(requested, T * N * std::max<int64_t>(K, 1));
  const uint16_t *xb = nullptr, *wb = w_bf16;  // x as bf16; a float32 weight as bf16, at every call (precision 1, 2)
  if (precision != 0 && K > 0) {
    xb = lin_to_bf16(kInput, threads, x, T * K);
    if (wb == nullptr) wb = lin_to_bf16(kWeight, threads, w, N * K);
  }
  const bool native = precision == 1 && lin_bf16_native();
  column_blocks(threads, N, [&](int64_t n0, int64_t n1) {
    if (init != nullptr) {
      (*init)(n0, n1);
    } else if (K == 0) {
      for (int64_t t = 0; t < T; ++t) std::fill(y + t * N + n0, y + t * N + n1, 0.0f);
    }
    if (K > 0) {
      const float beta = init != nullptr ? 1.0f : 0.0f;
      if (precision == 0) {
        dnnl_sgemm('N', 'T', T, n1 - n0, K, 1.0f, x, K, w + n0 * K, K, beta, y + n0, N);
      } else {
        lin_gemm_bf16(native, 'N', 'T', T, n1 - n0, K, xb, K, wb + n0 * K, K, beta, y + n0, N);
      }
    }
    epilogue(n0, n1);
  });
}

// dx [T, K] = dy w, dw [N, K] = dy^T x, each over its own column blocks; precision 1, 2: dy, w and x rounded to
// bf16 first (LinearOptions).
void lin_backward(int requested, int precision, int64_t T, int64_t N, int64_t K, const float *x, const float *w,
                  const float *dy, float *dx, float *dw) {
  if (T == 0 || N == 0) {  // nothing flows back
    std::fill(dx, dx + T * K, 0.0f);
    std::fill(dw, dw + N * K, 0.0f);
    return;
  }
  if (K == 0) return;
  const int threads = gemm_threads(requested, T * N * K);
  if (precision == 0) {
    column_blocks(threads, K, [&](int64_t k0, int64_t k1) {  // dx[:, k0:k1] = dy w[:, k0:k1]
      dnnl_sgemm('N', 'N', T, k1 - k0, N, 1.0f, dy, N, w + k0, K, 0.0f, dx + k0, K);
    });
    column_blocks(threads, N, [&](int64_t n0, int64_t n1) {  // dw[n0:n1] = dy[:, n0:n1]^T x
      dnnl_sgemm('T', 'N', n1 - n0, K, T, 1.0f, dy + n0, N, x, K, 0.0f, dw + n0 * K, K);
    });
    return;
  }
  const uint16_t *xb = lin_to_bf16(kInput, threads, x, T * K), *wb = lin_to_bf16(kWeight, threads, w, N * K),
                 *dyb = lin_to_bf16(kOutputGrad, threads, dy, T * N);
  const bool native = precision == 1 && lin_bf16_native();
  column_blocks(threads, K, [&](int64_t k0, int64_t k1) {
    lin_gemm_bf16(native, 'N', 'N', T, k1 - k0, N, dyb, N, wb + k0, K, 0.0f, dx + k0, K);
  });
  column_blocks(threads, N, [&](int64_t n0, int64_t n1) {
    lin_gemm_bf16(native, 'T', 'N', n1 - n0, K, T, dyb + n0, N, xb, K, 0.0f, dw + n0 * K, K);
  });
}

// out[t, n0:n1] = b[n0:n1] for every row t: the bias the forward GEMMs then add onto (beta 1).
void bias_rows(const float *b, float *out, int64_t T, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t t = 0; t < T; ++t) std::copy(b + n0, b + n1, out + t * N + n0);
}

// y[t, n0:n1] = gelu(h[t, n0:n1]) for every row t (the forms of common.h).
VEC_FN(void, gelu_block, (const float *h, float *y, int64_t T, int64_t N, int64_t n0, int64_t n1, bool quick),
       (h, y, T, N, n0, n1, quick)) {
  for (int64_t t = 0; t < T; ++t) {
    const float *hr = h + t * N;
    float *yr = y + t * N;
    if (quick) {
#pragma omp simd
      for (int64_t n = n0; n < n1; ++n) yr[n] = gelu_quick(hr[n]);
    } else {
#pragma omp simd
      for (int64_t n = n0; n < n1; ++n) yr[n] = gelu_tanh(hr[n]);
    }
  }
}

// dh[t, n0:n1] = dy * gelu'(h) for every row t, and db[n0:n1] their sums over rows, in row order.
VEC_FN(void, gelu_grad_block, (const float *h, const float *dy, float *dh, float *db, int64_t T, int64_t N, int64_t n0,
                               int64_t n1, bool quick),
       (h, dy, dh, db, T, N, n0, n1, quick)) {
  std::fill(db + n0, db + n1, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    const float *hr = h + t * N, *dyr = dy + t * N;
    float *dhr = dh + t * N;
    if (quick) {
#pragma omp simd
      for (int64_t n = n0; n < n1; ++n) {
        dhr[n] = gelu_quick_grad(hr[n], dyr[n]);
        db[n] += dhr[n];
      }
    } else {
#pragma omp simd
      for (int64_t n = n0; n < n1; ++n) {
        dhr[n] = gelu_tanh_grad(hr[n], dyr[n]);
        db[n] += dhr[n];
      }
    }
  }
}

const auto kNoEpilogue = [](int64_t, int64_t) {};

// y [T, N] = x w^T (+ b): the bias rows written first (b null: none), then the GEMM onto them; w float32 (converted
// to bf16 at every call under precision 1, 2) or w_bf16 the weight already as bf16 bits.
void lin_forward_bias(const float *x, const float *w, const uint16_t *w_bf16, const float *b, float *y, int64_t T,
                      int64_t K, int64_t N, const LinearOptions &options) {
  const auto bias = [&](int64_t n0, int64_t n1) { bias_rows(b, y, T, N, n0, n1); };
  lin_forward(options.threads, options.precision, T, N, K, x, w, w_bf16, y, b != nullptr ? &bias : nullptr,
              kNoEpilogue);
}

}  // namespace

int gptlocal_core_linear_fwd(const float *x, const float *w, const float *b, float *y, int64_t T, int64_t K, int64_t N,
                             const LinearOptions &options) {
  lin_forward_bias(x, w, nullptr, b, y, T, K, N, options);
  return 0;
}

// The forward on a weight already held as bfloat16: precision 1 or 2 only (0 fails the call).
int gptlocal_core_linear_bf16w_fwd(const float *x, const uint16_t *w, const float *b, float *y, int64_t T, int64_t K,
                                   int64_t N, const LinearOptions &options) {
  if (options.precision != 1 && options.precision != 2) return Status::kBadCall;
  lin_forward_bias(x, nullptr, w, b, y, T, K, N, options);
  return 0;
}

int gptlocal_core_linear_bwd(const float *x, const float *w, const float *dy, float *dx, float *dw, int64_t T,
                             int64_t K, int64_t N, const LinearOptions &options) {
  lin_backward(options.threads, options.precision, T, N, K, x, w, dy, dx, dw);
  return 0;
}

// The bias + GeLU epilogue: h = x w^T + b (the bias rows, then the GEMM with beta 1, as gptlocal_linear_fwd_bias),
// then y = gelu(h) on each column block as soon as its GEMM has written it. h is an output: the backward's
// gelu'(h) reads it, which costs the [T, N] float32 the unfused path keeps anyway (fc1's output, the bias + GeLU
// kernel's input); recomputing it would cost the forward GEMM again.
int gptlocal_core_linear_gelu_fwd(const float *x, const float *w, const float *b, float *y, float *h, int64_t T,
                                  int64_t K, int64_t N, const LinearGeluOptions &options) {
  const bool quick = options.form != MlpForm::kTanh;
  const auto bias = [&](int64_t n0, int64_t n1) { bias_rows(b, h, T, N, n0, n1); };
  lin_forward(options.threads, options.precision, T, N, K, x, w, nullptr, h, &bias,
              [&](int64_t n0, int64_t n1) { gelu_block(h, y, T, N, n0, n1, quick); });
  return 0;
}

// Its backward: dh = dy * gelu'(h) and db = dh's column sums on column blocks, then dx = dh w, dw = dh^T x as
// gptlocal_linear_bwd (bf16 precisions: dh rounded to bf16 for the GEMMs, db from the float32 dh). scratch: dh, the
// [T, N] MindSpore allocates (its pool: no page faults per call).
int gptlocal_core_linear_gelu_bwd(const float *x, const float *w, const float *h, const float *dy, float *dx,
                                  float *dw, float *db, float *scratch, int64_t T, int64_t K, int64_t N,
                                  const LinearGeluOptions &options) {
  const bool quick = options.form != MlpForm::kTanh;
  column_blocks(gemm_threads(options.threads, T * N * std::max<int64_t>(K, 1)), N, [&](int64_t n0, int64_t n1) {
    gelu_grad_block(h, dy, scratch, db, T, N, n0, n1, quick);
  });
  lin_backward(options.threads, options.precision, T, N, K, x, w, scratch, dx, dw);
  return 0;
}

// The residual epilogue: y = residual + x w^T + b (each column block of residual + b written first, then the GEMM
// with beta 1). Its backward is gptlocal_linear_bwd's dx and dw; d residual = dy and db = dy's column sums are the
// Cell's (kernels/cells/linear.py).
int gptlocal_core_linear_residual_fwd(const float *x, const float *w, const float *b, const float *residual, float *y,
                                      int64_t T, int64_t K, int64_t N, const LinearOptions &options) {
  const auto residual_rows = [&](int64_t n0, int64_t n1) {
    for (int64_t t = 0; t < T; ++t) {
      const float *r = residual + t * N;
      float *yr = y + t * N;
      for (int64_t n = n0; n < n1; ++n) yr[n] = r[n] + b[n];
    }
  };
  lin_forward(options.threads, options.precision, T, N, K, x, w, nullptr, y, &residual_rows, kNoEpilogue);
  return 0;
}

int gptlocal_linear_bf16_native() { return lin_bf16_native() ? 1 : 0; }

int gptlocal_cpu_isa() { return static_cast<int>(onednn_isa()); }

// The library's one ISA decision (common.h IsaTier): from now on every path runs at most `tier`'s (kIsaAuto: the
// CPU's best). oneDNN is capped as well through dnnl_set_max_cpu_isa, which oneDNN takes only before its first use in
// the process (and once; where it ran before, its own GEMMs keep their ISA, the choices among them follow the cap all
// the same: gptlocal_isa's part 4 tells which). Status::kOk, or Status::kBadCall for a tier out of range (nothing
// changed).
int gptlocal_set_isa(int tier) {
  if (tier < kIsaScalar || tier > kIsaAuto) return Status::kBadCall;
  gptlocal::isa_cap().store(tier, std::memory_order_relaxed);
  if (tier != kIsaAuto) dnnl_set_max_cpu_isa(static_cast<dnnl_cpu_isa_t>(kTierOneDNN[tier]));
  return Status::kOk;
}

// The decision's parts: 0 the cap (kIsaAuto: none), 1 the tier our loops and intrinsics run (vec_tier), 2 oneDNN's
// tier as the GEMM choices read it (capped), 3 the CPU's tier for our code (its flags: scalar, avx2 or avx512), 4
// oneDNN's own tier (dnnl_get_effective_cpu_isa: the CPU's, or where oneDNN took a cap, that); -1 another part.
int gptlocal_isa(int part) {
  switch (part) {
    case 0: return gptlocal::isa_cap().load(std::memory_order_relaxed);
    case 1: return gptlocal::vec_tier();
    case 2: return onednn_tier(onednn_isa());
    case 3: return gptlocal::flags_tier();
    case 4: return onednn_tier(onednn_machine_isa());
    default: return -1;
  }
}

int gptlocal_bf16_gemm_fast(int isa) { return bf16_gemm_fast(static_cast<unsigned>(isa)) ? 1 : 0; }

void gptlocal_to_bf16(const float *in, int64_t n, uint16_t *out) { to_bf16(in, n, out); }
