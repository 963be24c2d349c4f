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

namespace {

constexpr int kThreads = 256;
constexpr int kMaxBlocks = 1024;

__device__ __forceinline__ bool nonneg(float x) { return x >= 0.0f; }
__device__ __forceinline__ bool nonneg(double x) { return x >= 0.0; }
struct Half { uint16_t bits; };
struct BFloat { uint16_t bits; };
__device__ __forceinline__ bool nonneg(Half h) {
  uint16_t mag = h.bits & 0x7fff;
  return mag <= 0x7c00 && (!(h.bits & 0x8000) || mag == 0);
}
__device__ __forceinline__ bool nonneg(BFloat h) {
  uint16_t mag = h.bits & 0x7fff;
  return mag <= 0x7f80 && (!(h.bits & 0x8000) || mag == 0);
}

// Lanes 0..3 of each warp store the four bytes of the ballot word, skipping
// bytes past the end so a tail never writes out of bounds.
__device__ __forceinline__ void store_word(uint32_t word, int64_t base, int64_t nbytes,
                                           uint8_t* out) {
  int lane = threadIdx.x & 31;
  if (lane < 4) {
    int64_t byte = base / 8 + lane;
    if (byte < nbytes) out[byte] = uint8_t(word >> (8 * lane));
  }
}

int blocks_for(int64_t n) {
  int64_t b = (n + kThreads - 1) / kThreads;
  return int(b < 1 ? 1 : (b > kMaxBlocks ? kMaxBlocks : b));
}

template <typename T>
__global__ void pack_kernel(const T* __restrict__ x, int64_t n, uint8_t* __restrict__ out) {
  const int64_t nbytes = (n + 7) / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  // Every lane of a warp runs the same number of iterations, so the ballot
  // always has the full warp (elements past n vote 0, which is the padding).
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i - (threadIdx.x & 31) < n;
       i += stride) {
    bool bit = i < n && nonneg(x[i]);
    uint32_t word = __ballot_sync(0xffffffffu, bit);
    store_word(word, i - (threadIdx.x & 31), nbytes, out);
  }
}

// out[j] = (1/rows) * sum_r (bit(r, j) ? s : -s), s = scales[r, j / block], j < cols.
__global__ void decode_kernel(const uint8_t* __restrict__ bits, int64_t row_bytes, int rows,
                              const float* __restrict__ scales, int64_t block, int64_t cols,
                              float* __restrict__ out) {
  const float inv = 1.0f / float(rows);
  const int64_t nblocks = (cols + block - 1) / block;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < cols; j += stride) {
    float acc = 0.0f;
    for (int r = 0; r < rows; ++r) {
      bool one = (bits[r * row_bytes + j / 8] >> (j % 8)) & 1;
      float s = scales[r * nblocks + j / block];
      acc += one ? s : -s;
    }
    out[j] = acc * inv;
  }
}

// Pass 1: err <- buf (zero past n_buf) + err, and the sum of squares of each
// onebit block, in double. One warp per onebit block: lane l adds elements
// l, l + 32, ... and the warp reduces in a fixed order, so a block's sum
// never depends on the launch shape or on where the block sits.
__global__ void compensate_kernel(const float* __restrict__ buf, int64_t n_buf,
                                  float* __restrict__ err, int64_t n, int64_t block,
                                  double* __restrict__ sumsq) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / 32);
  const int64_t nblocks = n / block;
  for (int64_t k = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32; k < nblocks;
       k += warps) {
    double sum = 0.0;
    for (int64_t i = k * block + lane; i < (k + 1) * block; i += 32) {
      float x = (i < n_buf ? buf[i] : 0.0f) + err[i];
      err[i] = x;
      sum += double(x) * double(x);
    }
    for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffffu, sum, off);
    if (lane == 0) sumsq[k] = sum;
  }
}

// Pass 2: pack sign(x) with a ballot and leave err = x - s * sign(x), s the
// scale of x's block.
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

}  // namespace

extern "C" {

// dtype codes match builders/cpu.py: 0 fp32, 1 fp64, 2 fp16, 3 bf16.
int onebit_cuda_pack(int dtype, const void* x, int64_t n, uint8_t* out, cudaStream_t stream) {
  if (n == 0) return 0;
  int blocks = blocks_for(n);
  switch (dtype) {
    case 0: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const float*>(x), n, out); break;
    case 1: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const double*>(x), n, out); break;
    case 2: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const Half*>(x), n, out); break;
    case 3: pack_kernel<<<blocks, kThreads, 0, stream>>>(static_cast<const BFloat*>(x), n, out); break;
    default: return int(cudaErrorInvalidValue);
  }
  return int(cudaGetLastError());
}

int onebit_cuda_decode(const uint8_t* bits, int64_t row_bytes, int rows, const float* scales,
                       int64_t block, int64_t cols, float* out, cudaStream_t stream) {
  if (cols == 0) return 0;
  if (block <= 0 || block % 8) return int(cudaErrorInvalidValue);
  decode_kernel<<<blocks_for(cols), kThreads, 0, stream>>>(bits, row_bytes, rows, scales, block,
                                                           cols, out);
  return int(cudaGetLastError());
}

// `block` is a multiple of 8 that divides n; sumsq holds n / block doubles.
int onebit_cuda_compensate(const float* buf, int64_t n_buf, float* err, int64_t n, int64_t block,
                           double* sumsq, cudaStream_t stream) {
  if (block <= 0 || block % 8 || n % block) return int(cudaErrorInvalidValue);
  if (n == 0) return 0;
  compensate_kernel<<<blocks_for(n / block * 32), kThreads, 0, stream>>>(buf, n_buf, err, n, block,
                                                                         sumsq);
  return int(cudaGetLastError());
}

int onebit_cuda_pack_error(float* err, int64_t n, const float* scales, int64_t block,
                           uint8_t* out, cudaStream_t stream) {
  if (block <= 0 || block % 8 || n % block) return int(cudaErrorInvalidValue);
  if (n == 0) return 0;
  pack_error_kernel<<<blocks_for(n), kThreads, 0, stream>>>(err, n, scales, block, out);
  return int(cudaGetLastError());
}

}  // extern "C"
