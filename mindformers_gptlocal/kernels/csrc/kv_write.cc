// In-place ScatterNdUpdate for the decode KV cache on CPU (gpt_local, kernels/cells/kv_write.py).
//
// inputs:  cache [d0, d1, ..., dn-1] (a Parameter, written IN PLACE), index [..., K] int32/int64 (K <= n:
//          positions over the cache's first K axes), updates [..., d_K, ..., dn-1]
// output:  status [1] int32 (0), a token for ordering; the cache itself is the result.
// Same values as ScatterNdUpdate(cache, index, updates), but it copies only the updated slices, where
// MindSpore 2.7.2's CPU ScatterNdUpdate copies the whole cache each call.
#include <cstdint>
#include <cstring>

#include "cores.h"  // the Status codes (generated, codegen.py)

namespace {
int64_t ItemSize(const char *dtype) {
  if (std::strcmp(dtype, "float32") == 0 || std::strcmp(dtype, "int32") == 0) return sizeof(int32_t);
  if (std::strcmp(dtype, "float16") == 0 || std::strcmp(dtype, "bfloat16") == 0) return sizeof(uint16_t);
  if (std::strcmp(dtype, "float64") == 0 || std::strcmp(dtype, "int64") == 0) return sizeof(int64_t);
  return 0;
}
}  // namespace

extern "C" int InPlaceScatterNdUpdate(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes,
                                      void *stream, void *extra) {
  if (nparam != 4) return Status::kBadCall;
  const int cache_rank = ndims[0];
  const int index_rank = ndims[1];
  const int64_t k = shapes[1][index_rank - 1];
  const int64_t item = ItemSize(dtypes[0]);
  if (item == 0 || ItemSize(dtypes[2]) != item || k < 1 || k > cache_rank) return Status::kBadShape;
  const bool wide = std::strcmp(dtypes[1], "int64") == 0;
  if (!wide && std::strcmp(dtypes[1], "int32") != 0) return Status::kBadCall;
  int64_t slice = item;  // bytes of one updated slice: the cache's trailing axes after the first k
  for (int axis = static_cast<int>(k); axis < cache_rank; ++axis) slice *= shapes[0][axis];
  int64_t count = 1;  // index tuples
  for (int axis = 0; axis < index_rank - 1; ++axis) count *= shapes[1][axis];
  char *cache = static_cast<char *>(params[0]);
  const char *updates = static_cast<const char *>(params[2]);
  for (int64_t i = 0; i < count; ++i) {
    int64_t offset = 0;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t at = wide ? static_cast<const int64_t *>(params[1])[i * k + j]
                              : static_cast<const int32_t *>(params[1])[i * k + j];
      if (at < 0 || at >= shapes[0][j]) return Status::kCacheIndex;  // out of range: nothing past this tuple is written
      offset = offset * shapes[0][j] + at;
    }
    std::memcpy(cache + offset * slice, updates + i * slice, slice);
  }
  static_cast<int32_t *>(params[3])[0] = 0;
  return 0;
}
