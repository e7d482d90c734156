// A c10d::Backend that forwards every call to an inner backend which can be replaced:
// the process groups of an in-process restart (reft_ext/cluster/groups.py).
//
// Why in C++: a torch ProcessGroup keeps the backend registered first for a backend
// type (ProcessGroup::setBackend reuses it), c10d::Backend has no Python constructor, and
// a Python ProcessGroup subclass is seen by Python callers only. This backend is
// registered once per group; an in-process restart aborts the inner gloo/NCCL backend
// of the failed generation and sets the next generation's, so every holder of the
// ProcessGroup (a tuple, a closure, DDP's reducer, TransformerEngine) keeps a working
// group without anything walking the heap.
//
// Unlike _C (copy_engine, xor), this file needs torch's headers and links libtorch: it
// is built as its own extension, reft_ext._groups, and is optional (the restart then
// falls back to rebinding references, megatron/training/inprocess.py).

#include <mutex>

#include <torch/extension.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace {

using c10::intrusive_ptr;
using c10d::Backend;
using c10d::Work;

class DelegatingBackend final : public Backend {
 public:
  DelegatingBackend(intrusive_ptr<Backend> inner, std::string name)
      : Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)),
        name_(std::move(name)) {}

  // The next generation's communicator: same group, same rank and size.
  void setInner(intrusive_ptr<Backend> inner) {
    TORCH_CHECK(inner->getRank() == getRank() && inner->getSize() == getSize(),
                "reft group ", name_, ": new backend is rank ", inner->getRank(), "/",
                inner->getSize(), ", the group is ", getRank(), "/", getSize());
    if (!uid_.empty()) inner->setGroupUid(uid_);
    std::lock_guard<std::mutex> lock(mu_);
    inner_ = std::move(inner);
    generation_++;
  }
  intrusive_ptr<Backend> inner() const {
    std::lock_guard<std::mutex> lock(mu_);
    return inner_;
  }
  int64_t generation() const { return generation_; }

  const std::string getBackendName() const override { return name_; }
  c10::intrusive_ptr<Options> getBackendOptions() override { return inner()->getBackendOptions(); }
  void setTimeout(std::chrono::milliseconds t) override { inner()->setTimeout(t); }
  bool supportsCoalescing() const override { return inner()->supportsCoalescing(); }
  void startCoalescing() override { inner()->startCoalescing(); }
  intrusive_ptr<Work> endCoalescing() override { return inner()->endCoalescing(); }
  void setGroupUid(const std::string& uid) override {
    uid_ = uid;
    inner()->setGroupUid(uid);
  }
  void abort() override { inner()->abort(); }
  void shutdown() override { inner()->shutdown(); }
  c10d::ErrorType getError() override { return inner()->getError(); }
  void setSequenceNumberForGroup() override { inner()->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return inner()->getSequenceNumberForGroup(); }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) override {
    inner()->monitoredBarrier(o, wait_all);
  }

  // ---- the collectives: each forwarded as it is -------------------------------------
  using Tensors = std::vector<at::Tensor>;
  using TensorLists = std::vector<std::vector<at::Tensor>>;

  intrusive_ptr<Work> broadcast(Tensors& t, const c10d::BroadcastOptions& o) override {
    return inner()->broadcast(t, o);
  }
  intrusive_ptr<Work> allreduce(Tensors& t, const c10d::AllreduceOptions& o) override {
    return inner()->allreduce(t, o);
  }
  intrusive_ptr<Work> allreduce_sparse(Tensors& t, const c10d::AllreduceOptions& o) override {
    return inner()->allreduce_sparse(t, o);
  }
  intrusive_ptr<Work> allreduce_coalesced(
      Tensors& t, const c10d::AllreduceCoalescedOptions& o) override {
    return inner()->allreduce_coalesced(t, o);
  }
  intrusive_ptr<Work> reduce(Tensors& t, const c10d::ReduceOptions& o) override {
    return inner()->reduce(t, o);
  }
  intrusive_ptr<Work> allgather(TensorLists& out, Tensors& in,
                                const c10d::AllgatherOptions& o) override {
    return inner()->allgather(out, in, o);
  }
  intrusive_ptr<Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                      const c10d::AllgatherOptions& o) override {
    return inner()->_allgather_base(out, in, o);
  }
  intrusive_ptr<Work> allgather_coalesced(TensorLists& out, Tensors& in,
                                          const c10d::AllgatherOptions& o) override {
    return inner()->allgather_coalesced(out, in, o);
  }
  intrusive_ptr<Work> allgather_into_tensor_coalesced(
      Tensors& out, Tensors& in, const c10d::AllgatherOptions& o) override {
    return inner()->allgather_into_tensor_coalesced(out, in, o);
  }
  intrusive_ptr<Work> gather(TensorLists& out, Tensors& in,
                             const c10d::GatherOptions& o) override {
    return inner()->gather(out, in, o);
  }
  intrusive_ptr<Work> scatter(Tensors& out, TensorLists& in,
                              const c10d::ScatterOptions& o) override {
    return inner()->scatter(out, in, o);
  }
  intrusive_ptr<Work> reduce_scatter(Tensors& out, TensorLists& in,
                                     const c10d::ReduceScatterOptions& o) override {
    return inner()->reduce_scatter(out, in, o);
  }
  intrusive_ptr<Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                           const c10d::ReduceScatterOptions& o) override {
    return inner()->_reduce_scatter_base(out, in, o);
  }
  intrusive_ptr<Work> reduce_scatter_tensor_coalesced(
      Tensors& out, Tensors& in, const c10d::ReduceScatterOptions& o) override {
    return inner()->reduce_scatter_tensor_coalesced(out, in, o);
  }
  intrusive_ptr<Work> alltoall_base(at::Tensor& out, at::Tensor& in,
                                    std::vector<int64_t>& out_splits,
                                    std::vector<int64_t>& in_splits,
                                    const c10d::AllToAllOptions& o) override {
    return inner()->alltoall_base(out, in, out_splits, in_splits, o);
  }
  intrusive_ptr<Work> alltoall(Tensors& out, Tensors& in,
                               const c10d::AllToAllOptions& o) override {
    return inner()->alltoall(out, in, o);
  }
  intrusive_ptr<Work> send(Tensors& t, int dst, int tag) override {
    return inner()->send(t, dst, tag);
  }
  intrusive_ptr<Work> recv(Tensors& t, int src, int tag) override {
    return inner()->recv(t, src, tag);
  }
  intrusive_ptr<Work> recvAnysource(Tensors& t, int tag) override {
    return inner()->recvAnysource(t, tag);
  }
  intrusive_ptr<Work> barrier(const c10d::BarrierOptions& o) override {
    return inner()->barrier(o);
  }

 private:
  mutable std::mutex mu_;
  intrusive_ptr<Backend> inner_;
  const std::string name_;
  std::string uid_;
  int64_t generation_ = 0;
};

intrusive_ptr<DelegatingBackend> as_delegating(const intrusive_ptr<Backend>& b) {
  auto d = c10::dynamic_intrusive_pointer_cast<DelegatingBackend>(b);
  TORCH_CHECK(d, "not a reft group backend: ", b->getBackendName());
  return d;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Process-group backends whose communicator is replaced per generation";
  m.def("wrap", [](intrusive_ptr<Backend> inner, std::string name) -> intrusive_ptr<Backend> {
          return c10::make_intrusive<DelegatingBackend>(std::move(inner), std::move(name));
        }, "A backend forwarding to ``inner`` until set_inner replaces it",
        py::arg("inner"), py::arg("name"));
  m.def("set_inner", [](intrusive_ptr<Backend> b, intrusive_ptr<Backend> inner) {
          as_delegating(b)->setInner(std::move(inner));
        }, py::arg("backend"), py::arg("inner"));
  m.def("inner", [](intrusive_ptr<Backend> b) { return as_delegating(b)->inner(); });
  m.def("generation", [](intrusive_ptr<Backend> b) { return as_delegating(b)->generation(); });
  m.def("is_delegating", [](intrusive_ptr<Backend> b) {
          return static_cast<bool>(c10::dynamic_intrusive_pointer_cast<DelegatingBackend>(b));
        });
}
