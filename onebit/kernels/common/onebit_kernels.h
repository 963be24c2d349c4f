// What every onebit kernel computes the same way, written once: the sign
// test on each storage type, a scale rounded to bf16, and one element of
// the decode. The CPU (C++17), CUDA (nvcc) and SYCL sources include it, so
// the bits the wire format promises to be equal across kernels
// (docs/design.md) come from one definition. Each source still has its own
// vectorised paths (AVX2 lanes, CUDA quads and bytes); those use
// `signed_scale`, and the tests hold every path to the same bits.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define ONEBIT_HD __host__ __device__ __forceinline__
#else
#include <cmath>
#define ONEBIT_HD inline
#endif

namespace onebit_wire {

// "x >= 0" for each storage type. The 16-bit types are tested on their bits:
// non-negative unless NaN, or sign set with a non-zero magnitude.
struct Half { uint16_t bits; };
struct BFloat { uint16_t bits; };
ONEBIT_HD bool nonneg(float x) { return x >= 0.0f; }
ONEBIT_HD bool nonneg(double x) { return x >= 0.0; }
ONEBIT_HD bool nonneg(Half h) {
  uint16_t mag = h.bits & 0x7fff;
  return mag <= 0x7c00 && (!(h.bits & 0x8000) || mag == 0);
}
ONEBIT_HD bool nonneg(BFloat h) {
  uint16_t mag = h.bits & 0x7fff;
  return mag <= 0x7f80 && (!(h.bits & 0x8000) || mag == 0);
}

ONEBIT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, 4);
  return u;
#endif
}

ONEBIT_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  memcpy(&x, &u, 4);
  return x;
#endif
}

ONEBIT_HD bool is_nan(float x) {
#if defined(__CUDA_ARCH__)
  return isnan(x);
#else
  return std::isnan(x);
#endif
}

// The fp32 scale rounded to nearest-even bf16 (NaN stays NaN): the bf16 bits
// go into *bits, the value comes back as fp32.
ONEBIT_HD float round_bf16(float s, uint16_t* bits) {
  uint32_t u = float_bits(s);
  *bits = is_nan(s) ? uint16_t(0x7fc0) : uint16_t((u + (((u >> 16) & 1) + 0x7fff)) >> 16);
  return bits_float(uint32_t(*bits) << 16);
}

// A block's scale as it travels: rounded to bf16 when scale_bytes is 2,
// written little-endian at `out`; returns the value the error uses.
ONEBIT_HD float store_scale(float s, int scale_bytes, uint8_t* out) {
  if (scale_bytes == 2) {
    uint16_t h;
    s = round_bf16(s, &h);
    out[0] = uint8_t(h), out[1] = uint8_t(h >> 8);
  } else {
    const uint32_t u = float_bits(s);
    for (int t = 0; t < 4; ++t) out[t] = uint8_t(u >> (8 * t));
  }
  return s;
}

// Pass 1 of error feedback on one onebit block [b, e) (e - b a multiple of
// 8): err <- x = buf + err (buf is zero from n_buf on: the padding), and
// the block's sum of x^2 in double, in the one order every kernel sums (so
// a scale has the same bits wherever it is computed): eight partial sums,
// partial j over elements j, j + 8, j + 16, ... in turn, combined as
// ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)). A float's square is
// exact in double, so a fused multiply-add rounds as a multiply and an add do.
ONEBIT_HD double block_sumsq_in_order(const float* buf, int64_t n_buf, float* err, int64_t b,
                                      int64_t e) {
  double part[8] = {0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0};
  for (int64_t i = b; i < e; i += 8) {
    for (int j = 0; j < 8; ++j) {
      float x = i + j < n_buf ? buf[i + j] + err[i + j] : err[i + j];
      err[i + j] = x;
      part[j] += double(x) * double(x);
    }
  }
  return ((part[0] + part[4]) + (part[1] + part[5])) + ((part[2] + part[6]) + (part[3] + part[7]));
}

// Bit t of `bits` as a signed scale: +s for a 1 (x >= 0), -s for a 0.
ONEBIT_HD float signed_scale(uint32_t bits, int t, float s) { return ((bits >> t) & 1) ? s : -s; }

// Element j of a decode: the mean over `rows` rows of row r's bit j as a
// signed scale, s = scales[r, j / block]; each row added in turn from 0.
ONEBIT_HD float decode_element(const uint8_t* bits, int64_t row_bytes, int rows,
                               const float* scales, int64_t nblocks, int64_t block, int64_t j) {
  float acc = 0.0f;
  for (int r = 0; r < rows; ++r)
    acc += signed_scale(bits[r * row_bytes + j / 8], int(j % 8), scales[r * nblocks + j / block]);
  return acc * (1.0f / float(rows));
}

}  // namespace onebit_wire
