// Error check for CUDA runtime calls, shared by the .cu files (nvcc/hipcc only: this
// header includes cuda_runtime.h, unlike cuda_ops.h which g++ compiles).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#define REFT_CUDA_CHECK(expr)                                                       \
  do {                                                                              \
    cudaError_t err_ = (expr);                                                      \
    if (err_ != cudaSuccess)                                                        \
      throw std::runtime_error(std::string(#expr) + ": " + cudaGetErrorString(err_)); \
  } while (0)
