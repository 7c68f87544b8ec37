// bf16 <-> f32 for the CPU kernels (cpu_kernel.cc, cpu_attention.cc): bf16 is the high
// half of an f32; rounding to nearest even, like XLA's convert.
#ifndef MOEJAX_CPU_BF16_H_
#define MOEJAX_CPU_BF16_H_

#include <cstdint>
#include <cstring>

namespace moejax {

inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) {
  uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace moejax

#endif  // MOEJAX_CPU_BF16_H_
