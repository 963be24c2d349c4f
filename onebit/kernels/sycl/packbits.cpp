// Sign-bit packing for onebit on Intel GPUs (SYCL 2020).
//
// Same wire format as every other kernel (docs/design.md): bit = 1 iff x >= 0,
// element 8*i + j is bit j of byte i, a short tail is padded with zero bits,
// unpacking gives +1.0f / -1.0f. One work-item builds one output byte, which
// keeps every write whole and needs no sub-group ballot.
//
// extern "C" entry points over raw USM device pointers and the sycl::queue of
// torch's current XPU stream (passed as a pointer), loaded with ctypes.
// Each returns 0 on success and 1 if SYCL threw.

#include <sycl/sycl.hpp>

#include <cmath>
#include <cstdint>

#include "../common/onebit_kernels.h"

namespace {

// nonneg and decode_element: ../common/onebit_kernels.h, shared with the
// CPU and CUDA kernels.
using namespace onebit_wire;

template <typename T>
void pack_on(sycl::queue& q, const T* x, int64_t n, uint8_t* out) {
  const int64_t nbytes = (n + 7) / 8;
  q.parallel_for(sycl::range<1>(size_t(nbytes)), [=](sycl::id<1> id) {
    int64_t byte = int64_t(id[0]);
    uint8_t v = 0;
    for (int j = 0; j < 8; ++j) {
      int64_t i = byte * 8 + j;
      if (i < n && nonneg(x[i])) v |= uint8_t(1u << j);
    }
    out[byte] = v;
  });
}

}  // namespace

extern "C" {

// dtype codes match builders/cpu.py: 0 fp32, 1 fp64, 2 fp16, 3 bf16.
int onebit_sycl_pack(void* queue, int dtype, const void* x, int64_t n, uint8_t* out) {
  try {
    auto& q = *static_cast<sycl::queue*>(queue);
    if (n == 0) return 0;
    switch (dtype) {
      case 0: pack_on(q, static_cast<const float*>(x), n, out); break;
      case 1: pack_on(q, static_cast<const double*>(x), n, out); break;
      case 2: pack_on(q, static_cast<const Half*>(x), n, out); break;
      case 3: pack_on(q, static_cast<const BFloat*>(x), n, out); break;
      default: return 1;
    }
    return 0;
  } catch (...) {
    return 1;
  }
}

// out[j] = (1/rows) * sum_r (bit(r, j) ? s : -s), s = scales[r, j / block], j < cols.
int onebit_sycl_decode(void* queue, const uint8_t* bits, int64_t row_bytes, int rows,
                       const float* scales, int64_t block, int64_t cols, float* out) {
  try {
    auto& q = *static_cast<sycl::queue*>(queue);
    if (cols == 0) return 0;
    if (block <= 0 || block % 8) return 1;
    const int64_t nblocks = (cols + block - 1) / block;
    q.parallel_for(sycl::range<1>(size_t(cols)), [=](sycl::id<1> id) {
      const int64_t j = int64_t(id[0]);
      out[j] = decode_element(bits, row_bytes, rows, scales, nblocks, block, j);
    });
    return 0;
  } catch (...) {
    return 1;
  }
}

// err <- x = buf (zero past n_buf) + err; sumsq[k] = sum of x^2 over onebit
// block k. One work-item per block, summing in block_sumsq_in_order's one
// order (../common/onebit_kernels.h): the CPU's and CUDA's, so a scale has
// the same bits on every device.
int onebit_sycl_compensate(void* queue, const float* buf, int64_t n_buf, float* err, int64_t n,
                           int64_t block, double* sumsq) {
  try {
    auto& q = *static_cast<sycl::queue*>(queue);
    if (block <= 0 || block % 8 || n % block) return 1;
    if (n == 0) return 0;
    q.parallel_for(sycl::range<1>(size_t(n / block)), [=](sycl::id<1> id) {
      const int64_t k = int64_t(id[0]);
      sumsq[k] = block_sumsq_in_order(buf, n_buf, err, k * block, (k + 1) * block);
    });
    return 0;
  } catch (...) {
    return 1;
  }
}

// out = pack(err >= 0); err <- err - s * sign(err), s the scale of the block.
int onebit_sycl_pack_error(void* queue, float* err, int64_t n, const float* scales,
                           int64_t block, uint8_t* out) {
  try {
    auto& q = *static_cast<sycl::queue*>(queue);
    if (block <= 0 || block % 8 || n % block) return 1;
    if (n == 0) return 0;
    q.parallel_for(sycl::range<1>(size_t(n / 8)), [=](sycl::id<1> id) {
      int64_t byte = int64_t(id[0]);
      const float s = scales[byte * 8 / block];  // a byte never straddles two blocks
      uint8_t v = 0;
      for (int j = 0; j < 8; ++j) {
        int64_t i = byte * 8 + j;
        float x = err[i];
        bool bit = x >= 0.0f;
        v |= uint8_t(bit) << j;
        err[i] = bit ? x - s : x + s;
      }
      out[byte] = v;
    });
    return 0;
  } catch (...) {
    return 1;
  }
}

// compensate, each block's scale and pack_error in one pass (the CPU
// kernel's `compress`), on `rows` rows in one launch (the worker's row for
// each rank): row r reads n elements from buf + r * in_stride (n_buf real
// from buf on, zero after), err + r * in_stride and counts + r * in_stride
// / block, and writes its n / block scales (scale_bytes each: 4 fp32, 2
// bf16, little-endian) and n / 8 bytes of signs at r * out_stride bytes
// past scales_out and bits_out. One work-item per block: the scale is
// sqrt(sum / count) in double, rounded to fp32 (and to bf16), and the
// error takes the rounded scale, as on the CPU.
int onebit_sycl_compress_rows(void* queue, const float* buf, int64_t n_buf, float* err, int64_t n,
                              int rows, int64_t in_stride, int64_t block, const double* counts,
                              int scale_bytes, uint8_t* scales_out, uint8_t* bits_out,
                              int64_t out_stride) {
  try {
    auto& q = *static_cast<sycl::queue*>(queue);
    if (block <= 0 || block % 8 || n % block || (scale_bytes != 4 && scale_bytes != 2) ||
        rows < 0 || (rows > 1 && (in_stride < n || in_stride % block)))
      return 1;
    if (n == 0 || rows == 0) return 0;
    const int64_t per_row = n / block;
    q.parallel_for(sycl::range<1>(size_t(rows * per_row)), [=](sycl::id<1> id) {
      const int64_t r = int64_t(id[0]) / per_row, k = int64_t(id[0]) % per_row;
      const int64_t start = r * in_stride;
      const int64_t real = n_buf - start < n ? n_buf - start : n;
      const float* row_buf = real > 0 ? buf + start : buf;
      float* row_err = err + start;
      const double sum = block_sumsq_in_order(row_buf, real > 0 ? real : 0, row_err, k * block,
                                              (k + 1) * block);
      const float s = store_scale(float(sycl::sqrt(sum / counts[start / block + k])), scale_bytes,
                                  scales_out + r * out_stride + k * scale_bytes);
      uint8_t* bits = bits_out + r * out_stride;
      for (int64_t i = k * block; i < (k + 1) * block; i += 8) {
        uint8_t v = 0;
        for (int j = 0; j < 8; ++j) {
          const float x = row_err[i + j];
          const bool one = x >= 0.0f;
          v |= uint8_t(one) << j;
          row_err[i + j] = one ? x - s : x + s;
        }
        bits[i / 8] = v;
      }
    });
    return 0;
  } catch (...) {
    return 1;
  }
}

// One row of compress_rows (ops.compress takes it where it exists).
int onebit_sycl_compress(void* queue, const float* buf, int64_t n_buf, float* err, int64_t n,
                         int64_t block, const double* counts, int scale_bytes,
                         uint8_t* scales_out, uint8_t* bits_out) {
  return onebit_sycl_compress_rows(queue, buf, n_buf, err, n, 1, 0, block, counts, scale_bytes,
                                   scales_out, bits_out, 0);
}

// Each of `rows` rows decoded on its own (no mean), in one launch:
// out[r * out_stride + j] = scales[r, j / block] * sign(row r, bit j), for j
// < cols and r * out_stride + j < total; scales is [rows, ceil(cols / block)].
int onebit_sycl_decode_rows(void* queue, const uint8_t* bits, int64_t row_bytes, int rows,
                            const float* scales, int64_t block, int64_t cols, float* out,
                            int64_t out_stride, int64_t total) {
  try {
    auto& q = *static_cast<sycl::queue*>(queue);
    if (block <= 0 || block % 8 || rows < 0 || out_stride < cols) return 1;
    if (cols == 0 || rows == 0 || total <= 0) return 0;
    const int64_t nblocks = (cols + block - 1) / block;
    q.parallel_for(sycl::range<1>(size_t(rows * cols)), [=](sycl::id<1> id) {
      const int64_t r = int64_t(id[0]) / cols, j = int64_t(id[0]) % cols;
      if (r * out_stride + j < total)
        out[r * out_stride + j] = decode_element(bits + r * row_bytes, row_bytes, 1,
                                                 scales + r * nblocks, nblocks, block, j);
    });
    return 0;
  } catch (...) {
    return 1;
  }
}

}  // extern "C"
