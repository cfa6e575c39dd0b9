// What the oneDNN operators of onednn_conv.cc and blocked.cc share: the CPU engine and stream (one each for the
// process), plain and chosen memory descriptions, Operand, which moves a buffer between Paddle's layout and the
// one a primitive chose, PlanCache, which keeps the primitives made for a shape, OpenMPThreads, which sets the
// threads oneDNN makes and runs a primitive for, and Team, which shares a call's work among those threads.
//
// The contract with callers: an operator may be called from any thread. A plan holds primitives and layouts only,
// never a buffer, so two calls may run one plan at once; the buffers a call needs are made for that call and freed
// when it returns.

#pragma once

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

// The headers package was configured with oneDNN's experimental sparse memory, whose query function the
// libdnnl.so.3 of Paddle's wheels does not export; these operators use dense memory only.
#include "oneapi/dnnl/dnnl_config.h"
#undef DNNL_EXPERIMENTAL_SPARSE
#include "oneapi/dnnl/dnnl.hpp"

namespace paddle_mnist {

using dnnl::memory;
using Dims = memory::dims;

inline dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

inline dnnl::stream& cpu_stream() {
  static dnnl::stream stream(cpu_engine());
  return stream;
}

inline memory::desc nchw(const Dims& dims) {
  return memory::desc(dims, memory::data_type::f32, memory::format_tag::nchw);
}
inline memory::desc any(const Dims& dims) {
  return memory::desc(dims, memory::data_type::f32, memory::format_tag::any);
}

// A map of NCHW dims as Paddle holds it blocked, a 5-D tensor [N, C/B, H, W, B]: by 8 or 16 channels (oneDNN's
// aBcd8b and aBcd16b, what its kernels run on), or by all C of them, one block ([N, 1, H, W, C]: NHWC, whose
// kernels take a count that is no multiple of 8, as mnist_cnn's 20, without padding it).
inline bool valid_block(int64_t block, int64_t channels) {
  return block == 8 || block == 16 || (block > 0 && block == channels);
}
inline memory::desc blocked_map(const Dims& dims, int64_t block) {
  const auto tag = block == 16  ? memory::format_tag::aBcd16b
                   : block == 8 ? memory::format_tag::aBcd8b
                                : memory::format_tag::nhwc;
  return memory::desc(dims, memory::data_type::f32, tag);
}

// Whether oneDNN implements a primitive with a direct kernel: neither im2col and a GEMM nor the reference loops,
// which go element by element.
inline bool direct(const dnnl::primitive_desc& pd) {
  const std::string kernel = pd.impl_info_str();
  return kernel.find("ref") == std::string::npos && kernel.find("gemm") == std::string::npos;
}

// One operand of one primitive: Paddle's buffer in its layout (NCHW unless given), and the layout the primitive
// chose for it. Where the two differ, the reorders between the two and, for each call, a scratch buffer in the
// chosen layout that lives as long as the memory handed out (the call's arguments).
class Operand {
 public:
  Operand(const Dims& dims, const memory::desc& chosen) : Operand(nchw(dims), chosen) {}
  Operand(const memory::desc& user, const memory::desc& chosen) : user_(user), chosen_(chosen) {
    if (chosen == user_) return;
    to_chosen_ = dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), user_, cpu_engine(), chosen));
    to_user_ = dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), chosen, cpu_engine(), user_));
    reordered_ = true;
  }

  // The memory the primitive reads: Paddle's buffer itself, or a copy in the chosen layout.
  memory input(const float* data) const {
    memory user(user_, cpu_engine(), const_cast<float*>(data));
    if (!reordered_) return user;
    memory scratch(chosen_, cpu_engine());
    to_chosen_.execute(cpu_stream(), user, scratch);
    return scratch;
  }

  // The memory the primitive writes; finish() then copies it into Paddle's buffer where it is a scratch buffer.
  memory output(float* data) const {
    return reordered_ ? memory(chosen_, cpu_engine()) : memory(user_, cpu_engine(), data);
  }

  void finish(memory written, float* data) const {
    if (!reordered_) return;
    memory user(user_, cpu_engine(), data);
    to_user_.execute(cpu_stream(), written, user);
  }

 private:
  memory::desc user_, chosen_;
  dnnl::reorder to_chosen_, to_user_;
  bool reordered_ = false;
};

// The output size and the right and bottom padding of a convolution over one side of `in` pixels, so that oneDNN's
// output is exactly F.conv2d's: the far padding may be less than `padding` where the stride leaves input over.
struct ConvSide {
  int64_t out, pad_right;
};

inline ConvSide conv_side(int64_t in, int64_t kernel, int stride, int padding) {
  const int64_t out = (in + 2 * padding - kernel) / stride + 1;
  return {out, (out - 1) * stride + kernel - in - padding};
}

// How many convolution primitives this process made on oneDNN's reference loops, which go element by element (a
// processor without the instructions of oneDNN's JIT kernels for a layout): what onednn_reference_kernels reports,
// and what the start-up check refuses (selfcheck.py).
inline std::atomic<int64_t>& reference_kernels() {
  static std::atomic<int64_t> count{0};
  return count;
}

inline void note_kernel(const dnnl::primitive_desc& pd) {
  const std::string kernel = pd.impl_info_str();
  if (kernel.find("ref") != std::string::npos) ++reference_kernels();
}

// How many plans the caches of all operators keep, together (what onednn_kept_plans reports).
inline std::atomic<int64_t>& kept_plans() {
  static std::atomic<int64_t> count{0};
  return count;
}

// The plans of one operator by shape, the kCapacity most recently used kept. A training step reaches the same few
// dozen shapes every step; a plan is kept only by the caller that will use it again (a backward pass: see
// find_or_make), so evaluation, which runs forward passes only, at whatever batch size, never adds one. Any thread
// may call it; a plan is shared, so one dropped while another call runs it lives until that call returns.
template <typename Key, typename Plan>
class PlanCache {
 public:
  static constexpr size_t kCapacity = 64;

  // The plan kept for key, else null.
  std::shared_ptr<const Plan> find(const Key& key) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = index_.find(key);
    if (found == index_.end()) return nullptr;
    order_.splice(order_.begin(), order_, found->second);
    return found->second->second;
  }

  // The plan kept for key, else one made by make(): kept where keep is true, else the caller's alone.
  template <typename Make>
  std::shared_ptr<const Plan> find_or_make(const Key& key, bool keep, Make make) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto found = index_.find(key);
      if (found != index_.end()) {
        order_.splice(order_.begin(), order_, found->second);  // the most recently used first
        return found->second->second;
      }
    }
    std::shared_ptr<const Plan> plan = make();  // outside the lock: making one takes milliseconds
    if (!keep) return plan;
    std::lock_guard<std::mutex> lock(mutex_);
    auto found = index_.find(key);
    if (found != index_.end()) return found->second->second;  // another thread kept one meanwhile
    order_.emplace_front(key, plan);
    index_.emplace(key, order_.begin());
    ++kept_plans();
    if (order_.size() > kCapacity) {
      index_.erase(order_.back().first);
      order_.pop_back();
      --kept_plans();
    }
    return plan;
  }

 private:
  using Entry = std::pair<Key, std::shared_ptr<const Plan>>;
  std::mutex mutex_;
  std::list<Entry> order_;
  std::map<Key, typename std::list<Entry>::iterator> index_;
};

// The OpenMP threads of the calling thread's next parallel regions, which oneDNN reads as it makes and runs a
// primitive, set to n in every OpenMP runtime loaded (GNU's, which libdnnl.so.3 is linked against, and Intel's,
// which MKL brings and which can serve oneDNN's calls in its place: runtime/cpu.py's set_openmp_threads sets both too), and
// restored when this goes out of scope; n <= 0 changes nothing. A runtime that is not loaded is left alone.
class OpenMPThreads {
 public:
  explicit OpenMPThreads(int n) {
    if (n <= 0) return;
    for (const char* name : {"libgomp.so.1", "libiomp5.so"}) {
      void* runtime = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
      if (runtime == nullptr) continue;
      auto get = reinterpret_cast<int (*)()>(dlsym(runtime, "omp_get_max_threads"));
      auto set = reinterpret_cast<void (*)(int)>(dlsym(runtime, "omp_set_num_threads"));
      dlclose(runtime);  // loaded before this library and kept: the functions stay valid
      if (get == nullptr || set == nullptr) continue;
      kept_.push_back({set, get()});
      set(n);
    }
  }
  ~OpenMPThreads() {
    for (const auto& [set, threads] : kept_) set(threads);
  }

 private:
  std::vector<std::pair<void (*)(int), int>> kept_;
};

// A team of the OpenMP threads oneDNN's kernels run on, through the runtime's GNU interface (GOMP_parallel, which
// Intel's runtime offers too): Intel's where it is loaded (MKL brings it, and the libdnnl.so.3 of Paddle's wheels
// then binds its calls to it, before GNU's, which it is linked against), else GNU's. Its threads are the ones
// already waiting for oneDNN's next kernel; threads of another runtime would compete with them for the cores.
class Team {
 public:
  static const Team& get() {
    static const Team team;
    return team;
  }
  bool usable() const { return parallel_ && barrier_ && thread_num_ && num_threads_ && max_threads_; }
  int max_threads() const { return max_threads_(); }
  // body(thread, threads) on a team of up to n threads; barrier() inside it waits for the team's other threads.
  // An exception may not leave a thread of the team: one out of body ends that thread's part (a body with barriers
  // must let one out only after its last, where the others would wait for it), and the first one's message is
  // returned once the team ends; empty where none was.
  std::string run(int n, const std::function<void(int, int)>& body) const {
    struct Call {
      const Team* team;
      const std::function<void(int, int)>* body;
      std::mutex lock;
      std::string failure;
    } call{this, &body, {}, {}};
    parallel_(
        [](void* data) {
          auto* c = static_cast<Call*>(data);
          try {
            (*c->body)(c->team->thread_num_(), c->team->num_threads_());
          } catch (const std::exception& e) {
            std::lock_guard<std::mutex> lock(c->lock);
            if (c->failure.empty()) c->failure = e.what();
          }
        },
        &call, static_cast<unsigned>(n), 0);
    return call.failure;
  }
  void barrier() const { barrier_(); }
  // body(first, last) over the items 0 to count - 1: split among `threads` threads of the team, in contiguous runs,
  // or all on the calling thread where threads is 1 or fewer. A failure in the team throws, naming op.
  void share(int64_t threads, int64_t count, const char* op,
             const std::function<void(int64_t, int64_t)>& body) const {
    if (threads <= 1) {
      body(0, count);
      return;
    }
    const std::string failure = run(static_cast<int>(threads), [&](int t, int team_size) {
      body(count * t / team_size, count * (t + 1) / team_size);
    });
    if (!failure.empty()) throw std::runtime_error(std::string(op) + ": " + failure);
  }

 private:
  Team() {
    for (const char* name : {"libiomp5.so", "libgomp.so.1"}) {
      void* runtime = dlopen(name, RTLD_LAZY | RTLD_NOLOAD);
      if (runtime == nullptr) continue;
      parallel_ = reinterpret_cast<void (*)(void (*)(void*), void*, unsigned, unsigned)>(
          dlsym(runtime, "GOMP_parallel"));
      barrier_ = reinterpret_cast<void (*)()>(dlsym(runtime, "GOMP_barrier"));
      thread_num_ = reinterpret_cast<int (*)()>(dlsym(runtime, "omp_get_thread_num"));
      num_threads_ = reinterpret_cast<int (*)()>(dlsym(runtime, "omp_get_num_threads"));
      max_threads_ = reinterpret_cast<int (*)()>(dlsym(runtime, "omp_get_max_threads"));
      dlclose(runtime);  // loaded before this library and kept: the functions stay valid
      if (usable()) return;
    }
  }
  void (*parallel_)(void (*)(void*), void*, unsigned, unsigned) = nullptr;
  void (*barrier_)() = nullptr;
  int (*thread_num_)() = nullptr;
  int (*num_threads_)() = nullptr;
  int (*max_threads_)() = nullptr;
};

}  // namespace paddle_mnist
