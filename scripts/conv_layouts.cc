// The layouts of one convolution side by side, in oneDNN alone: forward, backward-data and backward-weights (image
// by image, or for the whole batch) of a batch of 64, with the maps in oneDNN's choice ("any": blocked by 16 with
// AVX-512, 8 with AVX2) and in NHWC, the cases interleaved round after round (40 rounds, the first 3 dropped) so a
// slow spell of a shared VM falls on all of them; medians in ms, one thread. What csrc/onednn_conv.cc's
// maps_layout was chosen on (docs/performance.md, "NHWC where blocking pads the channels").
//
// Built against the libdnnl.so.3 that Paddle's CPU wheel ships, with the onednn-devel-cpu-gomp headers
// (requirements.txt), from the repository root with the virtual environment active:
//
//   L=$(python -c "import paddle, os; print(os.path.join(os.path.dirname(paddle.__file__), 'libs'))")
//   g++ -O2 -std=c++17 scripts/conv_layouts.cc -I"$VIRTUAL_ENV/include" -L"$L" -l:libdnnl.so.3 -Wl,-rpath,"$L" -o /tmp/conv_layouts
//   OMP_NUM_THREADS=1 /tmp/conv_layouts mnist      # mnist_cnn's two convolutions
//   OMP_NUM_THREADS=1 /tmp/conv_layouts cifar      # cifar_cnn's four
//   ONEDNN_MAX_CPU_ISA=AVX2 OMP_NUM_THREADS=1 /tmp/conv_layouts mnist   # as on a processor without AVX-512

// the headers package enables oneDNN's experimental sparse memory, which Paddle's libdnnl.so.3 does not export
#include "oneapi/dnnl/dnnl_config.h"
#undef DNNL_EXPERIMENTAL_SPARSE
#include "oneapi/dnnl/dnnl.hpp"
#include <chrono>
#include <cstdio>
#include <vector>
#include <string>
#include <algorithm>
#include <memory>
using namespace dnnl; using tag = memory::format_tag; using dt = memory::data_type;
engine eng(engine::kind::cpu, 0); stream s(eng);
double now(){return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();}
memory::desc D(memory::dims d, tag t){return memory::desc(d, dt::f32, t);}
const char* tn(tag t){return t==tag::nhwc?"nhwc":t==tag::nChw8c?"8c":t==tag::nChw16c?"16c":t==tag::nchw?"nchw":"any";}
struct Case {
  std::string name; int N, wb; convolution_forward f; convolution_backward_data bd; convolution_backward_weights bw;
  memory S, W, O, DW, DS, DD, WW, s1m, d1m; size_t sstride, dstride; std::vector<double> t{std::vector<double>(3, 0)};
  std::vector<std::vector<double>> all{std::vector<std::vector<double>>(3)};
  Case(const char* nm, int N_, int IC, int OC, int H, int K, int P, tag st, int wb_mb) : N(N_), wb(wb_mb) {
    int HO=H+2*P-K+1; memory::dims src{N,IC,H,H}, wei{OC,IC,K,K}, dst{N,OC,HO,HO}, str{1,1}, pad{P,P};
    auto fpd = convolution_forward::primitive_desc(eng, prop_kind::forward_training, algorithm::convolution_direct, D(src,st), D(wei,tag::any), D(dst,st), str, pad, pad);
    auto dpd = convolution_backward_data::primitive_desc(eng, algorithm::convolution_direct, D(src,st), D(wei,tag::any), D(dst,st), str, pad, pad, fpd);
    memory::dims s1{wb_mb,IC,H,H}, d1{wb_mb,OC,HO,HO};
    auto hint1 = convolution_forward::primitive_desc(eng, prop_kind::forward_training, algorithm::convolution_direct, D(s1,st), D(wei,tag::any), D(d1,st), str, pad, pad);
    auto wpd = convolution_backward_weights::primitive_desc(eng, algorithm::convolution_direct, D(s1,st), D(wei,tag::any), D(d1,st), str, pad, pad, hint1);
    S=memory(fpd.src_desc(), eng); W=memory(fpd.weights_desc(), eng); O=memory(fpd.dst_desc(), eng); DW=memory(dpd.weights_desc(), eng);
    DS=memory(dpd.diff_src_desc(), eng); DD=memory(dpd.diff_dst_desc(), eng); WW=memory(wpd.diff_weights_desc(), eng);
    s1m=memory(wpd.src_desc(), eng, DNNL_MEMORY_NONE); d1m=memory(wpd.diff_dst_desc(), eng, DNNL_MEMORY_NONE);
    for (auto* m : {&S,&W,&DW,&DD}) { float* p=(float*)m->get_data_handle(); size_t n=m->get_desc().get_size()/4; for (size_t i=0;i<n;i++) p[i]=0.01f*(i%97); }
    f=convolution_forward(fpd); bd=convolution_backward_data(dpd); bw=convolution_backward_weights(wpd);
    sstride = wpd.src_desc().get_size()/4; dstride = wpd.diff_dst_desc().get_size()/4;
    char b[300]; snprintf(b, 300, "%-5s ic%2d oc%2d %2d %-4s wb%-2d [%s|%s|%s]", nm, IC, OC, H, tn(st), wb_mb, fpd.impl_info_str(), dpd.impl_info_str(), wpd.impl_info_str()); name=b;
  }
  void once() {
    double a=now(); f.execute(s,{{DNNL_ARG_SRC,S},{DNNL_ARG_WEIGHTS,W},{DNNL_ARG_DST,O}}); s.wait(); double b=now();
    bd.execute(s,{{DNNL_ARG_DIFF_DST,DD},{DNNL_ARG_WEIGHTS,DW},{DNNL_ARG_DIFF_SRC,DS}}); s.wait(); double c=now();
    float* sp=(float*)S.get_data_handle(); float* dp=(float*)DD.get_data_handle();
    for (int i=0;i<N/wb;i++){ s1m.set_data_handle(sp+i*sstride); d1m.set_data_handle(dp+i*dstride);
      bw.execute(s,{{DNNL_ARG_SRC,s1m},{DNNL_ARG_DIFF_DST,d1m},{DNNL_ARG_DIFF_WEIGHTS,WW}}); s.wait(); }
    double d=now(); all[0].push_back(b-a); all[1].push_back(c-b); all[2].push_back(d-c);
  }
};
int main(int argc, char** argv){
  std::string which = argc > 1 ? argv[1] : "mnist";
  std::vector<std::unique_ptr<Case>> cs;
  auto add = [&](const char* n, int IC, int OC, int H, int K, int P) { for (tag t : {tag::any, tag::nhwc}) for (int mb : {1, 64}) cs.emplace_back(new Case(n, 64, IC, OC, H, K, P, t, mb)); };
  if (which == "mnist") { add("conv2", 20, 20, 14, 5, 2); add("conv1", 1, 20, 28, 5, 2); }
  else { add("c1", 3, 32, 32, 3, 1); add("c2", 32, 32, 32, 3, 0); add("c3", 32, 64, 15, 3, 1); add("c4", 64, 64, 15, 3, 0); }
  for (int r = 0; r < 40; r++) for (auto& c : cs) c->once();
  for (auto& c : cs) { printf("%s", c->name.c_str()); for (int k=0;k<3;k++){ auto v=c->all[k]; v.erase(v.begin(), v.begin()+3); std::sort(v.begin(), v.end()); printf("  %s %6.2f", k==0?"fwd":k==1?"bwd_d":"bwd_w", v[v.size()/2]*1e3);} printf(" ms (medians)\n"); }
}
