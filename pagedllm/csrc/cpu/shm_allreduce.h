// A sum all-reduce of float32 vectors among the processes of one machine, through POSIX shared memory.
//
// Compiled into the torch bindings (pagedllm._C, bindings.cpp), not into the per-ISA kernel libraries: it needs no
// vector instructions of its own, and the fused decoder (decoder.cpp) reaches it only through the AllReduceFn hook
// of kernels.h, as a plain function pointer and context.
//
// The segment (`name`, created by one rank and opened by the others) holds one control line per rank and two data
// slots per rank of `max_floats` floats each; see shm_allreduce.cpp for the protocol. Every rank gets the same
// result to the bit: the slots are summed in rank order everywhere. A peer that does not arrive within the timeout
// is an error, never a hang; so is a peer that closed or failed, and ranks that disagree on a call's length. After
// the first error the object is broken: every later call fails at once with that error (the group's state is no
// longer known).
#pragma once

#include <cstdint>
#include <string>

namespace pagedllm {

// Hidden like pybind11's own types: the class is bound in this module only (the decoder gets the C hook below).
class __attribute__((visibility("hidden"))) ShmAllReduce {
 public:
  // create: make the segment (unlinking a stale one of the same name first); otherwise open it, waiting up to
  // timeout_s for its creator. Either way this rank registers in it. Throws std::runtime_error.
  ShmAllReduce(const std::string& name, int rank, int world_size, int64_t max_floats, bool create, double timeout_s);
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  // Waits (up to the timeout) until every rank registered; the creator then unlinks the name, so that nothing is
  // left behind in /dev/shm however the processes end. Throws std::runtime_error.
  void wait_for_peers();

  // data [n] = the sum over the ranks of their data [n], in place; every rank calls it with the same n. False on an
  // error (error() says what); never throws, so that it can run inside the decoder's parallel region.
  bool run(float* data, int64_t n) noexcept;

  // Marks this rank closed (peers waiting for it fail at once instead of timing out), unlinks the name if this rank
  // created it and nobody did yet, unmaps. Idempotent.
  void close() noexcept;

  const std::string& error() const { return error_; }
  bool broken() const { return broken_; }
  bool closed() const { return base_ == nullptr; }
  const std::string& name() const { return name_; }
  int rank() const { return rank_; }
  int world_size() const { return world_; }
  int64_t max_floats() const { return max_floats_; }
  uint64_t calls() const { return seq_; }  // chunks reduced so far (a vector longer than max_floats is several)
  double timeout_s() const { return static_cast<double>(timeout_ns_) * 1e-9; }

 private:
  struct RankLine;
  RankLine* line(int r) const;
  float* slot(int r, uint64_t parity) const;
  bool wait_for(int r, uint64_t k) noexcept;
  void reduce(float* out, uint64_t parity, int64_t n) const noexcept;
  bool fail(const char* fmt, ...) noexcept __attribute__((format(printf, 2, 3)));  // records the error: false

  std::string name_;
  int rank_, world_;
  int64_t max_floats_, slot_floats_ = 0;
  int64_t timeout_ns_;
  bool creator_, unlinked_ = false, broken_ = false;
  std::string error_;
  char* base_ = nullptr;
  size_t size_ = 0;
  uint64_t seq_ = 0;  // this rank's last published call
};

}  // namespace pagedllm

// The fused decoder's AllReduceFn (kernels.h) over a pagedllm::ShmAllReduce passed as ctx. On an error the data is
// left partly reduced and the object broken: whoever drives the decoder checks `error()` after the step.
extern "C" void pagedllm_shm_all_reduce(float* data, int64_t n, void* ctx);
