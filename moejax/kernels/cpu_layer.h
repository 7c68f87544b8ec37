// One layer of a stacked [L, ...] operand, read in place: the `_at` variants of the
// kernels take the layer as an int32 scalar operand and read layer `layer` of their
// stacked weights (or KV cache, or slot buffers) where it lies. Under a `lax.scan` over
// layers XLA CPU would otherwise copy the sliced layer into a buffer of its own before
// every custom call (docs/engine.md, "The layers as one scan").
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace moejax {

namespace ffi = xla::ffi;

struct Slab {
  const void* data;
  std::vector<int64_t> dims;
  ffi::DataType type;
};

// Buffer b as it is (layer < 0), or its layer `layer` (clamped into [0, L) like XLA's
// dynamic indexing): the leading axis dropped, the data pointer moved to that layer.
inline Slab slab(const ffi::AnyBuffer& b, int64_t layer) {
  auto d = b.dimensions();
  std::vector<int64_t> dims(d.begin(), d.end());
  const char* data = static_cast<const char*>(b.untyped_data());
  if (layer >= 0 && !dims.empty()) {
    const int64_t l = std::min<int64_t>(std::max<int64_t>(layer, 0), dims[0] - 1);
    int64_t per = static_cast<int64_t>(ffi::ByteWidth(b.element_type()));
    for (size_t i = 1; i < dims.size(); ++i) per *= dims[i];
    data += l * per;
    dims.erase(dims.begin());
  }
  return {data, dims, b.element_type()};
}

inline int64_t layer_of(const ffi::Buffer<ffi::S32>& layer) { return layer.typed_data()[0]; }

}  // namespace moejax
