// Error checks for CUDA runtime calls, shared by the .cu files (nvcc/hipcc only: this
// header includes cuda_runtime.h, unlike cuda_ops.h which g++ compiles).
//
// The runtime keeps one "last error" per thread that torch reads after its own kernel
// launches (C10_CUDA_KERNEL_LAUNCH_CHECK -> cudaGetLastError). A check here must
// therefore (1) report the error the checked call itself returned, never one read back
// from that shared slot, and (2) clear the slot only when this call is what set it:
// clearing an earlier, unrelated error would hide a real fault from torch.
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

namespace reft {
namespace gpu {

// Clears the last error only if it is the one our call produced and no error was
// pending before it (`prior` = cudaPeekAtLastError() taken just before the call).
// Sticky errors (a faulted context) cannot be cleared by anyone and stay visible.
inline void clear_own_error(cudaError_t prior, cudaError_t own) {
  if (prior == cudaSuccess && own != cudaSuccess && cudaPeekAtLastError() == own)
    (void)cudaGetLastError();
}

[[noreturn]] inline void throw_cuda_error(const char* what, cudaError_t err) {
  throw std::runtime_error(std::string(what) + ": " + cudaGetErrorName(err) + " (" +
                           cudaGetErrorString(err) + ")");
}

}  // namespace gpu
}  // namespace reft

// Checks the return code of `expr` (a runtime call returning cudaError_t); on failure
// clears only the error this call set and throws with the call's text and error name.
#define REFT_CUDA_CHECK(expr)                                    \
  do {                                                           \
    const cudaError_t prior_ = cudaPeekAtLastError();            \
    const cudaError_t err_ = (expr);                             \
    if (err_ != cudaSuccess) {                                   \
      ::reft::gpu::clear_own_error(prior_, err_);                \
      ::reft::gpu::throw_cuda_error(#expr, err_);                \
    }                                                            \
  } while (0)
