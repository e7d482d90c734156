// XOR erasure code on raw bytes (CPU).
//
// parity = m_0 ^ m_1 ^ ... ^ m_{k-1}; a lost member is the XOR of the parity
// and the k-1 survivors, so decode is the same kernel with different inputs.
// Bytes, not elements: fp32/bf16/fp16/int tensors are all just byte ranges.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu_isa.h"

namespace reft {

// Sizes at and above which the kernels use non-temporal (cache-bypassing)
// stores when asked for "auto" (-1): the output is far larger than what the
// caches could keep for a later reader, and streaming stores skip the
// read-for-ownership of every destination line (1/3 less memory traffic for a
// copy).  Below it the output may still be read from cache soon, so normal
// stores win.  4 MiB is twice the development box's per-core L2; not finely
// tuned (large outputs gain clearly from streaming: docs/csrc.md).
constexpr size_t kNontemporalThreshold = size_t(4) << 20;

// Single-threaded: out[i] = XOR_j srcs[j][i] for i in [begin, end).
// k >= 1.  out may be exactly one of the srcs (in-place accumulate) but must not
// partially overlap any of them.  Any alignment and length.
void xor_range(const uint8_t* const* srcs, int k, uint8_t* out, size_t begin, size_t end,
               Isa isa, bool nontemporal);

// Multi-threaded over the shared pool (calling thread included).  Call with the
// GIL released.  nontemporal: -1 auto (by size), 0 never, 1 always.
void xor_encode(const std::vector<const uint8_t*>& srcs, uint8_t* out, size_t n,
                int num_threads, Isa isa, int nontemporal);

// Helpers shared with the copy engine: how a length is split into per-thread
// chunks (big enough to amortise the hand-out, small enough to balance), and
// the "auto" non-temporal rule.
size_t default_chunk_bytes(size_t n, int num_threads);
inline bool use_nontemporal(int flag, size_t total_bytes) {
  return flag < 0 ? total_bytes >= kNontemporalThreshold : flag != 0;
}

}  // namespace reft
