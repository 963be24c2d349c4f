// Sign-bit packing for onebit on NVIDIA GPUs.
//
// Same wire format as every other kernel (docs/design.md): bit = 1 iff x >= 0,
// element 8*i + j is bit j of byte i, a short tail is padded with zero bits,
// unpacking gives +1.0f / -1.0f. A warp ballot turns 32 compares into one
// 32-bit word whose bit j is lane j: on a little-endian GPU that word *is*
// four bytes of the wire format.
//
// Plain extern "C" launchers over raw device pointers and a cudaStream_t, so
// the library builds with nvcc alone (no torch headers) and loads with ctypes.
// Each returns a cudaError_t (0 = success).

#include <cuda_runtime.h>
#include <stdint.h>

#include "../common/onebit_kernels.h"

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;  // pack_error's grid-stride launch

// nonneg, round_bf16 and signed_scale: ../common/onebit_kernels.h, shared
// with the CPU and SYCL kernels.
using namespace onebit_wire;

int blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

// A grid with a thread for each unit of work (a byte of output, or an octet
// per onebit block), up to 2^20 blocks: no grid-stride loop keeps one
// thread's loads in series at any size a buffer has in practice.
constexpr int64_t kMaxGrid = int64_t(1) << 20;

int grid_for(int64_t threads) {
  int64_t b = (threads + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > kMaxGrid ? kMaxGrid : b));
}

// The eight elements of output byte q, loaded as 16-byte vectors where the
// input is aligned and the byte is whole (the caller says which).
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ x, int64_t q, int64_t n, bool vec,
                                      T (&v)[8]) {
  const int64_t j0 = q * 8;
  if (vec && j0 + 8 <= n) {
    constexpr int kVectors = int(sizeof(T) * 8 / 16);
    const uint4* src = reinterpret_cast<const uint4*>(x + j0);
    uint4 raw[kVectors];
#pragma unroll
    for (int t = 0; t < kVectors; ++t) raw[t] = src[t];
    const T* e = reinterpret_cast<const T*>(raw);
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = e[t];
  } else {
#pragma unroll
    for (int t = 0; t < 8; ++t) v[t] = j0 + t < n ? x[j0 + t] : T{};
  }
}

// One thread per output byte: eight consecutive elements in, one byte out,
// so a warp reads 32 whole 8-element runs and writes 32 consecutive bytes.
template <typename T>
__global__ void pack_kernel(const T* __restrict__ x, int64_t n, bool vec,
                            uint8_t* __restrict__ out) {
  const int64_t nbytes = (n + 7) / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < nbytes; q += stride) {
    T v[8];
    load8(x, q, n, vec, v);
    uint32_t byte = 0;
#pragma unroll
    for (int t = 0; t < 8; ++t) byte |= uint32_t(q * 8 + t < n && nonneg(v[t])) << t;
    out[q] = uint8_t(byte);
  }
}

// out[j] = (1/rows) * sum_r (bit(r, j) ? s : -s), s = scales[r, j / block], j < cols.
// Three kernels, each the faster on an H200 for its row counts (same bits:
// each element sums its rows in turn from 0, as every kernel does).
//
// Up to 3 rows (the decode of each chunk, one row; small groups): one
// thread per four elements (half a byte of each row): they share one
// scale per row (block is a multiple of 8), and they go out as one 16-byte
// store where `out` allows, a warp's store covering 512 contiguous bytes.
// Every row's half byte and scale is loaded before any sum (kMaxRows, the
// most rows, unrolls the loads, so they are all in flight at once), and
// the block index is a shift where block / 4 is a power of two
// (`quad_shift`; else -1: a division). On an H200 at 2^28 elements that
// took one row from 63% to 73% of the copy bandwidth and two from 51% to
// 68% (a 32-bit division in place of the 64-bit one had measured slower).
//
// With kEachRow (decode_rows: every rank's decode of the all-gathered
// chunks, one launch), row blockIdx.y is decoded on its own, as one row,
// into out + y * out_stride, up to element `total` of out: `rows` is then
// 1 and `cols` each row's columns.
template <int kMaxRows, bool kEachRow>
__global__ void decode_quads_kernel(const uint8_t* __restrict__ bits, int64_t row_bytes,
                                    int rows, const float* __restrict__ scales, int64_t block,
                                    int quad_shift, int64_t cols, bool vec,
                                    float* __restrict__ out, int64_t out_stride, int64_t total) {
  const float inv = 1.0f / float(rows);
  const int64_t nblocks = (cols + block - 1) / block;
  if (kEachRow) {
    const int64_t y = blockIdx.y;
    bits += y * row_bytes;
    scales += y * nblocks;
    out += y * out_stride;
    if (total - y * out_stride < cols) cols = total - y * out_stride;  // the last rows, cut short
  }
  const int64_t quads = cols > 0 ? (cols + 3) / 4 : 0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < quads; q += stride) {
    const int64_t j0 = q * 4, byte = q / 2;
    const int64_t k = quad_shift >= 0 ? (q >> quad_shift) : j0 / block;
    const int shift = int(q & 1) * 4;
    uint32_t nibble[kMaxRows];
    float s[kMaxRows];
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) {
        nibble[r] = uint32_t(bits[r * row_bytes + byte]) >> shift;
        s[r] = scales[r * nblocks + k];
      }
    }
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int r = 0; r < kMaxRows; ++r) {
      if (r < rows) {
#pragma unroll
        for (int t = 0; t < 4; ++t) acc[t] += signed_scale(nibble[r], t, s[r]);
      }
    }
    if (vec && j0 + 4 <= cols) {
      *reinterpret_cast<float4*>(out + j0) =
          make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
    } else {
#pragma unroll
      for (int t = 0; t < 4; ++t)
        if (j0 + t < cols) out[j0 + t] = acc[t] * inv;
    }
  }
}

// Eight sums from output element j0 on, times 1/rows: two 16-byte stores
// where `out` is aligned and the eight are whole, else one by one up to cols.
__device__ __forceinline__ void store_mean8(float* __restrict__ out, int64_t j0, int64_t cols,
                                            bool vec, const float (&acc)[8], float inv) {
  if (vec && j0 + 8 <= cols) {
    float4* dst = reinterpret_cast<float4*>(out + j0);
    dst[0] = make_float4(acc[0] * inv, acc[1] * inv, acc[2] * inv, acc[3] * inv);
    dst[1] = make_float4(acc[4] * inv, acc[5] * inv, acc[6] * inv, acc[7] * inv);
  } else {
#pragma unroll
    for (int t = 0; t < 8; ++t)
      if (j0 + t < cols) out[j0 + t] = acc[t] * inv;
  }
}

// From 4 to 15 rows (a server's decode of p rows): one thread per byte of a row,
// its eight elements going out as two 16-byte stores: 45% at 8 rows and 27%
// at 32, where the four-element kernel reached 29% and 15% (it reads every
// row's byte twice as often).
__global__ void decode_bytes_kernel(const uint8_t* __restrict__ bits, int64_t row_bytes,
                                    int rows, const float* __restrict__ scales, int64_t block,
                                    int64_t cols, bool vec, float* __restrict__ out) {
  const float inv = 1.0f / float(rows);
  const int64_t nblocks = (cols + block - 1) / block;
  const int64_t nbytes = (cols + 7) / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t q = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; q < nbytes; q += stride) {
    const int64_t j0 = q * 8, k = j0 / block;
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    // (Unrolling this loop by 8 measured slower on an H200: 33% and 17% at
    // 8 and 32 rows.)
    for (int r = 0; r < rows; ++r) {
      const uint32_t byte = bits[r * row_bytes + q];
      const float s = scales[r * nblocks + k];
#pragma unroll
      for (int t = 0; t < 8; ++t) acc[t] += signed_scale(byte, t, s);
    }
    store_mean8(out, j0, cols, vec, acc, inv);
  }
}

// From 16 rows (a server's decode at 16 ranks and more), in tiles: a thread
// block owns 2048 columns, 256 bytes of each row. It first stages those
// bytes of up to kDecodeRowsPerPass rows in shared memory, with 16-byte
// loads where the rows allow, and (for blocks of at least 64) the rows'
// scales for the tile, so that every global load of a pass is in flight
// before any is needed; the kernels above load one byte and one scale per
// row in turn. Then thread t sums byte t's eight elements over the rows,
// from row 0 in turn as every kernel does (the same bits). On an H200,
// 2^28 bits in all: 31% of the copy bandwidth at 32 rows (27% for the
// bytes kernel) and 25% at 64 (21%); slower than the kernels above below
// 16 rows (39% against 63% at one row, 45% against 45% at 8).
// Held to 32 registers (8 blocks of 256 threads per SM; a few bytes
// spill): unbounded it took about 70 and measured slower at every row count.
constexpr int kDecodeBytes = kThreads;              // bytes of each row per tile
constexpr int64_t kDecodeCols = 8 * kDecodeBytes;   // columns per tile
constexpr int kDecodeRowsPerPass = 32;              // 8 KB of bits in shared memory
constexpr int64_t kDecodeStagedBlock = 64;          // from here the tile's scales are staged
constexpr int kDecodeSpan = int(kDecodeCols / kDecodeStagedBlock) + 1;  // blocks a tile touches
constexpr int kDecodeTiledRows = 16;

template <bool kStagedScales>
__global__ void __launch_bounds__(kThreads, 8)
decode_tiled_kernel(const uint8_t* __restrict__ bits, int64_t row_bytes, int rows,
                    const float* __restrict__ scales, int64_t block, int64_t cols, bool vec_in,
                    bool vec_out, float* __restrict__ out) {
  __shared__ __align__(16) uint8_t tile[kDecodeRowsPerPass][kDecodeBytes];
  __shared__ float staged[kStagedScales ? kDecodeRowsPerPass : 1][kStagedScales ? kDecodeSpan : 1];
  const int t = threadIdx.x;
  const float inv = 1.0f / float(rows);
  const int64_t nblocks = (cols + block - 1) / block;
  const int64_t nbytes = (cols + 7) / 8;
  const int64_t byte0 = int64_t(blockIdx.x) * kDecodeBytes;
  const int live = int(nbytes - byte0 < kDecodeBytes ? nbytes - byte0 : kDecodeBytes);
  // The launcher keeps nbytes below 2^32: 32-bit divisions, once per thread.
  const uint32_t block_bytes = uint32_t(block / 8);
  const int64_t k0 = uint32_t(byte0) / block_bytes;      // the tile's first block
  const int64_t k = uint32_t(byte0 + t) / block_bytes;   // this thread's block
  const int span = int((uint32_t(byte0 + live - 1) / block_bytes) - k0) + 1;
  float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  for (int r0 = 0; r0 < rows; r0 += kDecodeRowsPerPass) {
    const int nr = rows - r0 < kDecodeRowsPerPass ? rows - r0 : kDecodeRowsPerPass;
    const uint8_t* src = bits + int64_t(r0) * row_bytes + byte0;
    if (vec_in && live == kDecodeBytes) {
      constexpr int kPerRow = kDecodeBytes / 16;
#pragma unroll 4
      for (int i = t; i < nr * kPerRow; i += kThreads) {
        const int r = i / kPerRow, part = i % kPerRow;
        reinterpret_cast<uint4*>(tile[r])[part] =
            reinterpret_cast<const uint4*>(src + int64_t(r) * row_bytes)[part];
      }
    } else {
#pragma unroll 8
      for (int r = 0; r < nr; ++r)
        if (t < live) tile[r][t] = src[int64_t(r) * row_bytes + t];
    }
    if (kStagedScales) {
      for (int i = t; i < nr * span; i += kThreads) {
        const int r = i / span, c = i % span;
        staged[r][c] = scales[int64_t(r0 + r) * nblocks + k0 + c];
      }
    }
    __syncthreads();
#pragma unroll 1
    for (int r = 0; r < nr; ++r) {
      const uint32_t byte = tile[r][t];
      const float s = kStagedScales ? staged[r][k - k0] : scales[int64_t(r0 + r) * nblocks + k];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += signed_scale(byte, e, s);
    }
    __syncthreads();  // the next pass overwrites the tile
  }
  if (t >= live) return;
  store_mean8(out, (byte0 + t) * 8, cols, vec_out, acc, inv);
}

// A block's sum of squares in the order every kernel uses (the CPU kernel's
// block_sumsq_portable): eight partial sums, partial j over elements j,
// j + 8, ... in turn, then ((s0 + s4) + (s1 + s5)) + ((s2 + s6) + (s3 + s7)).
// Here an octet (8 lanes) owns a block and lane j of it holds partial j;
// these shuffles combine the partials in that order, leaving the sum in the
// octet's first lane, from which every lane of the octet takes it. All 32
// lanes must call it.
__device__ __forceinline__ double octet_sum(double part) {
  const unsigned all = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  double pairs = part + __shfl_down_sync(all, part, 4);    // lane j < 4: s_j + s_(j+4)
  double quads = pairs + __shfl_down_sync(all, pairs, 1);  // lanes 0, 2: the two halves
  double total = quads + __shfl_down_sync(all, quads, 2);  // lane 0: the sum
  return __shfl_sync(all, total, lane & ~7);
}

// Pass 1: err <- buf (zero past n_buf) + err, and the sum of squares of each
// onebit block, in double, in the one order (octet_sum). A warp serves four
// blocks, one per octet; a lane reads every eighth element of its block, so
// each load instruction reads four whole 32-byte sectors. Up to kHeld
// elements per lane, all of a lane's loads are issued before the first is
// used (the loop is unrolled into registers).
template <int kHeld>
__global__ void compensate_kernel(const float* __restrict__ buf, int64_t n_buf,
                                  float* __restrict__ err, int64_t n, int64_t block,
                                  double* __restrict__ sumsq) {
  const int lane = threadIdx.x & 31, part_of = lane & 7;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = n / block, per_lane = block / 8;
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w * 4 < nblocks;
       w += warps) {
    const int64_t k = w * 4 + lane / 8;
    const bool live = k < nblocks;
    const int64_t first = k * block + part_of;
    double part = 0.0;
    if (kHeld > 0) {
      float held[kHeld > 0 ? kHeld : 1];
#pragma unroll
      for (int i = 0; i < (kHeld > 0 ? kHeld : 1); ++i) {
        const int64_t e = first + 8 * int64_t(i);
        if (live && i < per_lane) held[i] = (e < n_buf ? buf[e] : 0.0f) + err[e];
      }
#pragma unroll
      for (int i = 0; i < (kHeld > 0 ? kHeld : 1); ++i) {
        if (live && i < per_lane) {
          err[first + 8 * int64_t(i)] = held[i];
          part += double(held[i]) * double(held[i]);
        }
      }
    } else if (live) {
      for (int64_t e = first; e < (k + 1) * block; e += 8) {
        float x = (e < n_buf ? buf[e] : 0.0f) + err[e];
        err[e] = x;
        part += double(x) * double(x);
      }
    }
    double sum = octet_sum(part);
    if (live && part_of == 0) sumsq[k] = sum;
  }
}

// Lanes 0..3 of each warp store the four bytes of a ballot word, skipping
// bytes past the end so a tail never writes out of bounds.
__device__ __forceinline__ void store_word(uint32_t word, int64_t base, int64_t nbytes,
                                           uint8_t* out) {
  int lane = threadIdx.x & 31;
  if (lane < 4) {
    int64_t byte = base / 8 + lane;
    if (byte < nbytes) out[byte] = uint8_t(word >> (8 * lane));
  }
}

// Pass 2: pack sign(x) with a ballot and leave err = x - s * sign(x), s the
// scale of x's block. A thread per element on a grid of at most 1024
// blocks: 61% of the copy bandwidth on an H200, where a byte per thread
// (eight scalar loads each) reached 31%. compress does both passes in one.
__global__ void pack_error_kernel(float* __restrict__ err, int64_t n,
                                  const float* __restrict__ scales, int64_t block,
                                  uint8_t* __restrict__ out) {
  const int64_t nbytes = (n + 7) / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i - (threadIdx.x & 31) < n;
       i += stride) {
    bool bit = false;
    if (i < n) {
      float x = err[i], s = scales[i / block];
      bit = x >= 0.0f;
      err[i] = bit ? x - s : x + s;
    }
    uint32_t word = __ballot_sync(0xffffffffu, bit);
    store_word(word, i - (threadIdx.x & 31), nbytes, out);
  }
}

// One element of compress_kernel's output where blocks are too long for
// registers: its sign into the block's byte (written by the octet's first
// lane) and err = x - s * sign(x).
__device__ __forceinline__ void sign_out(bool live, float x, float s, int64_t e,
                                         float* __restrict__ err, uint8_t* __restrict__ bits,
                                         int64_t byte) {
  const bool one = live && x >= 0.0f;
  const uint32_t word = __ballot_sync(0xffffffffu, one);
  if (live) {
    err[e] = one ? x - s : x + s;
    if ((threadIdx.x & 7) == 0) bits[byte] = uint8_t(word >> (8 * ((threadIdx.x & 31) / 8)));
  }
}

// The pointers and buf's real count moved to row blockIdx.y of a compress
// over several rows (compress_rows: the worker's row for each rank, one
// launch): its input starts in_stride elements on per row (buf holds n_buf
// real elements from the first row's start, zero after), its scales and
// bits out_stride bytes on. Rows are whole blocks apart, so every block's
// maths is that of a launch of its own.
__device__ __forceinline__ void to_compress_row(const float* __restrict__& buf, int64_t& n_buf,
                                                float* __restrict__& err,
                                                const double* __restrict__& counts,
                                                uint8_t* __restrict__& scales,
                                                uint8_t* __restrict__& bits, int64_t n,
                                                int64_t block, int64_t in_stride,
                                                int64_t out_stride) {
  const int64_t r = blockIdx.y, start = r * in_stride;
  const int64_t real = n_buf - start < n ? n_buf - start : n;
  if (real > 0) buf += start;
  n_buf = real > 0 ? real : 0;
  err += start;
  counts += start / block;
  scales += r * out_stride;
  bits += r * out_stride;
}

// compensate, each block's scale and pack_error in one pass over memory.
// An octet owns a block, as in compensate_kernel; with at most kHeld
// elements per lane (blocks of up to 8 * kHeld) x stays in registers
// between the sum and the packing, else it is recomputed from buf and err,
// which the octet has just read (so from cache). The scale is the CPU
// kernel's: sqrt(sum / count) in double, rounded to fp32 and, for 2-byte
// scales, to bf16, written little-endian; the error uses the rounded value.
template <int kHeld>
__global__ void compress_kernel(const float* __restrict__ buf, int64_t n_buf,
                                float* __restrict__ err, int64_t n, int64_t block,
                                const double* __restrict__ counts, int scale_bytes,
                                uint8_t* __restrict__ scales, uint8_t* __restrict__ bits,
                                int64_t in_stride, int64_t out_stride) {
  to_compress_row(buf, n_buf, err, counts, scales, bits, n, block, in_stride, out_stride);
  const int lane = threadIdx.x & 31, part_of = lane & 7, octet = lane / 8;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = n / block, per_lane = block / 8;
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; w * 4 < nblocks;
       w += warps) {
    const int64_t k = w * 4 + octet;
    const bool live = k < nblocks;
    const int64_t first = k * block + part_of;  // this lane's elements: first + 8 i
    float held[kHeld > 0 ? kHeld : 1];
    double part = 0.0;
    if (kHeld > 0) {
#pragma unroll
      for (int i = 0; i < (kHeld > 0 ? kHeld : 1); ++i) {
        if (live && i < per_lane) {
          const int64_t e = first + 8 * int64_t(i);
          held[i] = (e < n_buf ? buf[e] : 0.0f) + err[e];
          part += double(held[i]) * double(held[i]);
        }
      }
    } else if (live) {
      for (int64_t e = first; e < (k + 1) * block; e += 8) {
        float x = (e < n_buf ? buf[e] : 0.0f) + err[e];
        part += double(x) * double(x);
      }
    }
    const double sum = octet_sum(part);
    float s = 0.0f;
    if (live) {
      s = float(sqrt(sum / counts[k]));
      uint8_t raw[4];
      if (scale_bytes == 2) {
        uint16_t h;
        s = round_bf16(s, &h);
        raw[0] = uint8_t(h), raw[1] = uint8_t(h >> 8);
      } else {
        uint32_t u = __float_as_uint(s);
        for (int t = 0; t < 4; ++t) raw[t] = uint8_t(u >> (8 * t));
      }
      if (part_of < scale_bytes) scales[k * scale_bytes + part_of] = raw[part_of];
    }
    // Byte i of the block is element 8 i + j in lane j of the octet: the
    // ballot's byte `octet` holds it. per_lane is the same in every lane, so
    // the whole warp takes each ballot.
    if (kHeld > 0) {
      // Lane j of the octet keeps bytes 4 j .. 4 j + 3 of the block (the
      // ballot gives every lane every byte) and stores them as one word:
      // a warp's store then covers whole sectors, not 128 single bytes.
      uint32_t mine = 0;
#pragma unroll
      for (int i = 0; i < (kHeld > 0 ? kHeld : 1); ++i) {
        if (i < per_lane) {
          const float x = held[i];
          const bool one = live && x >= 0.0f;
          const uint32_t byte = (__ballot_sync(0xffffffffu, one) >> (8 * octet)) & 0xffu;
          if (live) err[first + 8 * int64_t(i)] = one ? x - s : x + s;
          if (i / 4 == part_of) mine |= byte << (8 * (i % 4));
        }
      }
      const int64_t at = k * per_lane + 4 * int64_t(part_of);  // this lane's first byte
      if (live && 4 * int64_t(part_of) < per_lane) {
        if (4 * int64_t(part_of) + 4 <= per_lane && reinterpret_cast<uintptr_t>(bits + at) % 4 == 0) {
          *reinterpret_cast<uint32_t*>(bits + at) = mine;
        } else {
          for (int t = 0; t < 4 && 4 * int64_t(part_of) + t < per_lane; ++t)
            bits[at + t] = uint8_t(mine >> (8 * t));
        }
      }
    } else {
      for (int64_t i = 0; i < per_lane; ++i) {
        const int64_t e = first + 8 * i;
        const float x = live ? (e < n_buf ? buf[e] : 0.0f) + err[e] : 0.0f;
        sign_out(live, x, s, e, err, bits, k * per_lane + i);
      }
    }
  }
}

// compress_tiled_kernel: what compress runs for power-of-two blocks on
// 16-byte-aligned buffers (the default layout), with 16-byte loads and
// stores. A thread block owns a tile of kTile elements: it reads x = buf +
// err with coalesced float4 loads into shared memory, then each octet sums
// a block's squares from there in the one order (lane j: elements j, j +
// 8, ... in turn, then octet_sum), then every thread writes its err = x -/+
// s as float4 and its signs. On an H200 at 2^28 elements: 96% of the copy
// bandwidth, where compress_kernel (4 bytes per lane, in 32-byte runs 1 KB
// apart) reached 49%; it stays for other blocks and unaligned buffers.
constexpr int kTile = 8192;               // elements per thread block: 32 per thread
constexpr int kPadEvery = 256, kPad = 8;  // 8 floats after every 256: an octet per bank run

__device__ __forceinline__ int padded(int e) { return e + (e / kPadEvery) * kPad; }

__global__ void compress_tiled_kernel(const float* __restrict__ buf, int64_t n_buf,
                                      float* __restrict__ err, int64_t n, int block,
                                      const double* __restrict__ counts, int scale_bytes,
                                      uint8_t* __restrict__ scales, uint8_t* __restrict__ bits,
                                      int64_t in_stride, int64_t out_stride) {
  to_compress_row(buf, n_buf, err, counts, scales, bits, n, block, in_stride, out_stride);
  __shared__ __align__(16) float xs[kTile + kTile / kPadEvery * kPad];
  __shared__ float ss[kTile / 8];  // the scale of each of the tile's blocks
  const int64_t tile0 = int64_t(blockIdx.x) * kTile;
  const int len = int(n - tile0 < kTile ? n - tile0 : kTile);  // a multiple of block
  const int tid = threadIdx.x;
  constexpr int kRounds = kTile / (4 * kThreads);
#pragma unroll
  for (int m = 0; m < kRounds; ++m) {  // x = buf + err, as the other kernels add them
    const int e = 4 * (tid + m * kThreads);
    if (e < len) {
      const int64_t g = tile0 + e;
      const float4 r = *reinterpret_cast<const float4*>(err + g);
      float4 b;
      if (g + 4 <= n_buf) {
        b = *reinterpret_cast<const float4*>(buf + g);
      } else {
        b.x = g < n_buf ? buf[g] : 0.0f;
        b.y = g + 1 < n_buf ? buf[g + 1] : 0.0f;
        b.z = g + 2 < n_buf ? buf[g + 2] : 0.0f;
        b.w = g + 3 < n_buf ? buf[g + 3] : 0.0f;
      }
      *reinterpret_cast<float4*>(xs + padded(e)) =
          make_float4(b.x + r.x, b.y + r.y, b.z + r.z, b.w + r.w);
    }
  }
  __syncthreads();
  const int lane8 = tid & 7, per_lane = block / 8, tile_blocks = len / block;
  const int64_t k0 = tile0 / block;
  for (int kb0 = 0; kb0 < kTile / block; kb0 += kThreads / 8) {  // the same trip count in every lane
    const int kb = kb0 + tid / 8;
    const bool live = kb < tile_blocks;
    double part = 0.0;
    if (live) {
      for (int i = 0; i < per_lane; ++i) {
        const float v = xs[padded(kb * block + lane8 + 8 * i)];
        part += double(v) * double(v);
      }
    }
    const double sum = octet_sum(part);
    if (live && lane8 == 0) {
      ss[kb] = store_scale(float(sqrt(sum / counts[k0 + kb])), scale_bytes,
                           scales + (k0 + kb) * scale_bytes);
    }
  }
  __syncthreads();
#pragma unroll
  for (int m = 0; m < kRounds; ++m) {  // err = x -/+ s and the signs, four elements a thread
    const int e = 4 * (tid + m * kThreads);
    uint32_t nibble = 0;
    if (e < len) {
      const float4 x = *reinterpret_cast<const float4*>(xs + padded(e));
      const float s = ss[e / block];
      const float v[4] = {x.x, x.y, x.z, x.w};
      float o[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const bool one = v[t] >= 0.0f;
        o[t] = one ? v[t] - s : v[t] + s;
        nibble |= uint32_t(one) << t;
      }
      *reinterpret_cast<float4*>(err + tile0 + e) = make_float4(o[0], o[1], o[2], o[3]);
    }
    // Output byte e / 8 is this (even) lane's nibble and the next lane's.
    const uint32_t high = __shfl_down_sync(0xffffffffu, nibble, 1);
    if (e < len && (tid & 1) == 0) bits[(tile0 + e) / 8] = uint8_t(nibble | (high << 4));
  }
}

// The optimizer's non-finite check (agreement.py) over a list of
// fp32 tensors in one launch: flag <- 1 where some element's square
// overflows fp32 (NaN, +-inf, or |x| beyond sqrt(FLT_MAX) ~ 1.8e19, whose
// square an Adam variance could not hold). torch's _foreach_norm did the
// same job with per-tensor outputs and a stack: 4.3 ms of host time a step
// at 2000 tensors on an H200, where this is one launch.
// Tensor t (a device pointer in ptrs[t], sizes[t] elements) owns chunks
// first_chunk[t] .. first_chunk[t + 1] - 1 of `chunk` elements each (the
// caller's split, a multiple of 4); a thread block takes a chunk and finds
// its tensor by bisection.

__device__ __forceinline__ bool square_overflows(float v) {
  return !(v * v < INFINITY);  // (a NaN compares false: counted)
}

// The tensor that owns chunk c: the last whose first chunk is at or before
// c (an empty tensor owns no chunk: the next one, with the same first
// chunk, is found instead).
__device__ __forceinline__ int64_t owner_of(const int64_t* __restrict__ first_chunk,
                                            int64_t count, int64_t c) {
  int64_t lo = 0, hi = count - 1;
  while (lo < hi) {
    const int64_t mid = (lo + hi + 1) / 2;
    if (first_chunk[mid] <= c) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void nonfinite_kernel(const int64_t* __restrict__ ptrs,
                                 const int64_t* __restrict__ sizes,
                                 const int64_t* __restrict__ first_chunk, int64_t count,
                                 int64_t chunks, int64_t chunk, int64_t* __restrict__ flag) {
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t lo = owner_of(first_chunk, count, c);
    const float* x = reinterpret_cast<const float*>(ptrs[lo]);
    const int64_t begin = (c - first_chunk[lo]) * chunk;
    const int64_t end = begin + chunk < sizes[lo] ? begin + chunk : sizes[lo];
    bool bad = false;
    int64_t tail = begin;
    if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {  // (begin is a multiple of 4)
      const int64_t quads = (end - begin) / 4;
      const float4* v4 = reinterpret_cast<const float4*>(x + begin);
#pragma unroll 4
      for (int64_t i = threadIdx.x; i < quads; i += blockDim.x) {
        const float4 v = v4[i];
        bad |= square_overflows(v.x) | square_overflows(v.y) | square_overflows(v.z) |
               square_overflows(v.w);
      }
      tail = begin + 4 * quads;
    }
    for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x) bad |= square_overflows(x[i]);
    if (__syncthreads_or(bad) && threadIdx.x == 0) *flag = 1;  // every writer writes 1
  }
}

// Each tensor's 2-norm over a list of fp32 tensors (LAMB's trust ratios
// and gradient clipping, optim/functional.py), on the table the non-finite
// check uses. torch's _foreach_norm allocates an output per tensor and needs
// a stack after it: about 3 ms of host time for 2000 tensors on an H200.
// Pass 1: each thread block sums the squares of its chunk in float64, every
// thread over a fixed stride, then a fixed tree (shuffles, then the warps'
// sums in order): the same bits at every launch, whatever ran before.
__device__ __forceinline__ double warp_sum(double s) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) s += __shfl_down_sync(0xffffffffu, s, offset);
  return s;
}

// torch's lerp (ATen's Lerp.h), with the multiply-adds fused as nvcc fuses
// them in torch's build (this file builds with -fmad=false).
__device__ __forceinline__ float torch_lerp(float self, float end, float w) {
  const float diff = end - self;
  return fabsf(w) < 0.5f ? __fmaf_rn(w, diff, self) : __fmaf_rn(-diff, 1.0f - w, end);
}

__global__ void sumsq_chunks_kernel(const int64_t* __restrict__ ptrs,
                                    const int64_t* __restrict__ sizes,
                                    const int64_t* __restrict__ first_chunk, int64_t count,
                                    int64_t chunks, int64_t chunk, double* __restrict__ partial) {
  __shared__ double warps[kThreads / 32];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    const int64_t t = owner_of(first_chunk, count, c);
    const float* x = reinterpret_cast<const float*>(ptrs[t]);
    const int64_t begin = (c - first_chunk[t]) * chunk;
    const int64_t end = begin + chunk < sizes[t] ? begin + chunk : sizes[t];
    double s = 0.0;
    int64_t tail = begin;
    if (reinterpret_cast<uintptr_t>(x) % 16 == 0) {  // (begin is a multiple of 4)
      const int64_t quads = (end - begin) / 4;
      const float4* v4 = reinterpret_cast<const float4*>(x + begin);
#pragma unroll 4
      for (int64_t i = threadIdx.x; i < quads; i += blockDim.x) {
        const float4 v = v4[i];
        s += double(v.x) * v.x + double(v.y) * v.y + double(v.z) * v.z + double(v.w) * v.w;
      }
      tail = begin + 4 * quads;
    }
    for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x) s += double(x[i]) * x[i];
    s = warp_sum(s);
    if (threadIdx.x % 32 == 0) warps[threadIdx.x / 32] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      double total = 0.0;
      for (int w = 0; w < kThreads / 32; ++w) total += warps[w];
      partial[c] = total;
    }
    __syncthreads();  // (warps[] is written again for the next chunk)
  }
}

// Pass 2: a warp per tensor adds its chunks' sums (lane l takes chunks l,
// l + 32, ..., then the same tree), and writes the root in fp32. A tensor
// with no chunk (empty) gets 0.
__global__ void sumsq_finish_kernel(const int64_t* __restrict__ first_chunk, int64_t count,
                                    const double* __restrict__ partial, float* __restrict__ norms) {
  const int64_t t = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (t >= count) return;  // (a whole warp leaves together: t is the warp's)
  double s = 0.0;
  for (int64_t c = first_chunk[t] + lane; c < first_chunk[t + 1]; c += 32) s += partial[c];
  s = warp_sum(s);
  if (lane == 0) norms[t] = float(sqrt(s));
}

// Elements begin .. end - 1 of kLists lists (a chunk of the table), each
// thread calling op(x) with x[l] the element of list l, and storing back
// the lists of bitmask kWritten. Lists of bitmask kRead are loaded (x[l]
// of another list is 0). Four elements at a time as 16-byte vectors where
// every list is aligned (begin is a multiple of 4): scalar loads kept too
// few bytes in flight, and 0/1 Adam's pass measured slower than torch's
// three vectorised ones on an H200.
template <int kLists, unsigned kRead, unsigned kWritten, typename Op>
__device__ __forceinline__ void each_element(float* const (&ptr)[kLists], int64_t begin,
                                             int64_t end, Op op) {
  bool vec = true;
#pragma unroll
  for (int l = 0; l < kLists; ++l) vec &= reinterpret_cast<uintptr_t>(ptr[l]) % 16 == 0;
  int64_t tail = begin;
  if (vec) {
    const int64_t quads = (end - begin) / 4;
#pragma unroll 2
    for (int64_t q = threadIdx.x; q < quads; q += blockDim.x) {
      const int64_t i = begin + 4 * q;
      float4 v[kLists];
#pragma unroll
      for (int l = 0; l < kLists; ++l)
        v[l] = (kRead >> l) & 1 ? *reinterpret_cast<const float4*>(ptr[l] + i)
                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        float x[kLists];
#pragma unroll
        for (int l = 0; l < kLists; ++l) x[l] = (&v[l].x)[k];
        op(x);
#pragma unroll
        for (int l = 0; l < kLists; ++l) (&v[l].x)[k] = x[l];
      }
#pragma unroll
      for (int l = 0; l < kLists; ++l)
        if ((kWritten >> l) & 1) *reinterpret_cast<float4*>(ptr[l] + i) = v[l];
    }
    tail = begin + 4 * quads;
  }
  for (int64_t i = tail + threadIdx.x; i < end; i += blockDim.x) {
    float x[kLists];
#pragma unroll
    for (int l = 0; l < kLists; ++l) x[l] = (kRead >> l) & 1 ? ptr[l][i] : 0.0f;
    op(x);
#pragma unroll
    for (int l = 0; l < kLists; ++l)
      if ((kWritten >> l) & 1) ptr[l][i] = x[l];
  }
}

// Chunk c's tensor, its kLists pointers from the table (list l's pointers
// at table[l * count ..]), and the chunk's bounds in it.
template <int kLists>
__device__ __forceinline__ void chunk_of(const int64_t* __restrict__ table, int64_t count,
                                         int64_t c, int64_t chunk, float* (&ptr)[kLists],
                                         int64_t& begin, int64_t& end) {
  const int64_t* sizes = table + kLists * count;
  const int64_t* first_chunk = sizes + count;
  const int64_t t = owner_of(first_chunk, count, c);
#pragma unroll
  for (int l = 0; l < kLists; ++l) ptr[l] = reinterpret_cast<float*>(table[l * count + t]);
  begin = (c - first_chunk[t]) * chunk;
  end = begin + chunk < sizes[t] ? begin + chunk : sizes[t];
}

// 1-bit LAMB's trust-ratio pass (trust_ratio="fresh", optim/lamb.py) in
// one read of its four lists p, m, s, d: s <- lerp(s, m, w) (the running
// average of the averaged momentum, written back), u = s / d + wd * p (the
// ratio's update, never stored), and each chunk's float64 sums of p^2 and
// u^2 for sumsq_finish_kernel. torch's way was a lerp, a divide into a
// buffer, an add and two norms: eight passes over memory where this makes
// five.
__global__ void lamb_ratio_chunks_kernel(const int64_t* __restrict__ table, int64_t count,
                                         int64_t chunks, int64_t chunk, float w, float wd,
                                         double* __restrict__ partial_p,
                                         double* __restrict__ partial_u) {
  __shared__ double warps_p[kThreads / 32], warps_u[kThreads / 32];
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float* ptr[4];
    int64_t begin, end;
    chunk_of<4>(table, count, c, chunk, ptr, begin, end);
    double sp = 0.0, su = 0.0;
    each_element<4, 0xfu, 0x4u>(ptr, begin, end, [&](float (&x)[4]) {
      const float pv = x[0], s = torch_lerp(x[2], x[1], w);
      x[2] = s;
      const float u = wd != 0.0f ? __fmaf_rn(wd, pv, s / x[3]) : s / x[3];
      sp += double(pv) * pv;
      su += double(u) * u;
    });
    sp = warp_sum(sp);
    su = warp_sum(su);
    if (threadIdx.x % 32 == 0) {
      warps_p[threadIdx.x / 32] = sp;
      warps_u[threadIdx.x / 32] = su;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      double tp = 0.0, tu = 0.0;
      for (int k = 0; k < kThreads / 32; ++k) {
        tp += warps_p[k];
        tu += warps_u[k];
      }
      partial_p[c] = tp;
      partial_u[c] = tu;
    }
    __syncthreads();
  }
}

// 0/1 Adam's local step (optim/zoadam.py, a frozen step that does not
// sync) in one pass over its six lists, p, g, m, d, u and a:
//   m <- lerp(m, g, w);  u <- u + wd_alpha * p;  u <- u + value * m / d;
//   p <- a + u
// each op rounded as torch's foreach ops round it (add with alpha and
// addcdiv as a multiply-add). torch's way was a lerp, an addcdiv and an
// add into p: ten passes over memory where this makes eight (p is read
// only with weight decay, kDecay).
template <bool kDecay>
__global__ void zero_one_local_step_kernel(const int64_t* __restrict__ table, int64_t count,
                                           int64_t chunks, int64_t chunk, float w,
                                           float wd_alpha, float value) {
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float* ptr[6];
    int64_t begin, end;
    chunk_of<6>(table, count, c, chunk, ptr, begin, end);
    constexpr unsigned kRead = kDecay ? 0x3fu : 0x3eu;  // all but p without decay
    each_element<6, kRead, 0x15u>(ptr, begin, end, [&](float (&x)[6]) {  // p, m, u written
      const float mv = torch_lerp(x[2], x[1], w);
      x[2] = mv;
      float uv = x[4];
      if (kDecay) uv = __fmaf_rn(wd_alpha, x[0], uv);
      uv = __fmaf_rn(value, mv / x[3], uv);
      x[4] = uv;
      x[0] = x[5] + uv;
    });
  }
}

// 0/1 Adam's step before the variance freezes (optim/zoadam.py: the
// momentum of the averaged gradient, the update materialised and added)
// in one pass over p, g, m and d:
//   m <- lerp(m, g, w);  u = m / d;  u /= bc1 (kBias);  u += wd * p (kDecay);
//   u *= -lr;  p <- p + u
// each op rounded as torch's foreach ops round it. torch's way was a lerp,
// a divide into a buffer, a scale by lr and an add: eleven passes over
// memory (thirteen with the bias correction, more with decay) where this
// makes six.
template <bool kBias, bool kDecay>
__global__ void zero_one_step_kernel(const int64_t* __restrict__ table, int64_t count,
                                     int64_t chunks, int64_t chunk, float w, float bc1, float wd,
                                     float neg_lr) {
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float* ptr[4];
    int64_t begin, end;
    chunk_of<4>(table, count, c, chunk, ptr, begin, end);
    each_element<4, 0xfu, 0x5u>(ptr, begin, end, [&](float (&x)[4]) {  // p and m written
      const float mv = torch_lerp(x[2], x[1], w);
      x[2] = mv;
      float u = mv / x[3];
      if (kBias) u = u / bc1;
      if (kDecay) u = __fmaf_rn(wd, x[0], u);
      u = u * neg_lr;
      x[0] = x[0] + u;
    });
  }
}

// 0/1 Adam's sync that follows a sync (optim/zoadam.py, sync_single_), in
// two passes around the exchange where torch's ops make four:
// the input, over out, p, m, g, d (out may be m itself):
//   out <- lerp(m, g, w) * neg_inv_bc1;  out += neg_wd * p * d (kDecay)
// (eight passes before, with the lerp and the scale apart), and the landing
// on the average, over p, m, d:  p <- p + lr * m / d;  m <- m * neg_bc1
// (six before). Each op rounded as torch's foreach ops round it.
template <bool kDecay>
__global__ void zero_one_sync_input_kernel(const int64_t* __restrict__ table, int64_t count,
                                           int64_t chunks, int64_t chunk, float w,
                                           float neg_inv_bc1, float neg_wd) {
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float* ptr[5];
    int64_t begin, end;
    chunk_of<5>(table, count, c, chunk, ptr, begin, end);
    constexpr unsigned kRead = kDecay ? 0x1eu : 0x0cu;  // m, g (p, d with decay)
    each_element<5, kRead, 0x1u>(ptr, begin, end, [&](float (&x)[5]) {
      float o = torch_lerp(x[2], x[3], w) * neg_inv_bc1;
      if (kDecay) o = __fmaf_rn(neg_wd, x[1] * x[4], o);
      x[0] = o;
    });
  }
}

__global__ void zero_one_land_kernel(const int64_t* __restrict__ table, int64_t count,
                                     int64_t chunks, int64_t chunk, float lr, float neg_bc1) {
  for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    float* ptr[3];
    int64_t begin, end;
    chunk_of<3>(table, count, c, chunk, ptr, begin, end);
    each_element<3, 0x7u, 0x3u>(ptr, begin, end, [&](float (&x)[3]) {
      x[0] = __fmaf_rn(lr, x[1] / x[2], x[0]);
      x[1] = x[1] * neg_bc1;
    });
  }
}

}  // namespace

extern "C" {

namespace {
bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }
// The grid of a launch over a table's chunks (a multiple of 4 elements each:
// the list kernels read 16-byte vectors from a chunk's start): -1 for bad
// arguments, 0 when there is nothing to do.
int list_grid(int64_t count, int64_t chunks, int64_t chunk) {
  if (count < 0 || chunks < 0 || chunk <= 0 || chunk % 4) return -1;
  if (count == 0 || chunks == 0) return 0;
  return int(chunks < kMaxGrid ? chunks : kMaxGrid);
}
// Warps of four octets each: one octet per onebit block.
int octet_grid(int64_t nblocks) { return grid_for((nblocks + 3) / 4 * 32); }
}  // namespace

// dtype codes match builders/cpu.py: 0 fp32, 1 fp64, 2 fp16, 3 bf16.
int onebit_cuda_pack(int dtype, const void* x, int64_t n, uint8_t* out, cudaStream_t stream) {
  if (n == 0) return 0;
  const int blocks = grid_for((n + 7) / 8);
  const bool vec = aligned16(x);
  switch (dtype) {
    case 0: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(x), n, vec, out); break;
    case 1: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const double*>(x), n, vec, out); break;
    case 2: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const Half*>(x), n, vec, out); break;
    case 3: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const BFloat*>(x), n, vec, out); break;
    default: return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

// decode_quads_kernel's quad_shift: log2(block / 4) where that is a power
// of two, else -1.
int quad_shift_for(int64_t block) {
  const int64_t per_block = block / 4;
  int quad_shift = -1;
  if ((per_block & (per_block - 1)) == 0)
    for (quad_shift = 0; (int64_t(1) << quad_shift) < per_block; ++quad_shift) {}
  return quad_shift;
}

int onebit_cuda_decode(const uint8_t* bits, int64_t row_bytes, int rows, const float* scales,
                       int64_t block, int64_t cols, float* out, cudaStream_t stream) {
  if (cols == 0) return 0;
  if (block <= 0 || block % 8) return int(cudaErrorInvalidValue);
  const int64_t nbytes = (cols + 7) / 8;
  if (rows >= kDecodeTiledRows && nbytes < (int64_t(1) << 32) - kDecodeBytes) {
    const unsigned grid = unsigned((nbytes + kDecodeBytes - 1) / kDecodeBytes);
    const bool vec_in = aligned16(bits) && row_bytes % 16 == 0;
    if ((kDecodeCols + block - 1) / block + 1 <= kDecodeSpan)  // the most blocks a tile touches
      decode_tiled_kernel<true><<<grid, kThreads, 0, stream>>>(
          bits, row_bytes, rows, scales, block, cols, vec_in, aligned16(out), out);
    else
      decode_tiled_kernel<false><<<grid, kThreads, 0, stream>>>(
          bits, row_bytes, rows, scales, block, cols, vec_in, aligned16(out), out);
  } else if (rows < 4) {
    const int quad_shift = quad_shift_for(block);
    if (rows <= 2)
      decode_quads_kernel<2, false><<<grid_for((cols + 3) / 4), kThreads, 0, stream>>>(
          bits, row_bytes, rows, scales, block, quad_shift, cols, aligned16(out), out, 0, cols);
    else
      decode_quads_kernel<4, false><<<grid_for((cols + 3) / 4), kThreads, 0, stream>>>(
          bits, row_bytes, rows, scales, block, quad_shift, cols, aligned16(out), out, 0, cols);
  } else {
    decode_bytes_kernel<<<grid_for((cols + 7) / 8), kThreads, 0, stream>>>(
        bits, row_bytes, rows, scales, block, cols, aligned16(out), out);
  }
  return int(cudaGetLastError());
}

// Each of `rows` rows decoded on its own (no mean), one launch:
// out[r * out_stride + j] = scales[r, j / block] * sign(row r, bit j), for j
// < cols and r * out_stride + j < total; scales is [rows, ceil(cols /
// block)]. Row r's elements get the bits a one-row decode of it gives.
int onebit_cuda_decode_rows(const uint8_t* bits, int64_t row_bytes, int rows, const float* scales,
                            int64_t block, int64_t cols, float* out, int64_t out_stride,
                            int64_t total, cudaStream_t stream) {
  if (block <= 0 || block % 8 || rows < 0 || rows > 65535 || out_stride < cols)
    return int(cudaErrorInvalidValue);
  if (cols == 0 || rows == 0 || total <= 0) return 0;
  // A row's out stays 16-byte aligned where the first is: out_stride % 4.
  const bool vec = aligned16(out) && out_stride % 4 == 0;
  decode_quads_kernel<2, true><<<dim3(unsigned(grid_for((cols + 3) / 4)), unsigned(rows)),
                                 kThreads, 0, stream>>>(bits, row_bytes, 1, scales, block,
                                                        quad_shift_for(block), cols, vec, out,
                                                        out_stride, total);
  return int(cudaGetLastError());
}

// `block` is a multiple of 8 that divides n; sumsq holds n / block doubles.
int onebit_cuda_compensate(const float* buf, int64_t n_buf, float* err, int64_t n, int64_t block,
                           double* sumsq, cudaStream_t stream) {
  if (block <= 0 || block % 8 || n % block) return int(cudaErrorInvalidValue);
  if (n == 0) return 0;
  if (block <= 8 * 32)
    compensate_kernel<32><<<octet_grid(n / block), kThreads, 0, stream>>>(buf, n_buf, err, n,
                                                                          block, sumsq);
  else
    compensate_kernel<0><<<octet_grid(n / block), kThreads, 0, stream>>>(buf, n_buf, err, n,
                                                                         block, sumsq);
  return int(cudaGetLastError());
}

int onebit_cuda_pack_error(float* err, int64_t n, const float* scales, int64_t block,
                           uint8_t* out, cudaStream_t stream) {
  if (block <= 0 || block % 8 || n % block) return int(cudaErrorInvalidValue);
  if (n == 0) return 0;
  pack_error_kernel<<<blocks_for(n), kThreads, 0, stream>>>(err, n, scales, block, out);
  return int(cudaGetLastError());
}

// compensate + scales + pack_error in one launch and one pass (the CPU
// kernel's `compress`), on `rows` rows (blockIdx.y; see compress_row): row
// r reads n elements from buf + r * in_stride (n_buf real from buf on), err
// + r * in_stride and counts + r * in_stride / block, and writes n / block
// scales of scale_bytes (4: fp32, 2: bf16) each and n / 8 bytes of bits at
// r * out_stride bytes past scales_out and bits_out.
int onebit_cuda_compress_rows(const float* buf, int64_t n_buf, float* err, int64_t n, int rows,
                              int64_t in_stride, int64_t block, const double* counts,
                              int scale_bytes, uint8_t* scales_out, uint8_t* bits_out,
                              int64_t out_stride, cudaStream_t stream) {
  if (block <= 0 || block % 8 || n % block || (scale_bytes != 4 && scale_bytes != 2) ||
      rows < 0 || rows > 65535 || (rows > 1 && (in_stride < n || in_stride % block)))
    return int(cudaErrorInvalidValue);
  if (n == 0 || rows == 0) return 0;
  const bool tiled = block <= kTile && (block & (block - 1)) == 0 && aligned16(buf) &&
                     aligned16(err) && (rows == 1 || in_stride % 4 == 0) &&
                     (n + kTile - 1) / kTile <= int64_t(0x7fffffff);
  if (tiled) {
    compress_tiled_kernel<<<dim3(unsigned((n + kTile - 1) / kTile), unsigned(rows)), kThreads, 0,
                            stream>>>(buf, n_buf, err, n, int(block), counts, scale_bytes,
                                      scales_out, bits_out, in_stride, out_stride);
    return int(cudaGetLastError());
  }
  const dim3 grid(unsigned(octet_grid(n / block)), unsigned(rows));
  if (block <= 8 * 32)  // blocks up to 256: x held in registers
    compress_kernel<32><<<grid, kThreads, 0, stream>>>(buf, n_buf, err, n, block, counts,
                                                       scale_bytes, scales_out, bits_out,
                                                       in_stride, out_stride);
  else
    compress_kernel<0><<<grid, kThreads, 0, stream>>>(buf, n_buf, err, n, block, counts,
                                                      scale_bytes, scales_out, bits_out,
                                                      in_stride, out_stride);
  return int(cudaGetLastError());
}

// One row of compress_rows: counts holds n / block doubles, scales_out n /
// block scales, bits_out n / 8 bytes.
int onebit_cuda_compress(const float* buf, int64_t n_buf, float* err, int64_t n, int64_t block,
                         const double* counts, int scale_bytes, uint8_t* scales_out,
                         uint8_t* bits_out, cudaStream_t stream) {
  return onebit_cuda_compress_rows(buf, n_buf, err, n, 1, 0, block, counts, scale_bytes,
                                   scales_out, bits_out, 0, stream);
}

// table: int64 [3 * count + 1], on the device: the tensors' pointers, their
// sizes (elements), and first_chunk (count + 1 entries, the last = chunks),
// for chunks of `chunk` elements. Every tensor is contiguous fp32 and
// non-empty; flag is a device int64.
int onebit_cuda_nonfinite(const int64_t* table, int64_t count, int64_t chunks, int64_t chunk,
                          int64_t* flag, cudaStream_t stream) {
  if (count < 0 || chunks < 0 || chunk <= 0 || chunk % 4) return int(cudaErrorInvalidValue);
  if (count == 0 || chunks == 0) return 0;
  const int grid = int(chunks < kMaxGrid ? chunks : kMaxGrid);
  nonfinite_kernel<<<grid, kThreads, 0, stream>>>(table, table + count, table + 2 * count, count,
                                                  chunks, chunk, flag);
  return int(cudaGetLastError());
}

// The same table as onebit_cuda_nonfinite (empty tensors allowed here);
// partial holds `chunks` doubles of scratch, norms `count` floats.
int onebit_cuda_norms(const int64_t* table, int64_t count, int64_t chunks, int64_t chunk,
                      double* partial, float* norms, cudaStream_t stream) {
  if (count < 0 || chunks < 0 || chunk <= 0 || chunk % 4) return int(cudaErrorInvalidValue);
  if (count == 0) return 0;
  if (chunks > 0) {
    const int grid = int(chunks < kMaxGrid ? chunks : kMaxGrid);
    sumsq_chunks_kernel<<<grid, kThreads, 0, stream>>>(table, table + count, table + 2 * count,
                                                       count, chunks, chunk, partial);
  }
  sumsq_finish_kernel<<<grid_for(count * 32), kThreads, 0, stream>>>(table + 2 * count, count,
                                                                     partial, norms);
  return int(cudaGetLastError());
}

// table: int64 [6 * count + 1]: the pointers of p, m, s and d (count each),
// sizes, first_chunk (count + 1); partial holds 2 * chunks doubles of
// scratch, norms 2 * count floats: ||p|| for each tensor, then ||u||.
int onebit_cuda_lamb_ratio_norms(const int64_t* table, int64_t count, int64_t chunks,
                                 int64_t chunk, float w, float wd, double* partial, float* norms,
                                 cudaStream_t stream) {
  if (count < 0 || chunks < 0 || chunk <= 0 || chunk % 4) return int(cudaErrorInvalidValue);
  if (count == 0) return 0;
  if (chunks > 0) {
    const int grid = int(chunks < kMaxGrid ? chunks : kMaxGrid);
    lamb_ratio_chunks_kernel<<<grid, kThreads, 0, stream>>>(table, count, chunks, chunk, w, wd,
                                                            partial, partial + chunks);
  }
  const int64_t* first_chunk = table + 5 * count;
  sumsq_finish_kernel<<<grid_for(count * 32), kThreads, 0, stream>>>(first_chunk, count,
                                                                     partial, norms);
  sumsq_finish_kernel<<<grid_for(count * 32), kThreads, 0, stream>>>(first_chunk, count,
                                                                     partial + chunks,
                                                                     norms + count);
  return int(cudaGetLastError());
}

// table: int64 [8 * count + 1]: the pointers of p, g, m, d, u and a
// (count each), sizes, first_chunk (count + 1).
int onebit_cuda_zero_one_local_step(const int64_t* table, int64_t count, int64_t chunks,
                                    int64_t chunk, float w, float wd_alpha, float value,
                                    cudaStream_t stream) {
  const int grid = list_grid(count, chunks, chunk);
  if (grid <= 0) return grid < 0 ? int(cudaErrorInvalidValue) : 0;
  if (wd_alpha != 0.0f)
    zero_one_local_step_kernel<true><<<grid, kThreads, 0, stream>>>(table, count, chunks, chunk,
                                                                    w, wd_alpha, value);
  else
    zero_one_local_step_kernel<false><<<grid, kThreads, 0, stream>>>(table, count, chunks, chunk,
                                                                     w, wd_alpha, value);
  return int(cudaGetLastError());
}

// table: int64 [6 * count + 1]: the pointers of p, g, m and d (count
// each), sizes, first_chunk (count + 1). bc1 = 1 or wd = 0 skip their op.
int onebit_cuda_zero_one_step(const int64_t* table, int64_t count, int64_t chunks, int64_t chunk,
                              float w, float bc1, float wd, float neg_lr, cudaStream_t stream) {
  const int grid = list_grid(count, chunks, chunk);
  if (grid <= 0) return grid < 0 ? int(cudaErrorInvalidValue) : 0;
  const bool bias = bc1 != 1.0f, decay = wd != 0.0f;
#define ONEBIT_ZERO_ONE_STEP(B, D)                                                     \
  zero_one_step_kernel<B, D><<<grid, kThreads, 0, stream>>>(table, count, chunks, chunk, w, \
                                                            bc1, wd, neg_lr)
  if (bias && decay) ONEBIT_ZERO_ONE_STEP(true, true);
  else if (bias) ONEBIT_ZERO_ONE_STEP(true, false);
  else if (decay) ONEBIT_ZERO_ONE_STEP(false, true);
  else ONEBIT_ZERO_ONE_STEP(false, false);
#undef ONEBIT_ZERO_ONE_STEP
  return int(cudaGetLastError());
}

// table: int64 [7 * count + 1]: the pointers of out, p, m, g and d (count
// each), sizes, first_chunk (count + 1). neg_wd = 0 skips the decay.
int onebit_cuda_zero_one_sync_input(const int64_t* table, int64_t count, int64_t chunks,
                                    int64_t chunk, float w, float neg_inv_bc1, float neg_wd,
                                    cudaStream_t stream) {
  const int grid = list_grid(count, chunks, chunk);
  if (grid <= 0) return grid < 0 ? int(cudaErrorInvalidValue) : 0;
  if (neg_wd != 0.0f)
    zero_one_sync_input_kernel<true><<<grid, kThreads, 0, stream>>>(table, count, chunks, chunk,
                                                                    w, neg_inv_bc1, neg_wd);
  else
    zero_one_sync_input_kernel<false><<<grid, kThreads, 0, stream>>>(table, count, chunks, chunk,
                                                                     w, neg_inv_bc1, neg_wd);
  return int(cudaGetLastError());
}

// table: int64 [5 * count + 1]: the pointers of p, m and d, sizes, first_chunk.
int onebit_cuda_zero_one_land(const int64_t* table, int64_t count, int64_t chunks, int64_t chunk,
                              float lr, float neg_bc1, cudaStream_t stream) {
  const int grid = list_grid(count, chunks, chunk);
  if (grid <= 0) return grid < 0 ? int(cudaErrorInvalidValue) : 0;
  zero_one_land_kernel<<<grid, kThreads, 0, stream>>>(table, count, chunks, chunk, lr, neg_bc1);
  return int(cudaGetLastError());
}

}  // extern "C"
