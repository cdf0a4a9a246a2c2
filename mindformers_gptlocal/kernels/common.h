// What gpt_local's CPU kernels share (cpu_attention.cc, cpu_norm_gelu.cc, lora_dropout.cc...): oneDNN's sgemm, the
// multi-versioning attribute, the vectorisable exp of x <= 0, the std::thread task runner, each op's argument struct
// (args_at) and the counter dropout's mask (drop_row). Included by each source of the one library build.py compiles (and hashed into its
// cache key with them).
#pragma once

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <omp.h>
#include <vector>

#include "oneapi/dnnl/dnnl.h"  // dnnl_sgemm: the onednn-devel-cpu-gomp package's headers (build.py)

typedef dnnl_dim_t dim_t;

namespace gptlocal {

// The library's worker threads, started on first use and kept: a kernel's parallel part wakes them instead of
// starting std::threads at each call (measured: a decode step's layer at GPT-2-tiny width took 171 us with two
// threads started per GEMM against 59 us on one thread). Idle workers sleep on a condition variable, never spin
// (an OpenMP team's idle threads spin after a region and take CPU from MindSpore's own thread pool). One job at a
// time: a caller that finds the pool busy (another MindSpore thread inside a kernel, or a kernel's worker calling
// one) gets false and starts its own threads. After fork() the child makes a new pool (its parent's threads do not
// exist there; the old pool is left as it was, never destroyed, as the pool is at exit).
class WorkerPool {
 public:
  // job(t) for t = 1 .. count - 1 on the pool's threads and job(0) on the caller, then returns; false (nothing run)
  // when the pool is busy.
  bool run(int count, const std::function<void(int)> &job) {
    bool idle = false;
    if (!busy_.compare_exchange_strong(idle, true, std::memory_order_acquire)) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (static_cast<int>(threads_.size()) < count - 1) {
        const int index = static_cast<int>(threads_.size()) + 1;
        const uint64_t seen = generation_.load(std::memory_order_relaxed);
        threads_.emplace_back([this, index, seen] { work(index, seen); });
      }
      job_ = &job;
      count_ = count;
      pending_.store(count - 1, std::memory_order_relaxed);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    job(0);
    for (auto until = spin_end(); pending_.load(std::memory_order_acquire) != 0; std::this_thread::yield()) {
      if (std::chrono::steady_clock::now() > until) {
        std::unique_lock<std::mutex> lock(mutex_);
        done_.wait(lock, [this] { return pending_.load(std::memory_order_acquire) == 0; });
        break;
      }
    }
    busy_.store(false, std::memory_order_release);
    return true;
  }

  // The process's pool (a new one in a forked child).
  static WorkerPool &get() {
    static std::atomic<WorkerPool *> pool(nullptr);
    static std::atomic<pid_t> owner(0);
    static std::mutex making;
    const pid_t pid = getpid();
    WorkerPool *current = pool.load(std::memory_order_acquire);
    if (current == nullptr || owner.load(std::memory_order_acquire) != pid) {
      std::lock_guard<std::mutex> lock(making);
      current = pool.load(std::memory_order_acquire);
      if (current == nullptr || owner.load(std::memory_order_acquire) != pid) {
        current = new WorkerPool();  // never deleted: its threads sleep until the process ends
        pool.store(current, std::memory_order_release);
        owner.store(pid, std::memory_order_release);
      }
    }
    return *current;
  }

 private:
  // A worker polls for the next job this long after its last one before it sleeps, and the caller for the workers'
  // end, yielding the core at each poll (a runnable thread, MindSpore's own, goes first): a kernel's parallel parts
  // follow each other within microseconds (a decode step's layer has five), where a sleep and a wake cost tens of
  // microseconds each.
  static std::chrono::steady_clock::time_point spin_end() {
    return std::chrono::steady_clock::now() + std::chrono::microseconds(50);
  }

  void work(int index, uint64_t seen) {
    omp_set_num_threads(1);  // oneDNN sequential in this thread (SequentialGemm's reason)
    for (;;) {
      for (auto until = spin_end(); generation_.load(std::memory_order_acquire) == seen; std::this_thread::yield()) {
        if (std::chrono::steady_clock::now() > until) {
          std::unique_lock<std::mutex> lock(mutex_);
          wake_.wait(lock, [this, seen] { return generation_.load(std::memory_order_acquire) != seen; });
          break;
        }
      }
      const std::function<void(int)> *job;
      int count;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_acquire);
        job = job_;
        count = count_;
      }
      if (index >= count) continue;
      (*job)(index);
      if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        std::lock_guard<std::mutex> lock(mutex_);  // the caller is polling, or waits on done_ under this mutex
        done_.notify_one();
      }
    }
  }

  std::atomic<bool> busy_{false};
  std::mutex mutex_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> threads_;
  const std::function<void(int)> *job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  int count_ = 0;
};

}  // namespace gptlocal

// Elementwise loops are compiled for a baseline x86-64 plus AVX2 and AVX-512 clones chosen at load time, so one
// cached library is right on any x86-64 CPU (build.py passes -DGPTLOCAL_NO_CLONES elsewhere).
#if defined(__x86_64__) && !defined(GPTLOCAL_NO_CLONES)
#define VEC_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VEC_CLONES
#endif

namespace {

// exp(x) for x <= 0 (e.g. scores minus their row max), ~2 ulp: Cephes' range reduction and polynomial, written
// with plain arithmetic and bit casts so the loops around it vectorise. Below -87.3 (masked scores) it is 0
// exactly, as expf underflows.
inline float exp_neg(float x) {
  const float clamped = x < -87.3f ? -87.3f : x;
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  float r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float value = p * scale;
  return x < -87.3f ? 0.0f : value;
}

// Holds the calling thread's OpenMP team size at one while our workers call dnnl_sgemm, and restores it after.
// Where oneDNN binds to the onednn-cpu-gomp package (MindSpore 2.7.2, whose own copy has another soname) each
// dnnl_sgemm would open a team of omp_get_max_threads() threads inside each of our threads, oversubscribing the
// cores (the attention kernel ran ~2x slower); MindSpore 2.9's copy (threadpool runtime) is sequential here anyway.
class SequentialGemm {
 public:
  SequentialGemm() : saved_(omp_get_max_threads()) { omp_set_num_threads(1); }
  ~SequentialGemm() { omp_set_num_threads(saved_); }
  SequentialGemm(const SequentialGemm &) = delete;
  SequentialGemm &operator=(const SequentialGemm &) = delete;

 private:
  int saved_;
};

// Runs job(t) for t = 0 .. count - 1, t = 0 on this thread, the others on the library's worker pool
// (gptlocal::WorkerPool), or on std::threads started for the call where the pool is busy; oneDNN's GEMMs
// sequential in each (SequentialGemm). Returns when all have ended. Not an OpenMP team: libgomp's idle threads spin
// after a parallel region (GOMP_SPINCOUNT, read once when MindSpore loads libgomp) and can take CPU from
// MindSpore's own thread pool running the model's next ops.
template <class Job>
void fork_join(int count, Job job) {
  if (count <= 1) {
    SequentialGemm one;
    job(0);
    return;
  }
  const std::function<void(int)> each = [&job](int t) {
    SequentialGemm one;
    job(t);
  };
  if (gptlocal::WorkerPool::get().run(count, each)) return;
  std::vector<std::thread> pool;
  for (int t = 1; t < count; ++t) pool.emplace_back(each, t);
  each(0);
  for (auto &thread : pool) thread.join();
}

// Runs worker(next, t) on `threads` threads (t = 0 is this one, fork_join); each worker takes tasks from the shared
// counter (dynamic scheduling) or uses its index t (static).
template <class Worker>
void run_parallel(int threads, int64_t tasks, Worker worker) {
  std::atomic<int64_t> next(0);
  const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, tasks)));
  fork_join(count, [&worker, &next](int t) { worker(next, t); });
}

// 1 / (1 + exp(-z)) without overflow: exp of -|z| only.
inline float sigmoid(float z) {
  const float e = exp_neg(-std::fabs(z));
  const float r = 1.0f / (1.0f + e);
  return z >= 0.0f ? r : e * r;
}

// GeLU on u = x + bias, the forms of the bias + GeLU kernels (cpu_norm_gelu.cc, cpu_linear.cc's epilogue): tanh
// u * sigmoid(2c(u + 0.044715 u^3)), c = sqrt(2/pi) (== 0.5 u (1 + tanh(c(u + 0.044715 u^3)))); quick
// u * sigmoid(1.702 u). gelu_grad: its derivative times dy. One definition each, so the kernels agree bit for bit.
constexpr float kTanhScale = 1.5957691216057308f;  // 2 * sqrt(2 / pi)
constexpr float kCubic = 0.044715f;
constexpr float kQuick = 1.702f;

inline float gelu_tanh(float u) { return u * sigmoid(kTanhScale * (u + kCubic * u * u * u)); }
inline float gelu_quick(float u) { return u * sigmoid(kQuick * u); }

inline float gelu_tanh_grad(float u, float dy) {
  const float square = u * u;
  const float s = sigmoid(kTanhScale * (u + kCubic * square * u));
  return dy * (s + u * s * (1.0f - s) * (kTanhScale * (1.0f + 3.0f * kCubic * square)));
}
inline float gelu_quick_grad(float u, float dy) {
  const float s = sigmoid(kQuick * u);
  return dy * (s + u * s * (1.0f - s) * kQuick);
}

// Runs work(chunk, begin, end) over `rows` split into at most `threads` contiguous chunks; returns the chunk count.
template <class Work>
int run_chunks(int threads, int64_t rows, Work work) {
  const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, rows)));
  const int64_t step = (rows + count - 1) / count;
  fork_join(count, [&work, step, rows](int t) {
    const int64_t begin = std::min<int64_t>(rows, t * step);
    work(t, begin, std::min<int64_t>(rows, (t + 1) * step));
  });
  return count;
}

// Runs work(begin, end) over `columns` split into at most `threads` blocks of whole 16-column groups, each block's
// oneDNN GEMM single-threaded (the Linear kernels: cpu_linear.cc, cpu_linear_int8.cc).
template <class Work>
void column_blocks(int threads, int64_t columns, Work work) {
  const int64_t groups = (columns + 15) / 16;
  const int count = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, groups)));
  const int64_t step = (groups + count - 1) / count * 16;
  fork_join(count, [&work, step, columns](int t) {
    const int64_t begin = std::min<int64_t>(columns, t * step), end = std::min<int64_t>(columns, (t + 1) * step);
    if (begin < end) work(begin, end);
  });
}

// Few elements: one thread (waking a worker costs more than the work; decode steps have a handful of rows).
inline int threads_for(float requested, int64_t elements) {
  const int threads = std::max(1, static_cast<int>(requested));
  return elements < 32768 ? 1 : threads;
}

// The product of every axis but the last: the rows of a [..., H] tensor.
inline int64_t leading(int ndim, const int64_t *shape) {
  int64_t rows = 1;
  for (int axis = 0; axis < ndim - 1; ++axis) rows *= shape[axis];
  return rows;
}

// The product of every axis: a tensor's element count.
inline int64_t elements(int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int axis = 0; axis < ndim; ++axis) n *= shape[axis];
  return n;
}

// bfloat16 as the GEMMs take it: the top 16 bits of a float32, rounded to nearest even (a NaN stays a quiet
// NaN). Plain bit arithmetic, so the loops over it vectorise in the AVX-512 / AVX2 clones.
inline uint16_t bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

// The float32 of bfloat16 bits (exact).
inline float bf16_value(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

// out[i] = bf16_bits(in[i]) for n elements.
VEC_CLONES void to_bf16(const float *in, int64_t n, uint16_t *out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits(in[i]);
}

// out[i] = in[i] rounded to the nearest bfloat16, kept as float32 (the emulated GEMM's inputs).
VEC_CLONES void round_bf16(const float *in, int64_t n, float *out) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_value(bf16_bits(in[i]));
}

// Every input and output of an AOT call is float32 (the kernels' one dtype).
inline bool all_float32(int n, const char **dtypes) {
  for (int i = 0; i < n; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return false;
  }
  return true;
}

// Each op's arguments beyond its tensors: one small struct per op, the op's last float32 input (its "config")
// read as that struct, its fields named, in the order args.py writes them (tests/kernels/test_args.py compares
// the two). Counts and modes travel as floats (the tensor's dtype); the kernels convert them once.
struct AttentionArgs {
  float scale, dropout_scale, dropout_mode, threads, query_block, key_block;  // dropout_mode: 0 none, 1, 2
};
struct LayerNormArgs {
  float epsilon, threads;
};
struct BiasGeluArgs {
  float form, threads;  // form: 0 tanh, 1 quick
};
struct RMSNormArgs {
  float epsilon, threads;
};
struct SwiGLUArgs {
  float threads;
};
struct LinearArgs {
  float threads, precision;  // precision: 0 float32, 1 bf16 x bf16 -> f32 (oneDNN), 2 the same numbers emulated
};
struct LinearGeluArgs {
  float threads, precision, form;  // LinearArgs' two, then BiasGeluArgs' form: 0 tanh, 1 quick
};
struct LoRADropoutArgs {
  float scale, mode, threads;  // scale 1 / (1 - p); mode 1 keep where the bits agree, 2 where they differ
};
struct DecodeLayerArgs {
  float epsilon, scale, form, threads, precision;  // the norms' epsilon, attention's scale; form: 0 tanh GeLU, 1 quick;
                                                   // precision: the GEMMs' (LinearArgs)
};
struct Int8LinearArgs {
  float threads;
};
struct AdamWArgs {
  float threads;
};
struct SquareSumArgs {
  float threads;
};

// Input `index`'s memory as the op's argument struct, or nullptr when that input is not exactly one such struct of
// float32 (a caller built for another layout: the kernel then fails the call instead of reading past it).
template <class Args>
const Args *args_at(int index, void **params, const int *ndims, int64_t **shapes, const char **dtypes) {
  static_assert(sizeof(Args) % sizeof(float) == 0, "argument structs hold floats only");
  if (ndims[index] != 1 || shapes[index][0] != static_cast<int64_t>(sizeof(Args) / sizeof(float)) ||
      std::strcmp(dtypes[index], "float32") != 0)
    return nullptr;
  return static_cast<const Args *>(params[index]);
}

struct Dropout {
  const float *t1, *t2;
  int32_t a, b;
  int mode;  // 0 none, 1 keep where equal, 2 keep where differ
  float scale;
  int64_t p1, p2;
};

// gpt_local's counter dropout (model/dropout.py CounterDropout) for a kernel: element idx of a flattened tensor is
// kept by T1[(idx + a) % P1] vs T2[(idx + b) % P2] (mode 1 kept where the bits agree, 2 where they differ), a and b
// the step/site offsets computed in the graph (CounterDropout.offsets). The attention kernel's probabilities
// (cpu_attention.cc) and LoRA's input dropout (lora_dropout.cc) draw their masks with it.
// keep[j] (0 or the dropout scale) for elements idx0 .. idx0 + n of the flattened tensor.
VEC_CLONES void drop_row(const Dropout &d, int64_t idx0, int n, float *keep) {
  int64_t s1 = (idx0 + d.a) % d.p1, s2 = (idx0 + d.b) % d.p2;
  const float keep_equal = d.mode == 1 ? d.scale : 0.0f, keep_differ = d.mode == 2 ? d.scale : 0.0f;
  int j = 0;
  while (j < n) {  // segments without a wrap of either table
    const int run = static_cast<int>(std::min<int64_t>(n - j, std::min(d.p1 - s1, d.p2 - s2)));
    const float *b1 = d.t1 + s1, *b2 = d.t2 + s2;
    float *out = keep + j;
#pragma omp simd
    for (int x = 0; x < run; ++x) out[x] = b1[x] != b2[x] ? keep_differ : keep_equal;
    j += run;
    s1 += run;
    s2 += run;
    if (s1 == d.p1) s1 = 0;
    if (s2 == d.p2) s2 = 0;
  }
}

}  // namespace
