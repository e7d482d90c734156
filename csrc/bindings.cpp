// pybind11 module reft_ext._C.
//
// Deliberately built against raw pointers (Python ints from
// tensor.data_ptr()) and byte counts instead of torch's C++ API: the build
// needs no torch headers and the .so does not break when torch is upgraded.
// All argument checking against tensors (bounds, dtype, contiguity, device)
// happens in the Python wrappers (reft_ext/copy/engine.py, protect/xor.py); this
// layer only rejects null pointers.  Every call that moves bytes releases the
// GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "copy_engine.h"
#include "copy_hash.h"
#include "cpu_isa.h"
#include "xor_kernels.h"
#ifdef REFT_WITH_CUDA
#include "cuda_ops.h"
#endif

namespace py = pybind11;
using namespace reft;

namespace {

int resolve_threads(int n) { return n > 0 ? n : usable_cpus(); }

template <typename T>
T* as_ptr(uintptr_t p, size_t n, const char* what) {
  if (p == 0 && n != 0) throw std::invalid_argument(std::string(what) + " is a null pointer");
  return reinterpret_cast<T*>(p);
}

std::vector<CopySegment> to_segments(const std::vector<std::tuple<uintptr_t, uintptr_t, size_t>>& items) {
  std::vector<CopySegment> segs;
  segs.reserve(items.size());
  for (const auto& [dst, src, n] : items) {
    segs.push_back({as_ptr<uint8_t>(dst, n, "dst"), as_ptr<const uint8_t>(src, n, "src"), n});
  }
  return segs;
}

std::vector<const uint8_t*> to_srcs(const std::vector<uintptr_t>& srcs, size_t n) {
  std::vector<const uint8_t*> out;
  out.reserve(srcs.size());
  for (uintptr_t p : srcs) out.push_back(as_ptr<const uint8_t>(p, n, "source"));
  return out;
}

std::string build_info() {
  std::string s = "compiler=" __VERSION__;
#ifdef REFT_WITH_CUDA
  s += "; gpu=" + gpu::runtime_version();
#else
  s += "; gpu=off (built without CUDA/ROCm)";
#endif
  s += std::string("; best_isa=") + isa_name(best_isa());
  return s;
}

#ifdef REFT_WITH_CUDA
// Owns a CUDA event recorded after an async copy; destroyed with the object.
struct CudaEvent {
  uintptr_t ev = 0;
  size_t bytes = 0;
  explicit CudaEvent(uintptr_t e, size_t b) : ev(e), bytes(b) {}
  ~CudaEvent() {
    try {
      if (ev) gpu::event_destroy(ev);
    } catch (...) {  // never throw from a destructor (e.g. at interpreter exit)
    }
  }
  bool poll() const { return gpu::event_query(ev); }
  void wait() const {
    py::gil_scoped_release nogil;
    gpu::event_synchronize(ev);
  }
};
#endif

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "REFT native copy engine and XOR erasure-code kernels (see docs/csrc.md)";
  m.attr("BUILD_INFO") = build_info();

  m.def("num_cpus", &usable_cpus, "CPUs this process may run on (affinity aware)");
  m.def("cpu_features", [] {
    py::dict d;
    d["avx2"] = cpu_has_avx2();
    d["avx512"] = cpu_has_avx512();
    d["best"] = isa_name(best_isa());
    return d;
  });

  m.def(
      "xor_encode",
      [](const std::vector<uintptr_t>& srcs, uintptr_t out, size_t nbytes, int num_threads,
         const std::string& isa, int nontemporal) {
        if (srcs.empty()) throw std::invalid_argument("xor_encode needs at least one source");
        auto ptrs = to_srcs(srcs, nbytes);
        uint8_t* o = as_ptr<uint8_t>(out, nbytes, "out");
        Isa which = parse_isa(isa);
        int t = resolve_threads(num_threads);
        py::gil_scoped_release nogil;
        xor_encode(ptrs, o, nbytes, t, which, nontemporal);
      },
      py::arg("srcs"), py::arg("out"), py::arg("nbytes"), py::arg("num_threads") = 0,
      py::arg("isa") = "auto", py::arg("nontemporal") = -1,
      "out = srcs[0] ^ ... ^ srcs[k-1] over nbytes (blocking, GIL released)");

  m.def(
      "memcpy",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, int num_threads, const std::string& isa,
         int nontemporal, size_t chunk_bytes) {
        std::vector<CopySegment> segs{{as_ptr<uint8_t>(dst, nbytes, "dst"),
                                       as_ptr<const uint8_t>(src, nbytes, "src"), nbytes}};
        Isa which = parse_isa(isa);
        int t = resolve_threads(num_threads);
        py::gil_scoped_release nogil;
        parallel_copy(segs, t, which, nontemporal, chunk_bytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("num_threads") = 0,
      py::arg("isa") = "auto", py::arg("nontemporal") = -1, py::arg("chunk_bytes") = 0,
      "blocking multi-threaded copy (GIL released)");

  m.def(
      "xxh3_64",
      [](uintptr_t p, size_t n) {
        const void* ptr = as_ptr<const void>(p, n, "ptr");
        py::gil_scoped_release nogil;
        return xxh3_64(ptr, n);
      },
      py::arg("ptr"), py::arg("nbytes"), "xxh3_64 of nbytes of host memory (GIL released)");

  // One call per region: units = [(dst, len, zero_from, [(src, dst_off, n, is_device)])]
  m.def(
      "copy_hash",
      [](const std::vector<std::tuple<uintptr_t, size_t, size_t,
                                      std::vector<std::tuple<uintptr_t, size_t, size_t, bool>>>>&
             items,
         int num_threads, int device, uintptr_t stream, uintptr_t after_event,
         const std::string& isa, bool nontemporal) {
        std::vector<HashUnit> units;
        units.reserve(items.size());
        for (const auto& [dst, len, zero_from, pieces] : items) {
          HashUnit u{as_ptr<uint8_t>(dst, len, "dst"), len, zero_from, {}};
          u.pieces.reserve(pieces.size());
          for (const auto& [src, off, n, dev] : pieces)
            u.pieces.push_back({as_ptr<const uint8_t>(src, n, "src"), off, n, dev});
          units.push_back(std::move(u));
        }
        PipelineOptions opt;
        opt.num_threads = std::max(1, num_threads);
        opt.device = device;
        opt.stream = stream;
        opt.after_event = after_event;
        opt.isa = parse_isa(isa);
        opt.nontemporal = nontemporal;
        PipelineStats st;
        std::vector<uint64_t> digests;
        {
          py::gil_scoped_release nogil;
          digests = copy_and_hash(units, opt, &st);
        }
        py::dict stats;
        stats["seconds"] = st.seconds;
        stats["event_wait_s"] = st.event_wait_s;
        stats["threads"] = st.threads;
        return py::make_tuple(digests, stats);
      },
      py::arg("units"), py::arg("num_threads") = 1, py::arg("device") = -1,
      py::arg("stream") = 0, py::arg("after_event") = 0, py::arg("isa") = "auto",
      py::arg("nontemporal") = false,
      "fill and xxh3_64 every unit of a region on num_threads threads (GIL released); "
      "returns (digests, stats)");

  py::class_<CopyHandle, std::shared_ptr<CopyHandle>>(m, "CopyHandle")
      .def("poll", &CopyHandle::poll, "True once every chunk has been copied")
      .def("wait", &CopyHandle::wait, py::arg("timeout") = -1.0,
           py::call_guard<py::gil_scoped_release>(),
           "block until done or timeout seconds (<0: forever); returns done")
      .def_property_readonly("bytes", &CopyHandle::bytes)
      .def_property_readonly("num_chunks", &CopyHandle::num_chunks)
      .def_property_readonly("nontemporal", &CopyHandle::nontemporal)
      .def_property_readonly("elapsed", &CopyHandle::elapsed,
                             "seconds from submit to completion (to now while running)");

  py::class_<CopyEngine>(m, "CopyEngine")
      .def(py::init([](int num_threads, const std::string& isa) {
             return new CopyEngine(resolve_threads(num_threads), parse_isa(isa));
           }),
           py::arg("num_threads") = 0, py::arg("isa") = "auto")
      .def(
          "submit",
          [](CopyEngine& e, const std::vector<std::tuple<uintptr_t, uintptr_t, size_t>>& items,
             size_t chunk_bytes, int nontemporal) {
            auto segs = to_segments(items);
            return e.submit(segs, chunk_bytes, nontemporal);
          },
          py::arg("items"), py::arg("chunk_bytes") = 0, py::arg("nontemporal") = -1,
          "items: [(dst_ptr, src_ptr, nbytes)]; returns a CopyHandle at once")
      .def_property_readonly("num_threads", &CopyEngine::num_threads)
      .def_property_readonly("isa", [](const CopyEngine& e) { return isa_name(e.isa()); });

#ifdef REFT_WITH_CUDA
  m.attr("HAS_CUDA") = true;
  m.def("cuda_device_count", &gpu::device_count);
  m.def("cuda_runtime_version", &gpu::runtime_version);
  py::class_<CudaEvent>(m, "CudaEvent")
      .def("poll", &CudaEvent::poll)
      .def("wait", &CudaEvent::wait)
      .def_readonly("bytes", &CudaEvent::bytes);
  m.def(
      "cuda_memcpy_async",
      [](uintptr_t dst, uintptr_t src, size_t nbytes, size_t chunk_bytes, uintptr_t stream) {
        uintptr_t ev = gpu::memcpy_async(as_ptr<void>(dst, nbytes, "dst"),
                                         as_ptr<const void>(src, nbytes, "src"), nbytes,
                                         chunk_bytes, stream);
        return new CudaEvent(ev, nbytes);
      },
      py::arg("dst"), py::arg("src"), py::arg("nbytes"), py::arg("chunk_bytes") = 0,
      py::arg("stream") = 0, "enqueue chunked cudaMemcpyAsync on stream; returns a CudaEvent");
  // page-locking GBs takes seconds: a background reservation thread must not hold the GIL
  // device >= 0: made current for the call (the rank's device, not the thread's 0)
  m.def("cuda_host_register", [](uintptr_t p, size_t n, int device) {
    void* ptr = as_ptr<void>(p, n, "ptr");
    py::gil_scoped_release nogil;
    gpu::host_register(ptr, n, device);
  }, py::arg("ptr"), py::arg("nbytes"), py::arg("device") = -1);
  m.def("cuda_host_unregister", [](uintptr_t p) {
    py::gil_scoped_release nogil;
    gpu::host_unregister(reinterpret_cast<void*>(p));
  });
  m.def(
      "cuda_xor_encode",
      [](const std::vector<uintptr_t>& srcs, uintptr_t out, size_t nbytes, uintptr_t stream) {
        if (srcs.empty()) throw std::invalid_argument("xor_encode needs at least one source");
        auto ptrs = to_srcs(srcs, nbytes);
        gpu::xor_encode(ptrs.data(), static_cast<int>(ptrs.size()),
                        as_ptr<uint8_t>(out, nbytes, "out"), nbytes, stream);
      },
      py::arg("srcs"), py::arg("out"), py::arg("nbytes"), py::arg("stream") = 0);
#else
  m.attr("HAS_CUDA") = false;
#endif
}
