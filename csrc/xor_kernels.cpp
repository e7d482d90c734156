// XOR kernels: portable uint64 path plus AVX2 / AVX-512 paths selected at run
// time (see cpu_isa.h).  All three produce identical bytes; the Python tests
// force each one and compare with torch.bitwise_xor.
#include "xor_kernels.h"

#include <algorithm>
#include <cstring>

#include "thread_pool.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define REFT_X86 1
#endif

namespace reft {
namespace {

// ---- portable path: 8 bytes at a time through memcpy (any alignment) -------
inline uint64_t load64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
  return v;
}

void xor_scalar(const uint8_t* const* s, int k, uint8_t* out, size_t i, size_t end) {
  for (; i + 8 <= end; i += 8) {
    uint64_t acc = load64(s[0] + i);
    for (int j = 1; j < k; ++j) acc ^= load64(s[j] + i);
    std::memcpy(out + i, &acc, 8);
  }
  for (; i < end; ++i) {
    uint8_t acc = s[0][i];
    for (int j = 1; j < k; ++j) acc ^= s[j][i];
    out[i] = acc;
  }
}

// Bytes from i until out+i is `align`-aligned (bounded by end).
inline size_t head_len(const uint8_t* out, size_t i, size_t end, size_t align) {
  size_t mis = reinterpret_cast<uintptr_t>(out + i) & (align - 1);
  return std::min(end - i, mis ? align - mis : 0);
}

#ifdef REFT_X86
// K > 0: member count known at compile time so the inner loop unrolls and the
// source pointers stay in registers; K == 0: run-time k (k > 8).
// Four vectors per iteration keep enough loads in flight per thread.
template <int K>
__attribute__((target("avx2"))) void xor_avx2(const uint8_t* const* sp, int k, uint8_t* out,
                                              size_t i, size_t end, bool nt) {
  const int kk = K ? K : k;
  const uint8_t* s[K ? K : 1];
  const uint8_t* const* src = K ? s : sp;  // copy to locals only when K is fixed
  if (K) for (int j = 0; j < K; ++j) s[j] = sp[j];
  size_t h = head_len(out, i, end, 32);
  xor_scalar(sp, k, out, i, i + h);
  i += h;
  for (; i + 128 <= end; i += 128) {
    __m256i a0 = _mm256_loadu_si256((const __m256i*)(src[0] + i));
    __m256i a1 = _mm256_loadu_si256((const __m256i*)(src[0] + i + 32));
    __m256i a2 = _mm256_loadu_si256((const __m256i*)(src[0] + i + 64));
    __m256i a3 = _mm256_loadu_si256((const __m256i*)(src[0] + i + 96));
    for (int j = 1; j < kk; ++j) {
      const uint8_t* p = src[j] + i;
      a0 = _mm256_xor_si256(a0, _mm256_loadu_si256((const __m256i*)p));
      a1 = _mm256_xor_si256(a1, _mm256_loadu_si256((const __m256i*)(p + 32)));
      a2 = _mm256_xor_si256(a2, _mm256_loadu_si256((const __m256i*)(p + 64)));
      a3 = _mm256_xor_si256(a3, _mm256_loadu_si256((const __m256i*)(p + 96)));
    }
    __m256i* o = (__m256i*)(out + i);  // 32-byte aligned after the head
    if (nt) {
      _mm256_stream_si256(o, a0); _mm256_stream_si256(o + 1, a1);
      _mm256_stream_si256(o + 2, a2); _mm256_stream_si256(o + 3, a3);
    } else {
      _mm256_store_si256(o, a0); _mm256_store_si256(o + 1, a1);
      _mm256_store_si256(o + 2, a2); _mm256_store_si256(o + 3, a3);
    }
  }
  if (nt) _mm_sfence();  // streaming stores are weakly ordered: fence before "done"
  xor_scalar(sp, k, out, i, end);
}

template <int K>
__attribute__((target("avx512f"))) void xor_avx512(const uint8_t* const* sp, int k, uint8_t* out,
                                                   size_t i, size_t end, bool nt) {
  const int kk = K ? K : k;
  const uint8_t* s[K ? K : 1];
  const uint8_t* const* src = K ? s : sp;
  if (K) for (int j = 0; j < K; ++j) s[j] = sp[j];
  size_t h = head_len(out, i, end, 64);
  xor_scalar(sp, k, out, i, i + h);
  i += h;
  for (; i + 256 <= end; i += 256) {
    __m512i a0 = _mm512_loadu_si512(src[0] + i);
    __m512i a1 = _mm512_loadu_si512(src[0] + i + 64);
    __m512i a2 = _mm512_loadu_si512(src[0] + i + 128);
    __m512i a3 = _mm512_loadu_si512(src[0] + i + 192);
    for (int j = 1; j < kk; ++j) {
      const uint8_t* p = src[j] + i;
      a0 = _mm512_xor_si512(a0, _mm512_loadu_si512(p));
      a1 = _mm512_xor_si512(a1, _mm512_loadu_si512(p + 64));
      a2 = _mm512_xor_si512(a2, _mm512_loadu_si512(p + 128));
      a3 = _mm512_xor_si512(a3, _mm512_loadu_si512(p + 192));
    }
    __m512i* o = (__m512i*)(out + i);  // 64-byte aligned after the head
    if (nt) {
      _mm512_stream_si512(o, a0); _mm512_stream_si512(o + 1, a1);
      _mm512_stream_si512(o + 2, a2); _mm512_stream_si512(o + 3, a3);
    } else {
      _mm512_store_si512(o, a0); _mm512_store_si512(o + 1, a1);
      _mm512_store_si512(o + 2, a2); _mm512_store_si512(o + 3, a3);
    }
  }
  if (nt) _mm_sfence();
  xor_scalar(sp, k, out, i, end);
}

using XorFn = void (*)(const uint8_t* const*, int, uint8_t*, size_t, size_t, bool);

XorFn pick_avx2(int k) {
  switch (k) {
    case 1: return xor_avx2<1>; case 2: return xor_avx2<2>; case 3: return xor_avx2<3>;
    case 4: return xor_avx2<4>; case 5: return xor_avx2<5>; case 6: return xor_avx2<6>;
    case 7: return xor_avx2<7>; case 8: return xor_avx2<8>; default: return xor_avx2<0>;
  }
}
XorFn pick_avx512(int k) {
  switch (k) {
    case 1: return xor_avx512<1>; case 2: return xor_avx512<2>; case 3: return xor_avx512<3>;
    case 4: return xor_avx512<4>; case 5: return xor_avx512<5>; case 6: return xor_avx512<6>;
    case 7: return xor_avx512<7>; case 8: return xor_avx512<8>; default: return xor_avx512<0>;
  }
}
#endif  // REFT_X86

}  // namespace

void xor_range(const uint8_t* const* srcs, int k, uint8_t* out, size_t begin, size_t end,
               Isa isa, bool nontemporal) {
  if (k <= 0 || begin >= end) return;
#ifdef REFT_X86
  if (isa == Isa::Avx512) return pick_avx512(k)(srcs, k, out, begin, end, nontemporal);
  if (isa == Isa::Avx2) return pick_avx2(k)(srcs, k, out, begin, end, nontemporal);
#endif
  (void)nontemporal;
  xor_scalar(srcs, k, out, begin, end);
}

size_t default_chunk_bytes(size_t n, int num_threads) {
  // ~4 chunks per thread for balance, at least 256 KiB so the atomic hand-out
  // is noise, rounded to pages so chunk edges stay 64-byte aligned relative to
  // the start.
  const size_t min_chunk = size_t(256) << 10, page = 4096;
  size_t per = n / (size_t(std::max(1, num_threads)) * 4);
  per = (per + page - 1) / page * page;
  return std::max(per, min_chunk);
}

void xor_encode(const std::vector<const uint8_t*>& srcs, uint8_t* out, size_t n,
                int num_threads, Isa isa, int nontemporal) {
  const int k = static_cast<int>(srcs.size());
  if (k == 0 || n == 0) return;
  const bool nt = use_nontemporal(nontemporal, n);
  const size_t chunk = default_chunk_bytes(n, num_threads);
  const size_t nchunks = (n + chunk - 1) / chunk;
  if (num_threads <= 1 || nchunks == 1) {
    xor_range(srcs.data(), k, out, 0, n, isa, nt);
    return;
  }
  shared_pool().parallel_for(nchunks, num_threads, [&](size_t c) {
    size_t b = c * chunk, e = std::min(n, b + chunk);
    xor_range(srcs.data(), k, out, b, e, isa, nt);
  });
}

}  // namespace reft
