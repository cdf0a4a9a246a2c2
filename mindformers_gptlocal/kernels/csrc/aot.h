// MindSpore's AOT call (nparam, params, ndims, shapes, dtypes) checked against a kernel's tensors and turned into its
// typed core's arguments: the one prologue of every generated entry point (codegen.py writes each kernel's tensors
// as a Signature from kernels/abi/table.py, calls bind, then the core, then finish). bind returns Status::kOk, or
// kBadCall where the call does not fit (the parameter count, a dtype, a rank, the options vector's length) and
// kBadShape where a dim disagrees with another use of its name or with a fixed length; the kernel then fails the call
// with nothing computed.
#pragma once

#include <cstdint>
#include <cstring>

#include "cores.h"  // the Status codes (generated, codegen.py)

namespace gptlocal {
namespace aot {

// A dim of a tensor (spec.py's): a named size, a leading group (the axes before the tensor's other dims, their product
// the size), a fixed length, any length.
enum DimKind : int8_t { kSize, kLeading, kFixed, kAny };

constexpr int kMaxDims = 6, kMaxTensors = 48, kMaxSizes = 32;  // the training layer's backward: 40 tensors, 20 sizes

struct Dim {
  DimKind kind;
  int64_t value;  // kSize, kLeading: the size's index, or (kLeading, -n): axes of n elements in all; kFixed: n
};

struct Tensor {
  const char *dtype;  // MindSpore's name: "float32", "bfloat16", "int8", "int32"
  int rank;           // the dims below (a leading group counts one)
  Dim dims[kMaxDims];
  bool optional;  // an input the call may leave out (the core gets nullptr)
  bool token;     // an int32 [1] output, 0 after the core succeeded (not passed to it)
  bool leading_fixed() const { return rank > 0 && dims[0].kind == kLeading && dims[0].value < 0; }
};

// A kernel: its tensors (inputs, then outputs), how many are inputs, the options vector's int32 words (the options
// come right after the inputs).
struct Signature {
  const Tensor *tensors;
  int count, inputs, option_words;
};

// The call's tensors in the kernel's order (nullptr: an optional input left out), its sizes, its options.
struct Call {
  void *data[kMaxTensors];
  int64_t size[kMaxSizes];
  const void *options;
  template <class T>
  const T *in(int i) const { return static_cast<const T *>(data[i]); }
  template <class T>
  T *out(int i) const { return static_cast<T *>(data[i]); }
};

inline int bind(const Signature &sig, int nparam, void **params, const int *ndims, int64_t *const *shapes,
                const char **dtypes, Call *call) {
  bool has_optional = true;
  if (nparam != sig.count + 1) {
    bool any_optional = false;
    for (int i = 0; i < sig.count; ++i) any_optional = any_optional || sig.tensors[i].optional;
    if (!any_optional || nparam != sig.count) return Status::kBadCall;
    has_optional = false;
  }
  bool bound[kMaxSizes] = {};
  int p = 0;  // the parameter
  for (int i = 0; i <= sig.count; ++i) {
    if (i == sig.inputs) {  // the options: one int32 vector of the struct's words
      if (std::strcmp(dtypes[p], "int32") != 0 || ndims[p] != 1 || shapes[p][0] != sig.option_words) {
        return Status::kBadCall;
      }
      call->options = params[p++];
    }
    if (i == sig.count) break;
    const Tensor &t = sig.tensors[i];
    if (t.optional && !has_optional) {
      call->data[i] = nullptr;
      continue;
    }
    const bool leading = t.rank > 0 && t.dims[0].kind == kLeading;
    const int lead = leading ? ndims[p] - (t.rank - 1) : 0;  // the axes the leading group covers
    if (std::strcmp(dtypes[p], t.dtype) != 0 || (leading ? lead < 0 : ndims[p] != t.rank)) return Status::kBadCall;
    for (int d = 0; d < t.rank; ++d) {
      int64_t length = 1;
      if (leading && d == 0) {
        for (int axis = 0; axis < lead; ++axis) length *= shapes[p][axis];
      } else {
        length = shapes[p][lead + d - (leading ? 1 : 0)];
      }
      const Dim &dim = t.dims[d];
      if (dim.kind == kAny) continue;
      if (dim.kind == kFixed || (d == 0 && t.leading_fixed())) {
        if (length != (dim.kind == kFixed ? dim.value : -dim.value)) return Status::kBadShape;
        continue;
      }
      if (bound[dim.value] && call->size[dim.value] != length) return Status::kBadShape;
      bound[dim.value] = true;
      call->size[dim.value] = length;
    }
    call->data[i] = params[p++];
  }
  return 0;
}

// The core's status; on success each token output set to 0.
inline int finish(const Signature &sig, const Call &call, int status) {
  if (status != 0) return status;
  for (int i = sig.inputs; i < sig.count; ++i) {
    if (sig.tensors[i].token) *static_cast<int32_t *>(call.data[i]) = 0;
  }
  return 0;
}

}  // namespace aot
}  // namespace gptlocal
