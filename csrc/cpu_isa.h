// Run-time choice of the CPU instruction set for the copy and XOR kernels.
//
// The extension is compiled without -march (it must load on any x86-64 or
// non-x86 host); the AVX2 / AVX-512 kernels carry per-function
// __attribute__((target(...))) and are only called when the running CPU (and
// OS, via XCR0, which libgcc checks) supports them.
#pragma once

#include <cstdlib>
#include <stdexcept>
#include <string>

namespace reft {

enum class Isa { Scalar = 0, Avx2 = 1, Avx512 = 2 };

inline bool cpu_has_avx2() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2");
#else
  return false;
#endif
}

inline bool cpu_has_avx512() {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx512f");
#else
  return false;
#endif
}

inline Isa best_isa() {
  static const Isa best = [] {
    // REFT_CPU_ISA=scalar|avx2|avx512 caps the choice (debugging, A/B timing).
    Isa cap = Isa::Avx512;
    if (const char* env = std::getenv("REFT_CPU_ISA")) {
      std::string s(env);
      if (s == "scalar") cap = Isa::Scalar;
      else if (s == "avx2") cap = Isa::Avx2;
    }
    Isa found = cpu_has_avx512() ? Isa::Avx512 : cpu_has_avx2() ? Isa::Avx2 : Isa::Scalar;
    return static_cast<int>(found) < static_cast<int>(cap) ? found : cap;
  }();
  return best;
}

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    default: return "scalar";
  }
}

// "auto" -> best supported; an explicit name the CPU lacks is an error rather
// than a silent downgrade, so tests that ask for a path really exercise it.
inline Isa parse_isa(const std::string& name) {
  if (name.empty() || name == "auto") return best_isa();
  if (name == "scalar") return Isa::Scalar;
  if (name == "avx2") {
    if (!cpu_has_avx2()) throw std::invalid_argument("isa 'avx2' not supported by this CPU");
    return Isa::Avx2;
  }
  if (name == "avx512") {
    if (!cpu_has_avx512()) throw std::invalid_argument("isa 'avx512' not supported by this CPU");
    return Isa::Avx512;
  }
  throw std::invalid_argument("unknown isa '" + name + "' (auto|scalar|avx2|avx512)");
}

}  // namespace reft
