// Host-side interface of the CUDA/ROCm kernels (copy_cuda.cu, xor_cuda.cu).
//
// Plain C++ only: streams and events travel as opaque integers (the value of
// torch.cuda.Stream().cuda_stream), so bindings.cpp compiles with g++ and no
// CUDA, HIP or torch headers.  Every function throws std::runtime_error
// carrying the runtime's error string on failure.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace reft {
namespace gpu {

// Largest member count one XOR kernel launch takes; more are chained with
// the output as an accumulator (see xor_cuda.cu).
constexpr int kMaxXorMembers = 32;

int device_count();                  // 0 when no driver / no device
std::string runtime_version();       // e.g. "cuda 13000" or "hip 60200000"

// Issues cudaMemcpyAsync(kind=Default) of n bytes in pieces of chunk_bytes
// (0 = one piece) on `stream`, then records an event on it and returns the
// event.  dst/src may be device, pinned host or pageable host pointers; only
// pinned host memory gives a truly asynchronous device->host copy.
uintptr_t memcpy_async(void* dst, const void* src, size_t n, size_t chunk_bytes,
                       uintptr_t stream);
bool event_query(uintptr_t event);        // true once the work before it is done
void event_synchronize(uintptr_t event);  // blocks (call with the GIL released)
void event_destroy(uintptr_t event);

// Page-locks an existing host mapping (a shared-memory segment) in place. `device`
// (>= 0): made current on the calling thread first and left current (never restored:
// restoring a thread's "previous" device, 0 on a thread that never set one, would make
// a context on GPU 0); -1: the thread's own. Call it from a thread whose device is the
// rank's (store/slots.py's page-locking thread sets it) or a thread of ours.
void host_register(void* ptr, size_t n, int device = -1);
void host_unregister(void* ptr);

// The copy-and-hash pipeline's pieces (copy_hash.cpp).
void set_device(int device);  // on the calling thread (a thread of our own)
void stream_wait_event(uintptr_t stream, uintptr_t event);
void memcpy_async_raw(void* dst, const void* src, size_t n, uintptr_t stream);
uintptr_t record_new_event(uintptr_t stream);  // blocking-sync event: waiters sleep
// Waits for `stream` (on a thread of ours whose device is the stream's).
void stream_synchronize(uintptr_t stream);

// out = srcs[0] ^ ... ^ srcs[k-1] over n bytes of device memory, enqueued on
// `stream`.  out may be exactly one of the srcs.
void xor_encode(const uint8_t* const* srcs, int k, uint8_t* out, size_t n, uintptr_t stream);

}  // namespace gpu
}  // namespace reft
