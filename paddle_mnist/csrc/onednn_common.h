// What the oneDNN operators of onednn_conv.cc and blocked.cc share: the CPU engine and stream (one each for the
// process), plain and chosen memory descriptions, and Operand, which moves a buffer between Paddle's layout and
// the one a primitive chose.

#pragma once

#include <cstdint>
#include <string>
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

// Whether oneDNN implements a primitive with a direct kernel: neither im2col and a GEMM nor the reference loops,
// which go element by element.
inline bool direct(const dnnl::primitive_desc& pd) {
  const std::string kernel = pd.impl_info_str();
  return kernel.find("ref") == std::string::npos && kernel.find("gemm") == std::string::npos;
}

// One operand of one primitive: Paddle's buffer in its layout (NCHW unless given), and the layout the primitive
// chose for it. Where the two differ, a scratch buffer in the chosen layout and the reorders between the two.
class Operand {
 public:
  Operand(const Dims& dims, const memory::desc& chosen) : Operand(nchw(dims), chosen) {}
  Operand(const memory::desc& user, const memory::desc& chosen) : user_(user) {
    if (chosen == user_) return;
    scratch_ = memory(chosen, cpu_engine());
    to_chosen_ = dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), user_, cpu_engine(), chosen));
    to_user_ = dnnl::reorder(dnnl::reorder::primitive_desc(cpu_engine(), chosen, cpu_engine(), user_));
    reordered_ = true;
  }

  // The memory the primitive reads: Paddle's buffer itself, or its copy in the chosen layout.
  memory input(const float* data) {
    memory user(user_, cpu_engine(), const_cast<float*>(data));
    if (!reordered_) return user;
    to_chosen_.execute(cpu_stream(), user, scratch_);
    return scratch_;
  }

  // The memory the primitive writes; finish() then copies it into Paddle's buffer where it is a scratch buffer.
  memory output(float* data) { return reordered_ ? scratch_ : memory(user_, cpu_engine(), data); }

  void finish(float* data) {
    if (!reordered_) return;
    memory user(user_, cpu_engine(), data);
    to_user_.execute(cpu_stream(), scratch_, user);
  }

 private:
  memory::desc user_;
  memory scratch_;
  dnnl::reorder to_chosen_, to_user_;
  bool reordered_ = false;
};

}  // namespace paddle_mnist
