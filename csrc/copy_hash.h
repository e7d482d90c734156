// The snapshot's copy-and-hash pipeline: one call per region, GIL released by the
// binding for all of it.  Each unit (one 4 MiB chunk of the slot) is filled from its
// pieces and hashed with xxh3_64 (the digest chunk_digest gives, reft_ext/store/
// checksum.py).  Device pieces are queued by one issuer thread as cudaMemcpyAsync into
// the (page-locked) slot on a side stream that first waits for the post-step event,
// one event per unit; N worker threads take units in order, wait for a unit's event,
// copy its host pieces, zero its padding and hash it.  Every native thread sets the
// rank's device first (a new thread's device is 0).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu_isa.h"

namespace reft {

struct HashPiece {
  const uint8_t* src;
  size_t dst_off;  // within the unit
  size_t n;
  bool device;     // src is device memory: a cudaMemcpyAsync by the issuer
};

struct HashUnit {
  uint8_t* dst;      // host destination (the slot)
  size_t len;        // bytes hashed
  size_t zero_from;  // [zero_from, len) is padding, written as zeros
  std::vector<HashPiece> pieces;
};

struct PipelineOptions {
  int num_threads = 1;      // hash (and host copy) threads
  int device = -1;          // the rank's device; needed when a piece is on a device
  uintptr_t stream = 0;     // cudaStream_t of the side stream
  uintptr_t after_event = 0;  // cudaEvent_t the stream waits for first (0: none)
  Isa isa = Isa::Scalar;
  bool nontemporal = false;  // host copies of a fused unit with streaming stores (each block is hashed from its source)
};

struct PipelineStats {
  double seconds = 0;     // the whole call
  double event_wait_s = 0;  // summed over workers: waiting for device copies
  int threads = 0;
};

uint64_t xxh3_64(const void* p, size_t n);

// Digests of every unit, in unit order; throws std::runtime_error on a device error
// (the side stream is synchronized first, so nothing writes the slot afterwards).
std::vector<uint64_t> copy_and_hash(const std::vector<HashUnit>& units,
                                    const PipelineOptions& opt, PipelineStats* stats);

}  // namespace reft
