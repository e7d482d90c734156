// XOR erasure-code kernel for device memory (CUDA; ROCm via hipify).
//
// Memory bound: each thread moves 16 bytes per member per step (uint4 loads,
// the widest plain load on both NVIDIA and AMD), grid-stride so any length is
// covered by a bounded grid.  16-byte loads need every pointer at the same
// offset modulo 16; the bytes before the first aligned offset (head) and after
// the last full vector (tail) go through a byte loop.  Pointers that disagree
// modulo 16 fall back to the byte loop entirely (correct, slower; torch's
// allocator hands out 512-byte aligned storage so this is rare).
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "cuda_ops.h"


namespace reft {
namespace gpu {
namespace {

// Passed by value in kernel parameter space (< 4 KiB), so no device-side
// pointer array has to be allocated and copied per call.
struct XorArgs {
  const unsigned char* src[kMaxXorMembers];
  unsigned char* out;
  int k;
  unsigned long long n;     // total bytes
  unsigned long long head;  // bytes before the first 16-byte aligned offset
  unsigned long long nvec;  // number of 16-byte vectors after the head
};

__global__ void xor_kernel(XorArgs a) {
  const unsigned long long tid = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (unsigned long long v = tid; v < a.nvec; v += stride) {
    const unsigned long long off = a.head + v * 16;
    uint4 acc = *reinterpret_cast<const uint4*>(a.src[0] + off);
    for (int j = 1; j < a.k; ++j) {
      const uint4 x = *reinterpret_cast<const uint4*>(a.src[j] + off);
      acc.x ^= x.x;
      acc.y ^= x.y;
      acc.z ^= x.z;
      acc.w ^= x.w;
    }
    *reinterpret_cast<uint4*>(a.out + off) = acc;
  }
  // Scalar head [0, head) and tail [head + 16*nvec, n), indexed as one range.
  const unsigned long long tail_begin = a.head + a.nvec * 16;
  const unsigned long long nscalar = a.head + (a.n - tail_begin);
  for (unsigned long long t = tid; t < nscalar; t += stride) {
    const unsigned long long off = t < a.head ? t : tail_begin + (t - a.head);
    unsigned char acc = a.src[0][off];
    for (int j = 1; j < a.k; ++j) acc ^= a.src[j][off];
    a.out[off] = acc;
  }
}

void launch(const uint8_t* const* srcs, int k, uint8_t* out, size_t n, cudaStream_t s) {
  XorArgs a;
  a.k = k;
  a.out = out;
  a.n = n;
  const uintptr_t mis = reinterpret_cast<uintptr_t>(out) & 15;
  bool same = true;
  for (int j = 0; j < k; ++j) {
    a.src[j] = srcs[j];
    same = same && ((reinterpret_cast<uintptr_t>(srcs[j]) & 15) == mis);
  }
  if (same) {
    a.head = mis ? 16 - mis : 0;
    if (a.head > n) a.head = n;
    a.nvec = (n - a.head) / 16;
  } else {
    a.head = n;
    a.nvec = 0;
  }
  const unsigned long long work = a.nvec ? a.nvec : n;
  const int threads = 256;
  // Enough blocks to fill any current GPU several times over; grid-stride
  // loops cover the rest without one block per 4 KiB of a multi-GB buffer.
  unsigned long long blocks = (work + threads - 1) / threads;
  if (blocks > 8192) blocks = 8192;
  if (blocks == 0) blocks = 1;
  // cudaLaunchKernel returns this launch's own error; `<<<>>>` followed by
  // cudaGetLastError() would report (and clear) any earlier unrelated error instead.
  void* params[] = {&a};
  REFT_CUDA_CHECK(cudaLaunchKernel(reinterpret_cast<const void*>(&xor_kernel),
                                   dim3(static_cast<unsigned int>(blocks)), dim3(threads),
                                   params, 0, s));
}

}  // namespace

void xor_encode(const uint8_t* const* srcs, int k, uint8_t* out, size_t n, uintptr_t stream) {
  if (k <= 0 || n == 0) return;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int first = k < kMaxXorMembers ? k : kMaxXorMembers;
  launch(srcs, first, out, n, s);
  // More than kMaxXorMembers members: fold the rest in with out as member 0.
  const uint8_t* batch[kMaxXorMembers];
  for (int done = first; done < k;) {
    int take = k - done < kMaxXorMembers - 1 ? k - done : kMaxXorMembers - 1;
    batch[0] = out;
    for (int j = 0; j < take; ++j) batch[1 + j] = srcs[done + j];
    launch(batch, take + 1, out, n, s);
    done += take;
  }
}

}  // namespace gpu
}  // namespace reft
