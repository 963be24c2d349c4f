// Sign-bit packing for onebit on NVIDIA GPUs.
//
// Same wire format as every other kernel (DESIGN.md): bit = 1 iff x >= 0,
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
constexpr int kMaxBlocks = 1024;  // also the size of the reduction scratch

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

// out[j] = (1/rows) * sum_r (bit(r, j) ? scales[r] : -scales[r]), j < cols.
__global__ void decode_kernel(const uint8_t* __restrict__ bits, int64_t row_bytes, int rows,
                              const float* __restrict__ scales, int64_t cols,
                              float* __restrict__ out) {
  const float inv = 1.0f / float(rows);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t j = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; j < cols; j += stride) {
    float acc = 0.0f;
    for (int r = 0; r < rows; ++r) {
      bool one = (bits[r * row_bytes + j / 8] >> (j % 8)) & 1;
      acc += one ? scales[r] : -scales[r];
    }
    out[j] = acc * inv;
  }
}

// Pass 1 of compensate_pack: err <- buf (zero past n_buf) + err, and one
// partial sum of squares per block, in double.
__global__ void compensate_kernel(const float* __restrict__ buf, int64_t n_buf,
                                  float* __restrict__ err, int64_t n,
                                  double* __restrict__ partial) {
  __shared__ double sums[kThreads];
  double sum = 0.0;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float x = (i < n_buf ? buf[i] : 0.0f) + err[i];
    err[i] = x;
    sum += double(x) * double(x);
  }
  sums[threadIdx.x] = sum;
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) sums[threadIdx.x] += sums[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partial[blockIdx.x] = sums[0];
}

// Adds the per-block partials in a fixed order (so the scale is reproducible)
// and writes scale = sqrt(sum / n).
__global__ void scale_kernel(const double* __restrict__ partial, int parts, int64_t n,
                             float* __restrict__ scale) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    double total = 0.0;
    for (int k = 0; k < parts; ++k) total += partial[k];
    scale[0] = n > 0 ? float(sqrt(total / double(n))) : 0.0f;
  }
}

// Pass 2: pack sign(x) with a ballot and leave err = x - scale * sign(x).
__global__ void pack_error_kernel(float* __restrict__ err, int64_t n,
                                  const float* __restrict__ scale, uint8_t* __restrict__ out) {
  const float s = scale[0];
  const int64_t nbytes = (n + 7) / 8;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i - (threadIdx.x & 31) < n;
       i += stride) {
    bool bit = false;
    if (i < n) {
      float x = err[i];
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
                       int64_t cols, float* out, cudaStream_t stream) {
  if (cols == 0) return 0;
  decode_kernel<<<blocks_for(cols), kThreads, 0, stream>>>(bits, row_bytes, rows, scales, cols, out);
  return int(cudaGetLastError());
}

// `scratch` holds at least onebit_cuda_scratch_doubles() doubles.
int onebit_cuda_compensate_pack(const float* buf, int64_t n_buf, float* err, int64_t n,
                                uint8_t* out, float* scale, double* scratch,
                                cudaStream_t stream) {
  int blocks = blocks_for(n);
  compensate_kernel<<<blocks, kThreads, 0, stream>>>(buf, n_buf, err, n, scratch);
  scale_kernel<<<1, 32, 0, stream>>>(scratch, blocks, n, scale);
  if (n > 0) pack_error_kernel<<<blocks, kThreads, 0, stream>>>(err, n, scale, out);
  return int(cudaGetLastError());
}

int onebit_cuda_scratch_doubles(void) { return kMaxBlocks; }

}  // extern "C"
