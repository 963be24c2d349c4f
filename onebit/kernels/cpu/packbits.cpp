// Sign-bit packing for onebit on the CPU.
//
// Wire format (docs/design.md): bit = 1 iff x >= 0 (IEEE compare, so -0.0 -> 1 and
// NaN -> 0); element 8*i + j is bit j of byte i; a short tail is padded with
// zero bits; unpacking gives +1.0f for a 1 bit and -1.0f for a 0 bit.
//
// The module knows nothing about torch: the Python side passes data pointers
// (as integers) and element counts, so it builds in seconds with plain
// pybind11 and never needs torch headers. Every entry point releases the GIL
// and splits large inputs over `threads` std::threads, each on whole bytes.
//
// The AVX2 paths are compiled with a function-level target attribute and
// chosen at run time, so one binary runs on any x86-64 (and elsewhere the
// portable paths are all there is). ONEBIT_CPU_PORTABLE=1 forces them, which
// is how the tests check the two against each other.

#include <pybind11/pybind11.h>

#include "../common/onebit_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define ONEBIT_X86 1
#endif

namespace py = pybind11;

namespace {

// ---------------------------------------------------------------- helpers --

// Below this many elements a thread costs more than it saves.
constexpr int64_t kMinPerThread = 1 << 18;

bool has_avx2() {
#ifdef ONEBIT_X86
  static const bool ok = [] {
    const char* force = std::getenv("ONEBIT_CPU_PORTABLE");
    if (force && force[0] && std::strcmp(force, "0") != 0) return false;
    return bool(__builtin_cpu_supports("avx2"));
  }();
  return ok;
#else
  return false;
#endif
}

// Runs fn(k, begin, end) over [0, n) in pieces aligned to `align` elements,
// piece k on thread k (k < threads). Alignment to 8 keeps every piece on whole
// output bytes; the index lets a reduction keep one partial per piece.
template <typename Fn>
void parallel_for(int64_t n, int threads, int64_t align, Fn fn) {
  int64_t want = std::max<int64_t>(1, n / kMinPerThread);
  int t = int(std::min<int64_t>(std::max(threads, 1), want));
  if (t <= 1) {
    fn(0, int64_t(0), n);
    return;
  }
  int64_t piece = (n + t - 1) / t;
  piece = (piece + align - 1) / align * align;
  std::vector<std::thread> pool;
  for (int k = 1; k < t; ++k) {
    int64_t b = k * piece, e = std::min(n, b + piece);
    if (b < e) pool.emplace_back(fn, k, b, e);
  }
  fn(0, int64_t(0), std::min(n, piece));
  for (auto& th : pool) th.join();
}

// nonneg (the sign test of each storage type), round_bf16 and the scalar
// decode: ../common/onebit_kernels.h, shared with the CUDA and SYCL kernels.
using namespace onebit_wire;

// ------------------------------------------------------------------ pack --

template <typename T>
void pack_portable(const T* x, int64_t b, int64_t e, uint8_t* out) {
  for (int64_t i = b; i < e; i += 8) {
    int64_t m = std::min<int64_t>(8, e - i);
    uint8_t byte = 0;
    for (int64_t j = 0; j < m; ++j) byte |= uint8_t(nonneg(x[i + j])) << j;
    out[i / 8] = byte;
  }
}

#ifdef ONEBIT_X86
// One compare + movemask turns 8 floats into one byte, already in little bit
// order (lane j -> bit j). _CMP_GE_OQ is false for NaN, like the scalar compare.
__attribute__((target("avx2"))) void pack_avx2(const float* x, int64_t b,
                                               int64_t e, uint8_t* out) {
  const __m256 zero = _mm256_setzero_ps();
  int64_t i = b;
  for (; i + 32 <= e; i += 32) {
    uint32_t m0 = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), zero, _CMP_GE_OQ));
    uint32_t m1 = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 8), zero, _CMP_GE_OQ));
    uint32_t m2 = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 16), zero, _CMP_GE_OQ));
    uint32_t m3 = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i + 24), zero, _CMP_GE_OQ));
    uint32_t word = m0 | (m1 << 8) | (m2 << 16) | (m3 << 24);
    std::memcpy(out + i / 8, &word, 4);
  }
  for (; i + 8 <= e; i += 8)
    out[i / 8] = uint8_t(_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), zero, _CMP_GE_OQ)));
  if (i < e) pack_portable(x, i, e, out);
}
#endif

template <typename T>
void pack_any(uintptr_t src, int64_t n, uintptr_t dst, int threads) {
  const T* x = reinterpret_cast<const T*>(src);
  uint8_t* out = reinterpret_cast<uint8_t*>(dst);
  py::gil_scoped_release nogil;
  parallel_for(n, threads, 32, [&](int, int64_t b, int64_t e) {
#ifdef ONEBIT_X86
    if constexpr (std::is_same_v<T, float>) {
      if (has_avx2()) return pack_avx2(x, b, e, out);
    }
#endif
    pack_portable(x, b, e, out);
  });
}

// dtype codes match onebit/ops.py: 0 fp32, 1 fp64, 2 fp16, 3 bf16.
void pack(int dtype, uintptr_t src, int64_t n, uintptr_t dst, int threads) {
  switch (dtype) {
    case 0: return pack_any<float>(src, n, dst, threads);
    case 1: return pack_any<double>(src, n, dst, threads);
    case 2: return pack_any<Half>(src, n, dst, threads);
    case 3: return pack_any<BFloat>(src, n, dst, threads);
  }
  throw py::value_error("packbits: unknown dtype code " + std::to_string(dtype));
}

// ---------------------------------------------------------------- decode --
//
// out[j] = the mean over `rows` rows of scales[r, j / block] * sign(row r,
// bit j), for j in [0, cols): scales is [rows, ceil(cols / block)] floats.
// With rows == 1 and one scale of 1 this is plain unpackbits; with
// rows == p it is the server's average of the workers' signs.

void decode_portable(const uint8_t* bits, int64_t row_bytes, int rows, const float* scales,
                     int64_t nblocks, int64_t block, int64_t b, int64_t e, float* out) {
  for (int64_t j = b; j < e; ++j)
    out[j] = decode_element(bits, row_bytes, rows, scales, nblocks, block, j);
}

#ifdef ONEBIT_X86
// `block` is a multiple of 8, so the 8 lanes of a step share one scale.
__attribute__((target("avx2"))) void decode_avx2(const uint8_t* bits, int64_t row_bytes, int rows,
                                                 const float* scales, int64_t nblocks,
                                                 int64_t block, int64_t b, int64_t e, float* out) {
  // Lane j of `lane_bit` selects bit j of a broadcast byte.
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 sign_mask = _mm256_castsi256_ps(_mm256_set1_epi32(int(0x80000000u)));
  const __m256 inv = _mm256_set1_ps(1.0f / float(rows));
  int64_t j = b;
  for (; j + 8 <= e; j += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int r = 0; r < rows; ++r) {
      __m256i byte = _mm256_set1_epi32(bits[r * row_bytes + j / 8]);
      __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bit), lane_bit);
      // A 0 bit flips the sign of the scale: xor with the sign bit where unset.
      __m256 flip = _mm256_andnot_ps(_mm256_castsi256_ps(set), sign_mask);
      __m256 s = _mm256_set1_ps(scales[r * nblocks + j / block]);
      acc = _mm256_add_ps(acc, _mm256_xor_ps(s, flip));
    }
    _mm256_storeu_ps(out + j, _mm256_mul_ps(acc, inv));
  }
  if (j < e) decode_portable(bits, row_bytes, rows, scales, nblocks, block, j, e, out);
}
#endif

void decode(uintptr_t src, int64_t row_bytes, int rows, uintptr_t scales_ptr, int64_t block,
            int64_t cols, uintptr_t dst, int threads) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  const float* scales = reinterpret_cast<const float*>(scales_ptr);
  float* out = reinterpret_cast<float*>(dst);
  if (block <= 0 || block % 8) throw py::value_error("decode: block must be a positive multiple of 8");
  const int64_t nblocks = (cols + block - 1) / block;
  py::gil_scoped_release nogil;
  parallel_for(cols, threads, 8, [&](int, int64_t b, int64_t e) {
#ifdef ONEBIT_X86
    if (has_avx2()) return decode_avx2(bits, row_bytes, rows, scales, nblocks, block, b, e, out);
#endif
    decode_portable(bits, row_bytes, rows, scales, nblocks, block, b, e, out);
  });
}

// Each of `rows` rows decoded on its own (no mean), into its own stretch of
// `out`: out[r * out_stride + j] = scales[r, j / block] * sign(row r, bit j)
// for j < cols and r * out_stride + j < total; scales is [rows,
// ceil(cols / block)]. The same bits as a one-row decode of each row: every
// rank's decode of the all-gathered chunks, in one call.
void decode_rows(uintptr_t src, int64_t row_bytes, int rows, uintptr_t scales_ptr, int64_t block,
                 int64_t cols, uintptr_t dst, int64_t out_stride, int64_t total, int threads) {
  const uint8_t* bits = reinterpret_cast<const uint8_t*>(src);
  const float* scales = reinterpret_cast<const float*>(scales_ptr);
  float* out = reinterpret_cast<float*>(dst);
  if (block <= 0 || block % 8) throw py::value_error("decode_rows: block must be a positive multiple of 8");
  if (rows < 0 || cols < 0 || out_stride < cols) throw py::value_error("decode_rows: rows overlap in out");
  if (rows == 0 || cols == 0) return;
  const int64_t nblocks = (cols + block - 1) / block;
  // One range over every row's columns, each row padded to whole bytes (so
  // a thread's part starts on a byte of its row); a part may span rows.
  const int64_t width = (cols + 7) / 8 * 8;
  py::gil_scoped_release nogil;
  parallel_for(int64_t(rows) * width, threads, 8, [&](int, int64_t b, int64_t e) {
    for (int64_t r = b / width; r < rows && r * width < e; ++r) {
      const int64_t lo = std::max(b, r * width) - r * width;
      const int64_t hi = std::min({e - r * width, cols, total - r * out_stride});
      if (lo >= hi) continue;
      const uint8_t* row = bits + r * row_bytes;
      const float* row_scales = scales + r * nblocks;
      float* row_out = out + r * out_stride;
#ifdef ONEBIT_X86
      if (has_avx2()) {
        decode_avx2(row, row_bytes, 1, row_scales, nblocks, block, lo, hi, row_out);
        continue;
      }
#endif
      decode_portable(row, row_bytes, 1, row_scales, nblocks, block, lo, hi, row_out);
    }
  });
}

// ------------------------------------------------- compensate and pack --
//
// The worker's (and the server's) error-feedback step, in two passes over
// memory instead of the five that separate torch ops take:
//   compensate:  x = buf + err (buf is zero past n_buf: the padding), kept in
//                err; sumsq[k] = sum of x^2 over block k, in double
//   (the caller turns sumsq into one scale per block)
//   pack_error:  bits = pack(x >= 0); err = x - scales[k] * sign(x)
// Each block's sum runs in one fixed order from the block's start, whatever
// the threading and wherever the block sits in the buffer: the same block
// gives the same scale in a fused buffer, a bucket or a pipelined piece.

// Each block's sum of squares runs in block_sumsq_in_order's one order
// (../common/onebit_kernels.h), the AVX2 loop's natural order (two 4-lane
// accumulators), so a scale has the same bits on every kernel.
double block_sumsq_portable(const float* buf, int64_t n_buf, float* err, int64_t b, int64_t e) {
  return block_sumsq_in_order(buf, n_buf, err, b, e);
}

void pack_error_portable(float* err, float s, int64_t b, int64_t e, uint8_t* out) {
  for (int64_t i = b; i < e; i += 8) {
    int64_t m = std::min<int64_t>(8, e - i);
    uint8_t byte = 0;
    for (int64_t j = 0; j < m; ++j) {
      float x = err[i + j];
      bool one = x >= 0.0f;
      byte |= uint8_t(one) << j;
      err[i + j] = one ? x - s : x + s;
    }
    out[i / 8] = byte;
  }
}

#ifdef ONEBIT_X86
// One block [b, e), e - b a multiple of 8.
__attribute__((target("avx2,fma"))) double block_sumsq_avx2(const float* buf, int64_t n_buf,
                                                            float* err, int64_t b, int64_t e) {
  if (e > n_buf && b < n_buf) return block_sumsq_portable(buf, n_buf, err, b, e);  // straddles the end
  const bool padding = b >= n_buf;  // x is err itself
  __m256d acc0 = _mm256_setzero_pd(), acc1 = _mm256_setzero_pd();
  for (int64_t i = b; i < e; i += 8) {
    __m256 x = _mm256_loadu_ps(err + i);
    if (!padding) {
      x = _mm256_add_ps(_mm256_loadu_ps(buf + i), x);
      _mm256_storeu_ps(err + i, x);
    }
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
    __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
    acc0 = _mm256_fmadd_pd(lo, lo, acc0);
    acc1 = _mm256_fmadd_pd(hi, hi, acc1);
  }
  double lanes[4];  // lane j: s_j + s_(j+4), the order of block_sumsq_portable
  _mm256_storeu_pd(lanes, _mm256_add_pd(acc0, acc1));
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

__attribute__((target("avx2"))) void pack_error_avx2(float* err, float s, int64_t b, int64_t e,
                                                     uint8_t* out) {
  const __m256 zero = _mm256_setzero_ps();
  const __m256 plus = _mm256_set1_ps(s), minus = _mm256_set1_ps(-s);
  int64_t i = b;
  for (; i + 8 <= e; i += 8) {
    __m256 x = _mm256_loadu_ps(err + i);
    __m256 ge = _mm256_cmp_ps(x, zero, _CMP_GE_OQ);
    out[i / 8] = uint8_t(_mm256_movemask_ps(ge));
    // x - s*sign(x): subtract s where x >= 0, add it elsewhere.
    _mm256_storeu_ps(err + i, _mm256_sub_ps(x, _mm256_blendv_ps(minus, plus, ge)));
  }
  if (i < e) pack_error_portable(err, s, i, e, out);
}
#endif

// One block of each pass, on the AVX2 path where it is in use.
inline double block_sumsq(const float* buf, int64_t n_buf, float* err, int64_t b, int64_t e,
                          bool avx2) {
#ifdef ONEBIT_X86
  if (avx2) return block_sumsq_avx2(buf, n_buf, err, b, e);
#endif
  return block_sumsq_portable(buf, n_buf, err, b, e);
}

inline void block_pack_error(float* err, float s, int64_t b, int64_t e, uint8_t* out, bool avx2) {
#ifdef ONEBIT_X86
  if (avx2) return pack_error_avx2(err, s, b, e, out);
#endif
  pack_error_portable(err, s, b, e, out);
}

void check_blocks(int64_t n, int64_t block) {
  if (block <= 0 || block % 8 || n % block)
    throw py::value_error("block must be a positive multiple of 8 that divides n");
}

void compensate(uintptr_t buf_ptr, int64_t n_buf, uintptr_t err_ptr, int64_t n, int64_t block,
                uintptr_t sumsq_ptr, int threads) {
  check_blocks(n, block);
  const float* buf = reinterpret_cast<const float*>(buf_ptr);
  float* err = reinterpret_cast<float*>(err_ptr);
  double* sumsq = reinterpret_cast<double*>(sumsq_ptr);
  py::gil_scoped_release nogil;
  const bool avx2 = has_avx2();
  parallel_for(n, threads, block, [&](int, int64_t b, int64_t e) {
    for (int64_t k = b; k < e; k += block)
      sumsq[k / block] = block_sumsq(buf, n_buf, err, k, k + block, avx2);
  });
}

void pack_error(uintptr_t err_ptr, int64_t n, uintptr_t scales_ptr, int64_t block, uintptr_t dst,
                int threads) {
  check_blocks(n, block);
  float* err = reinterpret_cast<float*>(err_ptr);
  const float* scales = reinterpret_cast<const float*>(scales_ptr);
  uint8_t* out = reinterpret_cast<uint8_t*>(dst);
  py::gil_scoped_release nogil;
  const bool avx2 = has_avx2();
  parallel_for(n, threads, block, [&](int, int64_t b, int64_t e) {
    for (int64_t k = b; k < e; k += block)
      block_pack_error(err, scales[k / block], k, k + block, out, avx2);
  });
}

// compensate, each block's scale and pack_error in one pass over memory: a
// block is still in L1 when its signs are packed, so err is read and written
// once instead of twice. The scale is what the composed path computes
// (onebit/ops.py): sqrt(sumsq / count) in double, rounded to fp32 and, for
// 2-byte scales, again to bf16 (torch's double -> bfloat16 goes through fp32
// too), written little-endian; the error uses the rounded value.
// compress on `rows` rows in one call (the worker's row for each rank):
// row r reads buf + r * in_stride (real up to n_buf - r * in_stride, zero
// after), err + r * in_stride and counts + r * in_stride / block, n
// elements each, and writes its scales and signs at r * out_stride bytes
// past scales_dst and bits_dst. Every block lies inside one row, so each
// row gets the bits a call of its own would give.
void compress_rows(uintptr_t buf_ptr, int64_t n_buf, uintptr_t err_ptr, int64_t n, int rows,
                   int64_t in_stride, int64_t block, uintptr_t counts_ptr, int scale_bytes,
                   uintptr_t scales_dst, uintptr_t bits_dst, int64_t out_stride, int threads) {
  check_blocks(n, block);
  if (scale_bytes != 4 && scale_bytes != 2) throw py::value_error("compress: scale_bytes must be 4 or 2");
  if (rows < 0 || (rows > 1 && (in_stride < n || in_stride % block)))
    throw py::value_error("compress_rows: in_stride must be a multiple of block of at least n");
  const float* buf = reinterpret_cast<const float*>(buf_ptr);
  float* err = reinterpret_cast<float*>(err_ptr);
  const double* counts = reinterpret_cast<const double*>(counts_ptr);
  uint8_t* scales = reinterpret_cast<uint8_t*>(scales_dst);
  uint8_t* out = reinterpret_cast<uint8_t*>(bits_dst);
  py::gil_scoped_release nogil;
  const bool avx2 = has_avx2();
  parallel_for(int64_t(rows) * n, threads, block, [&](int, int64_t b, int64_t e) {
    for (int64_t g = b; g < e; g += block) {
      const int64_t r = g / n, k = g % n, j = k / block;
      const int64_t real = std::min(n, n_buf - r * in_stride);  // this row's buf elements
      const float* row_buf = real > 0 ? buf + r * in_stride : buf;
      float* row_err = err + r * in_stride;
      uint8_t* row_scales = scales + r * out_stride;
      const float s = store_scale(
          float(std::sqrt(block_sumsq(row_buf, real, row_err, k, k + block, avx2) /
                          counts[r * (in_stride / block) + j])),
          scale_bytes, row_scales + scale_bytes * j);
      block_pack_error(row_err, s, k, k + block, out + r * out_stride, avx2);
    }
  });
}

// compensate, each block's scale and pack_error in one pass over memory: a
// block is still in L1 when its signs are packed, so err is read and written
// once instead of twice. The scale is what the composed path computes
// (onebit/ops.py): sqrt(sumsq / count) in double, rounded to fp32 and, for
// 2-byte scales, again to bf16 (torch's double -> bfloat16 goes through fp32
// too), written little-endian; the error uses the rounded value.
void compress(uintptr_t buf_ptr, int64_t n_buf, uintptr_t err_ptr, int64_t n, int64_t block,
              uintptr_t counts_ptr, int scale_bytes, uintptr_t scales_dst, uintptr_t bits_dst,
              int threads) {
  compress_rows(buf_ptr, n_buf, err_ptr, n, 1, 0, block, counts_ptr, scale_bytes, scales_dst,
                bits_dst, 0, threads);
}

}  // namespace

PYBIND11_MODULE(_packbits_cpu, m) {
  m.doc() = "onebit CPU sign-bit kernels (raw pointers; see onebit/ops.py)";
  m.def("pack", &pack, "pack signs of n elements of dtype code into ceil(n/8) bytes");
  m.def("decode", &decode, "mean over rows of the block's scale * sign, for cols elements");
  m.def("compensate", &compensate, "err <- buf + err; sum of squares of each block");
  m.def("pack_error", &pack_error, "pack signs of err; err -= the block's scale * sign");
  m.def("compress", &compress, "compensate, each block's scale and pack_error in one pass");
  m.def("compress_rows", &compress_rows, "compress on several strided rows in one call");
  m.def("decode_rows", &decode_rows, "decode each row on its own into its stretch of out");
  m.def("has_avx2", &has_avx2, "whether the AVX2 paths are in use");
}
