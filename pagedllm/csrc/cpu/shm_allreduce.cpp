// The shared-memory all-reduce (shm_allreduce.h).
//
// Segment layout, every part on its own kLine (128 bytes: x86's adjacent-line prefetcher moves 64-byte lines in
// pairs, so a line one rank writes shares its pair with no other writer):
//   the header: magic (stored last by the creator: the rest is initialised), version, world size, max_floats;
//   one RankLine per rank, written only by that rank: the number of calls it published (`seq`), the length of the
//   call in each of its two slots, its state (absent, attached, closed, failed) and its pid;
//   two data slots of slot_floats floats per rank: rank r's slot of parity p at (2 r + p) * slot_floats.
//
// Call k (k = 1, 2, ...; one per chunk of at most max_floats floats) on rank r:
//   1. copy the chunk into slot (r, k % 2) and its length into len[k % 2];
//   2. publish it: release-store seq = k;
//   3. wait until every rank's seq >= k (acquire loads);
//   4. chunk = slot (0, k % 2) + slot (1, k % 2) + ..., added in rank order: the same additions on every rank, so
//      every rank gets the same bits.
// Why two slots and no second counter to wait on: rank r writes slot (r, p) again at call k + 2, which it reaches
// only after it saw, in step 3 of call k + 1, every rank publish call k + 1; and a rank publishes k + 1 only after
// it finished reading call k (program order, and the release store orders those reads before it). So no rank still
// reads the slot when it is overwritten; the "all have read" phase of call k is step 3 of call k + 1, and a call
// waits once instead of twice. A peer may be one call ahead (seq = k + 1): it wrote its other slot.
//
// Waiting: spin on the peer's line with a pause for the first kSpinNs (a peer on another core arrives within
// microseconds), then sched_yield until kYieldNs (a peer descheduled on an over-subscribed machine, maybe on this
// very core, gets to run; when nothing else wants the core it returns at once, so yielding early costs little),
// then short sleeps (a peer that late is not on a hot path, and the core is better given away) until the timeout,
// which turns a dead or stuck peer into an error. A peer's state is checked too, so that a peer that closed or
// failed is an error at once rather than after the timeout.
#include "shm_allreduce.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace pagedllm {

namespace {

constexpr uint64_t kMagic = 0x7061676564415231ull;  // "pagedAR1"
constexpr uint32_t kVersion = 1;
constexpr size_t kLine = 128;
constexpr int kMaxWorld = 256;
constexpr int64_t kMaxFloats = int64_t{1} << 28;  // 1 GiB per slot: far past any activation
constexpr int64_t kSpinNs = 5'000;  // 50 us made a call of 3 ranks on 2 cores 5x slower; 2 ranks gained nothing
constexpr int64_t kYieldNs = 2'000'000;
constexpr int64_t kSleepNs = 50'000;
constexpr int kSpinsPerCheck = 64;  // pauses between two looks at the clock
constexpr int64_t kBlock = 1024;    // floats summed at a time: the output block stays in L1 across the ranks

enum : uint32_t { kAbsent = 0, kAttached = 1, kClosed = 2, kFailed = 3 };

struct Header {
  uint64_t magic;
  uint32_t version, world_size;
  uint64_t max_floats, slot_floats;
};

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

void sleep_ns(int64_t ns) {
  timespec ts{static_cast<time_t>(ns / 1'000'000'000), static_cast<long>(ns % 1'000'000'000)};
  nanosleep(&ts, nullptr);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  __asm__ __volatile__("yield");
#endif
}

// One step of a wait that has lasted `waited` ns: see the top of the file.
void back_off(int64_t waited) {
  if (waited < kSpinNs) return;
  if (waited < kYieldNs)
    sched_yield();
  else
    sleep_ns(kSleepNs);
}

std::string format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
std::string format(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

std::string errno_text(const char* what, const std::string& name) {
  return format("%s %s: %s", what, name.c_str(), strerror(errno));
}

const char* state_name(uint32_t s) {
  switch (s) {
    case kAbsent:
      return "absent";
    case kAttached:
      return "attached";
    case kClosed:
      return "closed";
    case kFailed:
      return "failed";
    default:
      return "corrupt";
  }
}

// Four floats at a time through GCC's vector extension: SSE2 (the x86-64 baseline) needs no flags, and an element
// gets exactly the scalar addition, so the tail loop agrees with the vector loop bit for bit.
typedef float v4f __attribute__((vector_size(16)));
inline v4f load4(const float* p) {
  v4f v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store4(float* p, v4f v) { std::memcpy(p, &v, sizeof v); }

// out[i] = a[i] + b[i] for i < n (out may be a).
inline void add_into(float* out, const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v4f x0 = load4(a + i) + load4(b + i), x1 = load4(a + i + 4) + load4(b + i + 4);
    const v4f x2 = load4(a + i + 8) + load4(b + i + 8), x3 = load4(a + i + 12) + load4(b + i + 12);
    store4(out + i, x0), store4(out + i + 4, x1), store4(out + i + 8, x2), store4(out + i + 12, x3);
  }
  for (; i < n; ++i) out[i] = a[i] + b[i];
}

}  // namespace

struct ShmAllReduce::RankLine {
  uint64_t seq;     // the last call this rank published
  uint64_t len[2];  // the floats of the call in each of its slots (all ranks must agree)
  uint32_t state;   // kAbsent, kAttached, kClosed, kFailed
  int32_t pid;      // for error messages
};
static_assert(sizeof(Header) <= kLine, "header fits its line");

ShmAllReduce::RankLine* ShmAllReduce::line(int r) const {
  return reinterpret_cast<RankLine*>(base_ + kLine * (1 + static_cast<size_t>(r)));
}

float* ShmAllReduce::slot(int r, uint64_t parity) const {
  float* data = reinterpret_cast<float*>(base_ + kLine * (1 + static_cast<size_t>(world_)));
  return data + (2 * static_cast<int64_t>(r) + static_cast<int64_t>(parity)) * slot_floats_;
}

ShmAllReduce::ShmAllReduce(const std::string& name, int rank, int world_size, int64_t max_floats, bool create,
                           double timeout_s)
    : name_(name), rank_(rank), world_(world_size), max_floats_(max_floats), creator_(create) {
  static_assert(sizeof(RankLine) <= kLine, "a rank's line fits");
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 200)
    throw std::runtime_error("shared-memory name must be '/' and 1 to 199 characters without another '/', got '" +
                             name + "'");
  if (world_size < 1 || world_size > kMaxWorld)
    throw std::runtime_error(format("world_size must be in 1..%d, got %d", kMaxWorld, world_size));
  if (rank < 0 || rank >= world_size)
    throw std::runtime_error(format("rank %d outside 0..%d", rank, world_size - 1));
  if (max_floats < 1 || max_floats > kMaxFloats)
    throw std::runtime_error(format("max_floats must be in 1..%lld, got %lld", static_cast<long long>(kMaxFloats),
                                    static_cast<long long>(max_floats)));
  if (!(timeout_s > 0) || timeout_s > 1e6) throw std::runtime_error("timeout_s must be positive (seconds)");
  timeout_ns_ = static_cast<int64_t>(timeout_s * 1e9);
  slot_floats_ = (max_floats + 31) / 32 * 32;  // each slot starts on a kLine
  size_ = kLine * (1 + static_cast<size_t>(world_)) + 2 * sizeof(float) * world_ * slot_floats_;

#ifdef MAP_POPULATE
  const int map_flags = MAP_SHARED | MAP_POPULATE;  // no page faults in the first calls
#else
  const int map_flags = MAP_SHARED;
#endif
  int fd = -1;
  if (create) {
    shm_unlink(name.c_str());  // a segment of this name left by an earlier run that crashed: not ours to join
    fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0) throw std::runtime_error(errno_text("cannot create the shared-memory segment", name));
    // posix_fallocate, not just ftruncate: a full /dev/shm is an error here rather than a SIGBUS at the first write.
    int err = ftruncate(fd, static_cast<off_t>(size_)) == 0 ? 0 : errno;
    if (err == 0) err = posix_fallocate(fd, 0, static_cast<off_t>(size_));
    void* p = err == 0 ? mmap(nullptr, size_, PROT_READ | PROT_WRITE, map_flags, fd, 0) : MAP_FAILED;
    if (p == MAP_FAILED && err == 0) err = errno;
    ::close(fd);
    if (err != 0) {
      shm_unlink(name.c_str());
      throw std::runtime_error(format("cannot size or map the shared-memory segment %s (%zu bytes): %s",
                                      name.c_str(), size_, strerror(err)));
    }
    base_ = static_cast<char*>(p);  // zero-filled: every rank absent, every seq 0
    auto* h = reinterpret_cast<Header*>(base_);
    h->version = kVersion;
    h->world_size = static_cast<uint32_t>(world_size);
    h->max_floats = static_cast<uint64_t>(max_floats);
    h->slot_floats = static_cast<uint64_t>(slot_floats_);
    __atomic_store_n(&h->magic, kMagic, __ATOMIC_RELEASE);
  } else {
    // Wait for the creator: the name may not exist yet, or exist before it is sized and initialised.
    const int64_t deadline = now_ns() + timeout_ns_;
    for (;;) {
      fd = shm_open(name.c_str(), O_RDWR, 0);
      if (fd < 0 && errno != ENOENT)
        throw std::runtime_error(errno_text("cannot open the shared-memory segment", name));
      struct stat st {};
      if (fd >= 0 && fstat(fd, &st) == 0 && static_cast<size_t>(st.st_size) >= kLine) {
        void* hp = mmap(nullptr, kLine, PROT_READ, MAP_SHARED, fd, 0);
        if (hp != MAP_FAILED) {
          const auto* h = static_cast<const Header*>(hp);
          if (__atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) == kMagic) {
            const Header copy = *h;
            munmap(hp, kLine);
            if (copy.version != kVersion || copy.world_size != static_cast<uint32_t>(world_size) ||
                copy.max_floats != static_cast<uint64_t>(max_floats) ||
                static_cast<size_t>(st.st_size) < size_) {
              ::close(fd);
              throw std::runtime_error(format(
                  "shared-memory segment %s was made for world_size %u, max_floats %llu (version %u), not %d, %lld",
                  name.c_str(), copy.world_size, static_cast<unsigned long long>(copy.max_floats), copy.version,
                  world_size, static_cast<long long>(max_floats)));
            }
            void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, map_flags, fd, 0);
            const int err = errno;
            ::close(fd);
            if (p == MAP_FAILED)
              throw std::runtime_error(format("cannot map %s: %s", name.c_str(), strerror(err)));
            base_ = static_cast<char*>(p);
            break;
          }
          munmap(hp, kLine);
        }
      }
      if (fd >= 0) ::close(fd);
      if (now_ns() > deadline)
        throw std::runtime_error(format("no shared-memory segment %s after %.1f s: its creator did not make it",
                                        name.c_str(), timeout_s));
      sleep_ns(1'000'000);
    }
  }

  // Register: a rank's state goes absent -> attached exactly once, so a second process with this rank (or a stale
  // segment some run already filled) is refused here rather than corrupting the sums.
  RankLine* me = line(rank_);
  __atomic_store_n(&me->pid, static_cast<int32_t>(getpid()), __ATOMIC_RELAXED);
  uint32_t expected = kAbsent;
  if (!__atomic_compare_exchange_n(&me->state, &expected, kAttached, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    munmap(base_, size_);
    base_ = nullptr;
    if (creator_) shm_unlink(name.c_str());
    throw std::runtime_error(format("rank %d is already %s in the shared-memory segment %s: two processes with one "
                                    "rank, or a segment left by an earlier run",
                                    rank_, state_name(expected), name.c_str()));
  }
}

ShmAllReduce::~ShmAllReduce() { close(); }

bool ShmAllReduce::fail(const char* fmt, ...) noexcept {
  char buf[512];  // formatted here, not by the callers: nothing on the way to the error may throw
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  try {
    error_ = buf;
  } catch (...) {
  }
  broken_ = true;
  if (base_ != nullptr) __atomic_store_n(&line(rank_)->state, kFailed, __ATOMIC_RELEASE);
  return false;
}

void ShmAllReduce::wait_for_peers() {
  if (broken_) throw std::runtime_error(error_);
  const int64_t start = now_ns();
  for (int r = 0; r < world_; ++r) {
    for (;;) {
      const uint32_t s = __atomic_load_n(&line(r)->state, __ATOMIC_ACQUIRE);
      if (s == kAttached) break;
      if (s != kAbsent) {
        fail("rank %d is %s before every rank opened %s", r, state_name(s), name_.c_str());
        throw std::runtime_error(error_);
      }
      const int64_t waited = now_ns() - start;
      if (waited > timeout_ns_) {
        fail("rank %d did not open the shared-memory segment %s within %.1f s", r, name_.c_str(), timeout_s());
        throw std::runtime_error(error_);
      }
      sleep_ns(100'000);  // once per group's life: no need to spin
    }
  }
  if (creator_ && !unlinked_) {
    shm_unlink(name_.c_str());  // everyone has it mapped: the name is no longer needed
    unlinked_ = true;
  }
}

bool ShmAllReduce::wait_for(int r, uint64_t k) noexcept {
  const RankLine* peer = line(r);
  for (int i = 0; i < kSpinsPerCheck; ++i) {  // the common case: the peer is there or nearly
    if (__atomic_load_n(&peer->seq, __ATOMIC_ACQUIRE) >= k) return true;
    cpu_relax();
  }
  const int64_t start = now_ns();
  for (;;) {
    for (int i = 0; i < kSpinsPerCheck; ++i) {
      if (__atomic_load_n(&peer->seq, __ATOMIC_ACQUIRE) >= k) return true;
      cpu_relax();
    }
    const uint32_t s = __atomic_load_n(&peer->state, __ATOMIC_ACQUIRE);
    if (s != kAttached) {
      // It may have published this call and closed after it: its seq was stored before its state.
      if (__atomic_load_n(&peer->seq, __ATOMIC_ACQUIRE) >= k) return true;
      return fail("all-reduce call %llu: rank %d (pid %d) is %s%s", static_cast<unsigned long long>(k), r, peer->pid,
                  state_name(s), s == kFailed ? " (it timed out or its lengths disagreed; see its own error)" : "");
    }
    const int64_t waited = now_ns() - start;
    if (waited > timeout_ns_)
      return fail("all-reduce call %llu: rank %d (pid %d) did not arrive within %.1f s: a peer that died or "
                  "stopped calling all_reduce",
                  static_cast<unsigned long long>(k), r, peer->pid, timeout_s());
    back_off(waited);
  }
}

void ShmAllReduce::reduce(float* out, uint64_t parity, int64_t n) const noexcept {
  if (world_ == 1) return;  // out already holds the only contribution
  const float* s0 = slot(0, parity);
  const float* s1 = slot(1, parity);
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(kBlock, n - b);
    add_into(out + b, s0 + b, s1 + b, m);
    for (int r = 2; r < world_; ++r) add_into(out + b, out + b, slot(r, parity) + b, m);
  }
}

bool ShmAllReduce::run(float* data, int64_t n) noexcept {
  if (broken_) return false;
  if (n < 0) return fail("all_reduce of a negative length");
  RankLine* me = line(rank_);
  for (int64_t off = 0; off < n; off += max_floats_) {
    const int64_t c = std::min(max_floats_, n - off);
    const uint64_t k = seq_ + 1, p = k & 1;
    std::memcpy(slot(rank_, p), data + off, static_cast<size_t>(c) * sizeof(float));
    __atomic_store_n(&me->len[p], static_cast<uint64_t>(c), __ATOMIC_RELAXED);
    __atomic_store_n(&me->seq, k, __ATOMIC_RELEASE);  // publishes the slot and len (release)
    seq_ = k;
    for (int r = 0; r < world_; ++r)
      if (r != rank_ && !wait_for(r, k)) return false;
    for (int r = 0; r < world_; ++r) {
      const uint64_t len = __atomic_load_n(&line(r)->len[p], __ATOMIC_RELAXED);  // ordered by wait_for's acquire
      if (len != static_cast<uint64_t>(c))
        return fail("all-reduce call %llu: rank %d contributed %llu floats, rank %d %lld: the ranks called "
                    "all_reduce with different lengths",
                    static_cast<unsigned long long>(k), r, static_cast<unsigned long long>(len), rank_,
                    static_cast<long long>(c));
    }
    reduce(data + off, p, c);
  }
  return true;
}

void ShmAllReduce::close() noexcept {
  if (base_ == nullptr) return;
  RankLine* me = line(rank_);
  if (__atomic_load_n(&me->state, __ATOMIC_RELAXED) == kAttached)
    __atomic_store_n(&me->state, kClosed, __ATOMIC_RELEASE);  // after every seq store: see wait_for
  if (creator_ && !unlinked_) {
    shm_unlink(name_.c_str());
    unlinked_ = true;
  }
  munmap(base_, size_);
  base_ = nullptr;
  if (!broken_) {
    broken_ = true;
    try {
      error_ = "the shared-memory all-reduce " + name_ + " is closed";
    } catch (...) {
    }
  }
}

}  // namespace pagedllm

extern "C" void pagedllm_shm_all_reduce(float* data, int64_t n, void* ctx) {
  static_cast<pagedllm::ShmAllReduce*>(ctx)->run(data, n);
}
