// Device <-> pinned-host copies on a caller-chosen stream, plus page-locking of
// existing host mappings.  Written against the CUDA runtime API only (no
// driver API, no CUDA-only intrinsics) so hipify-perl / torch's hipify turn it
// into valid HIP for ROCm builds.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "cuda_ops.h"


namespace reft {
namespace gpu {

int device_count() {
  int n = 0;
  const cudaError_t prior = cudaPeekAtLastError();
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    // "no device" / "no driver" is an answer here, not a fault: drop only that error
    clear_own_error(prior, err);
    return 0;
  }
  return n;
}

std::string runtime_version() {
  int v = 0;
  (void)cudaRuntimeGetVersion(&v);
#if defined(__HIP_PLATFORM_AMD__)
  return "hip " + std::to_string(v);
#else
  return "cuda " + std::to_string(v);
#endif
}

uintptr_t memcpy_async(void* dst, const void* src, size_t n, size_t chunk_bytes,
                       uintptr_t stream) {
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  if (chunk_bytes == 0) chunk_bytes = n;
  // Pieces let the caller bound how long one copy occupies the copy engine;
  // they are enqueued back to back, so the DMA engine never idles between them.
  for (size_t off = 0; off < n; off += chunk_bytes) {
    size_t len = n - off < chunk_bytes ? n - off : chunk_bytes;
    REFT_CUDA_CHECK(cudaMemcpyAsync(static_cast<char*>(dst) + off,
                                    static_cast<const char*>(src) + off, len,
                                    cudaMemcpyDefault, s));
  }
  cudaEvent_t ev;
  REFT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  REFT_CUDA_CHECK(cudaEventRecord(ev, s));
  return reinterpret_cast<uintptr_t>(ev);
}

bool event_query(uintptr_t event) {
  const cudaError_t prior = cudaPeekAtLastError();
  const cudaError_t e = cudaEventQuery(reinterpret_cast<cudaEvent_t>(event));
  if (e == cudaSuccess) return true;
  // Some runtimes record "not ready" as the last error; it is our answer, so drop it
  // (only it: an error pending from before stays for its owner to see).
  clear_own_error(prior, e);
  if (e == cudaErrorNotReady) return false;
  throw_cuda_error("cudaEventQuery", e);
}

void event_synchronize(uintptr_t event) {
  REFT_CUDA_CHECK(cudaEventSynchronize(reinterpret_cast<cudaEvent_t>(event)));
}

void event_destroy(uintptr_t event) {
  REFT_CUDA_CHECK(cudaEventDestroy(reinterpret_cast<cudaEvent_t>(event)));
}

void host_register(void* ptr, size_t n, int device) {
  // the rank's device current: the registration's context is made there, not on GPU 0.
  // Set, never restored: restoring a thread's "previous" device (0 on a thread that never
  // set one) would make a primary context there (cudaSetDevice does since CUDA 12). The
  // callers are threads of ours whose device is the rank's (docs/gpu.md).
  if (device >= 0) set_device(device);
  // Portable: every device in the process sees the range as pinned.
  REFT_CUDA_CHECK(cudaHostRegister(ptr, n, cudaHostRegisterPortable));
}

void set_device(int device) { REFT_CUDA_CHECK(cudaSetDevice(device)); }

void stream_wait_event(uintptr_t stream, uintptr_t event) {
  REFT_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream),
                                      reinterpret_cast<cudaEvent_t>(event), 0));
}

void memcpy_async_raw(void* dst, const void* src, size_t n, uintptr_t stream) {
  REFT_CUDA_CHECK(cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault,
                                  reinterpret_cast<cudaStream_t>(stream)));
}

uintptr_t record_new_event(uintptr_t stream) {
  cudaEvent_t ev;
  REFT_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync));
  const cudaError_t prior = cudaPeekAtLastError();
  const cudaError_t err = cudaEventRecord(ev, reinterpret_cast<cudaStream_t>(stream));
  if (err != cudaSuccess) {
    (void)cudaEventDestroy(ev);
    clear_own_error(prior, err);
    throw_cuda_error("cudaEventRecord", err);
  }
  return reinterpret_cast<uintptr_t>(ev);
}

void stream_synchronize(uintptr_t stream) {
  REFT_CUDA_CHECK(cudaStreamSynchronize(reinterpret_cast<cudaStream_t>(stream)));
}

void host_unregister(void* ptr) { REFT_CUDA_CHECK(cudaHostUnregister(ptr)); }

}  // namespace gpu
}  // namespace reft
