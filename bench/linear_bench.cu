// Fused linear cross-entropy benchmark (CUDA, bfloat16): forward + all gradients through the
// public entry point, against the floor measured in the same run, the three bare cuBLASLt
// products of forward + backward at full size:
//   logits (N x V) = hidden (N x H) . weight^T;  grad_hidden = dlogits . weight;
//   grad_weight (float32) = dlogits^T . hidden.
// FLOPs counted: 6 N H V (the floor's three products). Extra memory: the workspace the call asks
// for (linear_cross_entropy_workspace_size), given to it explicitly, so nothing else is taken.
// Timing: CUDA events, after warm-up, median of `iters` runs.
// Usage: fusedce_linear_bench [--quick] [--csv FILE] [--shape N H V]... [--profile N H V] [--graph [N H V]]
//                             [--options] [--form window|logits] [--iters N]
//   --shape N H V (repeatable): these shapes instead of the default list, every target valid.
//   --options: after the modes, each option alone (bias_only: a bias and grad_bias; metrics_only;
//   smoothing_z_scale: label smoothing 0.1, z-loss 1e-4 and logit scale 0.9, the options that
//   ride the window form's merge and products; softcap_only: 30), against `default`.
//   --form window|logits: every call in that chunk form where the call allows it
//   (detail::LinearForm, through the internal call the public entry point builds), whatever the
//   planner picks: what an option costs each form (the variant names get "@window" or "@logits").
//   --iters N: N timed runs a row (default 10, with --quick 3): a larger N holds each variant on
//   the GPU long enough for a clock and power trace beside the run (nvidia-smi) to resolve it,
//   aligned with the rows by their print times and with each shape's floor by the "# floor
//   measured" line on stderr.
//   --graph: skip_ignored with and without CUDA graph capture at one shape (default
//   8192 x 4096 x 128256), every target valid and half of them ignored, on a stream of its own:
//   eager (the synced path), captured once and replayed, and the cost of a graph of one's own
//   per call (capture + instantiate + launch + destroy), with capture and instantiation timed
//   on the host.
//   --csv FILE: one line per row of the printed table (bench/make_results.py reads it into
//   bench/RESULTS.md): gpu, N, H, V, dtype, ignored (the share of ignored targets), variant
//   (default, skip_ignored, low_memory, chunks_448MiB, all_options, options_no_softcap),
//   fused_ms, fused_tflops, floor_ms, floor_tflops (the floor's GEMM rate), x_floor,
//   workspace_mib, host_ms (the median time the host takes to return from the fused call, which
//   enqueues its work without waiting unless an option needs a value back: near fused_ms, the
//   host and not the GPU sets the pace).
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/call.h"
#include "fusedce/fusedce.h"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)
#define CKB(x)                                                                                \
  do {                                                                                        \
    cublasStatus_t s_ = (x);                                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                        \
      std::fprintf(stderr, "%s:%d %s: cublas status %d\n", __FILE__, __LINE__, #x, (int)s_); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace {

using bf16 = __nv_bfloat16;
using fusedce::DType;

void ok(const fusedce::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "fusedce: %s\n", s.message().c_str());
    std::exit(1);
  }
}

/// The floor's products: D (m x n, col-major) = op(A) op(B), bf16 operands, float32 accumulation.
struct BareGemm {
  cublasLtHandle_t lt;
  void* ws;
  size_t ws_bytes = size_t(32) << 20;
  BareGemm() {
    CKB(cublasLtCreate(&lt));
    CK(cudaMalloc(&ws, ws_bytes));
  }
  void run(cublasOperation_t opa, cublasOperation_t opb, int64_t m, int64_t n, int64_t k, const void* A, int64_t lda,
           const void* B, int64_t ldb, void* D, int64_t ldd, cudaDataType_t dtype) {
    cublasLtMatmulDesc_t desc;
    CKB(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
    CKB(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
    cublasLtMatrixLayout_t la, lb, ld;
    CKB(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, opa == CUBLAS_OP_N ? m : k, opa == CUBLAS_OP_N ? k : m, lda));
    CKB(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, opb == CUBLAS_OP_N ? k : n, opb == CUBLAS_OP_N ? n : k, ldb));
    CKB(cublasLtMatrixLayoutCreate(&ld, dtype, m, n, ldd));
    cublasLtMatmulPreference_t pref;
    CKB(cublasLtMatmulPreferenceCreate(&pref));
    CKB(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
    cublasLtMatmulHeuristicResult_t heur;
    int found = 0;
    CKB(cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, ld, ld, pref, 1, &heur, &found));
    if (found == 0) std::exit(3);
    const float alpha = 1.0f, beta = 0.0f;
    CKB(cublasLtMatmul(lt, desc, &alpha, A, la, B, lb, &beta, D, ld, D, ld, &heur.algo, ws, ws_bytes, nullptr));
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(desc);
  }
};

template <typename F>
double median_ms(F&& fn, int iters, double* host_ms = nullptr) {
  if (iters <= 0) {  // profile mode: one run, no timing (the profiler times each kernel)
    fn();
    CK(cudaDeviceSynchronize());
    return 0.0;
  }
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  fn();
  fn();
  std::vector<double> ms, host;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a));
    const auto h0 = std::chrono::steady_clock::now();
    fn();
    host.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - h0).count());
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  std::sort(host.begin(), host.end());
  if (host_ms) *host_ms = host[host.size() / 2];
  return ms[ms.size() / 2];
}

__global__ void fill_random(bf16* p, int64_t n, float scale, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    // a sum of two uniforms: roughly bell-shaped, mean 0
    const float u = (x & 0xffff) / 65536.0f + (x >> 16) / 65536.0f - 1.0f;
    p[i] = __float2bfloat16_rn(u * scale * 2.4f);
  }
}

struct Shape {
  int64_t N, H, V;
  bool half_ignored;
};

// The name of each mode of `bench` in the CSV (bench/make_results.py knows these names).
const char* const kModeNames[] = {"default",  "skip_ignored", "low_memory",   "chunks_448MiB",     "all_options",
                                  "options_no_softcap", "bias_only", "metrics_only", "smoothing_z_scale", "softcap_only"};

/// The linear call: the public entry point's, with chunk form `form` (kAuto: the planner's).
fusedce::Status linear_call(fusedce::detail::LinearForm form, const fusedce::Device& dev, const fusedce::MatrixView& hidden,
                            const fusedce::MatrixView& weight, const fusedce::VectorView& bias,
                            const fusedce::VectorView& target, const fusedce::Options& o, const fusedce::LinearOptions& lo,
                            const fusedce::ForwardOutputs& out, const fusedce::LinearGrads& g, fusedce::Workspace ws) {
  fusedce::detail::LinearCall call =
      fusedce::detail::forward_backward_call(dev, hidden, weight, bias, target, o, lo, out, {}, g, ws);
  call.form = form;
  return fusedce::detail::run_linear_call(call);
}

void bench(const Shape& s, BareGemm& bare, int iters, bool with_low_memory, bool per_option,
           fusedce::detail::LinearForm form, const char* gpu, FILE* csv) {
  const int64_t N = s.N, H = s.H, V = s.V;
  bf16 *hid, *w, *gh, *gw, *full;
  CK(cudaMalloc(&hid, N * H * 2));
  CK(cudaMalloc(&w, V * H * 2));
  CK(cudaMalloc(&gh, N * H * 2));
  CK(cudaMalloc(&gw, V * H * 2));
  fill_random<<<1024, 256>>>(hid, N * H, 1.0f, 1);
  fill_random<<<1024, 256>>>(w, V * H, 2.0f / std::sqrt(float(H)), 2);
  std::vector<int64_t> t(N);
  std::mt19937 rng(11);
  for (int64_t i = 0; i < N; ++i) t[i] = s.half_ignored && i % 2 ? -100 : int64_t(rng() % V);
  int64_t* dt;
  CK(cudaMalloc(&dt, N * 8));
  CK(cudaMemcpy(dt, t.data(), N * 8, cudaMemcpyHostToDevice));
  float *loss, *lse;
  CK(cudaMalloc(&loss, 4));
  CK(cudaMalloc(&lse, N * 4));
  const double flops = 6.0 * N * H * V;

  // The floor: the three bare products at full size.
  CK(cudaMalloc(&full, size_t(N) * V * 2));
  float* gw32;
  CK(cudaMalloc(&gw32, size_t(V) * H * 4));
  const double t_floor = median_ms([&] {
    bare.run(CUBLAS_OP_T, CUBLAS_OP_N, V, N, H, w, H, hid, H, full, V, CUDA_R_16BF);
    bare.run(CUBLAS_OP_N, CUBLAS_OP_N, H, N, V, w, H, full, V, gh, H, CUDA_R_16BF);
    bare.run(CUBLAS_OP_N, CUBLAS_OP_T, H, V, N, hid, H, full, V, gw32, H, CUDA_R_32F);
  }, iters);
  std::fprintf(stderr, "# floor measured\n");
  CK(cudaFree(full));
  CK(cudaFree(gw32));

  // Modes: 0 default, 1 skip_ignored (half-ignored shapes only), 2 low_memory, 3 the logits
  // capped at 448 MiB a chunk (all extra memory within 512 MiB plus the float32 accumulator),
  // 4 every option at once (bias and its gradient, label smoothing, z-loss, logit scale,
  // soft-cap, metrics), 5 the same without the soft-cap (which with label smoothing keeps the
  // logits path: window_plan.h); with --options, 6-9 one option each (kModeNames).
  bf16 *bias, *gb;
  CK(cudaMalloc(&bias, V * 2));
  CK(cudaMalloc(&gb, V * 2));
  fill_random<<<64, 256>>>(bias, V, 0.5f, 3);
  int64_t* correct;
  float* entropy;
  CK(cudaMalloc(&correct, 8));
  CK(cudaMalloc(&entropy, 4));
  const char* form_tag = form == fusedce::detail::LinearForm::kWindow   ? "@window"
                         : form == fusedce::detail::LinearForm::kLogits ? "@logits"
                                                                         : "";
  for (int mode : {0, 1, 2, 3, 4, 5, 6, 7, 8, 9}) {
    if ((mode == 1 && !s.half_ignored) || (mode >= 2 && (s.half_ignored || !with_low_memory))) continue;
    if (mode >= 6 && !per_option) continue;
    const bool skip = mode == 1;
    const bool all = mode == 4 || mode == 5;
    const bool with_bias = all || mode == 6;
    const bool metrics = all || mode == 7;
    fusedce::Options o;
    o.return_metrics = mode == 7;
    if (mode == 8) {
      o.label_smoothing = 0.1f;
      o.z_loss = 1e-4f;
      o.logit_scale = 0.9f;
    }
    if (mode == 9) o.softcap = 30.0f;
    if (all) {
      o.label_smoothing = 0.1f;
      o.z_loss = 1e-4f;
      o.logit_scale = 0.9f;
      o.softcap = mode == 4 ? 30.0f : 0.0f;
      o.return_metrics = true;
    }
    fusedce::LinearOptions lo;
    lo.skip_ignored = skip;
    lo.low_memory = mode == 2;
    if (mode == 3) lo.chunk_budget_bytes = size_t(448) << 20;
    fusedce::LinearGrads g;
    g.grad_hidden = fusedce::matrix(gh, DType::kBFloat16, N, H);
    g.grad_weight = fusedce::matrix(gw, DType::kBFloat16, V, H);
    if (with_bias) g.grad_bias = fusedce::vector(gb, DType::kBFloat16, V);
    const fusedce::Device dev = fusedce::Device::cuda(0, nullptr);
    const size_t ws_bytes =
        fusedce::cuda::linear_workspace_size(fusedce::Job::kForwardBackward, dev, N, H, V, DType::kBFloat16, o, lo, g, form);
    void* ws;
    CK(cudaMalloc(&ws, ws_bytes));
    fusedce::ForwardOutputs out;
    out.loss = fusedce::vector(loss, DType::kFloat32, 1);
    out.lse = fusedce::vector(lse, DType::kFloat32, N);
    if (metrics) {
      out.num_correct = fusedce::vector(correct, DType::kInt64, 1);
      out.entropy_sum = fusedce::vector(entropy, DType::kFloat32, 1);
    }
    double t_host = 0.0;
    const double t_fused = median_ms([&] {
      ok(linear_call(form, dev, fusedce::matrix(hid, DType::kBFloat16, N, H), fusedce::matrix(w, DType::kBFloat16, V, H),
                     with_bias ? fusedce::vector(bias, DType::kBFloat16, V) : fusedce::VectorView{},
                     fusedce::vector(dt, DType::kInt64, N), o, lo, out, g, fusedce::Workspace{ws, ws_bytes}));
    }, iters, &t_host);
    std::printf("| %lld x %lld x %lld%s | %.2f ms | %.0f | %.2f ms (%.0f TFLOP/s) | %.3f | %.0f MiB |\n",
                (long long)N, (long long)H, (long long)V,
                mode >= 2 ? (std::string(" ") + kModeNames[mode] + form_tag).c_str()
                : s.half_ignored ? (skip ? " half ignored, skip_ignored" : " half ignored") : form_tag, t_fused,
                flops / t_fused / 1e9, t_floor, flops / t_floor / 1e9, t_fused / t_floor, ws_bytes / 1048576.0);
    std::fflush(stdout);
    if (csv) {
      std::fprintf(csv, "%s,%lld,%lld,%lld,bfloat16,%s,%s,%.4f,%.1f,%.4f,%.1f,%.4f,%.1f,%.4f\n", gpu, (long long)N, (long long)H,
                   (long long)V, s.half_ignored ? "0.5" : "0", (kModeNames[mode] + std::string(form_tag)).c_str(), t_fused, flops / t_fused / 1e9, t_floor,
                   flops / t_floor / 1e9, t_fused / t_floor, ws_bytes / 1048576.0, t_host);
      std::fflush(csv);
    }
    CK(cudaFree(ws));
  }
  for (void* p : {(void*)hid, (void*)w, (void*)gh, (void*)gw, (void*)dt, (void*)loss, (void*)lse, (void*)bias, (void*)gb,
                  (void*)correct, (void*)entropy}) {
    CK(cudaFree(p));
  }
}

/// Milliseconds of fn's GPU work on `stream`: median of `iters` after two warm-ups.
template <typename F>
double stream_ms(cudaStream_t stream, F&& fn, int iters) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  fn();
  fn();
  CK(cudaStreamSynchronize(stream));
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventRecord(a, stream));
    fn();
    CK(cudaEventRecord(b, stream));
    CK(cudaEventSynchronize(b));
    float t;
    CK(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  CK(cudaEventDestroy(a));
  CK(cudaEventDestroy(b));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

double host_ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

/// --graph: skip_ignored eager (synced) against captured (conditional nodes sized on the device).
void bench_graph(int64_t N, int64_t H, int64_t V, int iters) {
  cudaStream_t stream;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  bf16 *hid, *w, *gh, *gw;
  CK(cudaMalloc(&hid, N * H * 2));
  CK(cudaMalloc(&w, V * H * 2));
  CK(cudaMalloc(&gh, N * H * 2));
  CK(cudaMalloc(&gw, V * H * 2));
  fill_random<<<1024, 256>>>(hid, N * H, 1.0f, 1);
  fill_random<<<1024, 256>>>(w, V * H, 2.0f / std::sqrt(float(H)), 2);
  std::vector<int64_t> all(N), half(N);
  std::mt19937 rng(11);
  for (int64_t i = 0; i < N; ++i) {
    all[i] = int64_t(rng() % V);
    half[i] = i % 2 ? -100 : all[i];
  }
  int64_t* dt;
  float *loss, *lse;
  CK(cudaMalloc(&dt, N * 8));
  CK(cudaMalloc(&loss, 4));
  CK(cudaMalloc(&lse, N * 4));
  CK(cudaDeviceSynchronize());
  fusedce::Options o;
  fusedce::LinearOptions lo;
  lo.skip_ignored = true;
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(gh, DType::kBFloat16, N, H);
  g.grad_weight = fusedce::matrix(gw, DType::kBFloat16, V, H);
  const fusedce::Device dev = fusedce::Device::cuda(0, stream);
  const size_t ws_bytes = fusedce::linear_cross_entropy_workspace_size(fusedce::Job::kForwardBackward, dev, N, H, V,
                                                                       DType::kBFloat16, o, lo, g);
  void* ws;
  CK(cudaMalloc(&ws, ws_bytes));
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(loss, DType::kFloat32, 1);
  out.lse = fusedce::vector(lse, DType::kFloat32, N);
  auto call = [&] {
    ok(fusedce::linear_cross_entropy_forward_backward(dev, fusedce::matrix(hid, DType::kBFloat16, N, H),
                                                      fusedce::matrix(w, DType::kBFloat16, V, H), {},
                                                      fusedce::vector(dt, DType::kInt64, N), o, lo, out, {}, g,
                                                      fusedce::Workspace{ws, ws_bytes}));
  };
  auto set_targets = [&](const std::vector<int64_t>& t) {
    CK(cudaMemcpyAsync(dt, t.data(), N * 8, cudaMemcpyHostToDevice, stream));
    CK(cudaStreamSynchronize(stream));
  };
  double capture_ms = 0.0, instantiate_ms = 0.0;
  size_t nodes = 0;
  auto capture = [&](cudaGraphExec_t* exec) {
    cudaGraph_t graph;
    auto t0 = std::chrono::steady_clock::now();
    CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    call();
    CK(cudaStreamEndCapture(stream, &graph));
    capture_ms = host_ms_since(t0);
    CK(cudaGraphGetNodes(graph, nullptr, &nodes));
    t0 = std::chrono::steady_clock::now();
    CK(cudaGraphInstantiate(exec, graph, 0));
    instantiate_ms = host_ms_since(t0);
    CK(cudaGraphDestroy(graph));
  };
  std::printf("\n# skip_ignored, %lld x %lld x %lld bfloat16, forward + grad_hidden + grad_weight, own stream\n",
              (long long)N, (long long)H, (long long)V);
  std::printf("| targets | eager (synced) | captured replay | own graph per call (capture + instantiate + launch) |"
              " host: capture | host: instantiate | top-level nodes |\n|---|---|---|---|---|---|---|\n");
  double eager[2], replay[2];
  for (int h = 0; h < 2; ++h) {
    set_targets(h ? half : all);
    eager[h] = stream_ms(stream, call, iters);
    cudaGraphExec_t exec;
    capture(&exec);
    replay[h] = stream_ms(stream, [&] { CK(cudaGraphLaunch(exec, stream)); }, iters);
    CK(cudaGraphExecDestroy(exec));
    const double own = stream_ms(stream, [&] {
      cudaGraphExec_t e;
      capture(&e);
      CK(cudaGraphLaunch(e, stream));
      CK(cudaGraphExecDestroy(e));
    }, iters);
    std::printf("| %s | %.3f ms | %.3f ms | %.3f ms | %.3f ms | %.3f ms | %zu |\n", h ? "half ignored" : "all valid",
                eager[h], replay[h], own, capture_ms, instantiate_ms, nodes);
    std::fflush(stdout);
  }
  // One graph, the count changing under it: captured with every target valid, replayed on half.
  set_targets(all);
  cudaGraphExec_t exec;
  capture(&exec);
  set_targets(half);
  const double follow = stream_ms(stream, [&] { CK(cudaGraphLaunch(exec, stream)); }, iters);
  CK(cudaGraphExecDestroy(exec));
  std::printf("\nhalf ignored / all valid: eager %.3f, captured replay %.3f (graph captured on all-valid targets, "
              "replayed on half-ignored: %.3f ms, %.3f of all valid)\n",
              eager[1] / eager[0], replay[1] / replay[0], follow, follow / replay[0]);
  for (void* p : {(void*)hid, (void*)w, (void*)gh, (void*)gw, (void*)dt, (void*)loss, (void*)lse, ws}) CK(cudaFree(p));
  CK(cudaStreamDestroy(stream));
}

}  // namespace

int main(int argc, char** argv) {
  // --quick: fewer shapes and runs. --profile N H V: one shape, one timed run of each mode (for
  // ncu: the per-kernel times of the fused call beside the bare products').
  // --csv FILE: the table's rows as CSV too.
  bool quick = false;
  Shape one{0, 0, 0, false};
  const char* csv_path = nullptr;
  Shape graph{0, 0, 0, true};
  std::vector<Shape> given;
  bool per_option = false;
  int iters_given = 0;
  fusedce::detail::LinearForm form = fusedce::detail::LinearForm::kAuto;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      quick = true;
    } else if (std::strcmp(argv[i], "--graph") == 0) {
      graph = Shape{8192, 4096, 128256, true};
      if (i + 3 < argc && argv[i + 1][0] != '-') {
        graph = Shape{std::atoll(argv[i + 1]), std::atoll(argv[i + 2]), std::atoll(argv[i + 3]), true};
        i += 3;
      }
    } else if (std::strcmp(argv[i], "--profile") == 0 && i + 3 < argc) {
      one = Shape{std::atoll(argv[i + 1]), std::atoll(argv[i + 2]), std::atoll(argv[i + 3]), false};
      i += 3;
    } else if (std::strcmp(argv[i], "--shape") == 0 && i + 3 < argc) {
      given.push_back(Shape{std::atoll(argv[i + 1]), std::atoll(argv[i + 2]), std::atoll(argv[i + 3]), false});
      i += 3;
      if (given.back().N <= 0 || given.back().H <= 0 || given.back().V <= 0) {
        std::fprintf(stderr, "fusedce_linear_bench: --shape: N, H and V must be positive\n");
        return 2;
      }
    } else if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters_given = std::atoi(argv[++i]);
      if (iters_given <= 0) {
        std::fprintf(stderr, "fusedce_linear_bench: --iters: a positive count, got \"%s\"\n", argv[i]);
        return 2;
      }
    } else if (std::strcmp(argv[i], "--options") == 0) {
      per_option = true;
    } else if (std::strcmp(argv[i], "--form") == 0 && i + 1 < argc) {
      const std::string f = argv[++i];
      if (f != "window" && f != "logits") {
        std::fprintf(stderr, "fusedce_linear_bench: --form: window or logits, got \"%s\"\n", f.c_str());
        return 2;
      }
      form = f == "window" ? fusedce::detail::LinearForm::kWindow : fusedce::detail::LinearForm::kLogits;
    } else if (std::strcmp(argv[i], "--csv") == 0 && i + 1 < argc) {
      csv_path = argv[++i];
    } else {
      std::fprintf(stderr, "fusedce_linear_bench: unknown or incomplete argument \"%s\"\n"
                           "usage: fusedce_linear_bench [--quick] [--csv FILE] [--shape N H V]... [--profile N H V] [--graph [N H V]] "
                           "[--options] [--form window|logits] [--iters N]\n",
                   argv[i]);
      return 2;
    }
  }
  FILE* csv = nullptr;
  if (csv_path) {
    csv = std::fopen(csv_path, "w");
    if (!csv) {
      std::fprintf(stderr, "fusedce_linear_bench: --csv: cannot write \"%s\"\n", csv_path);
      return 2;
    }
    std::fprintf(csv, "gpu,N,H,V,dtype,ignored,variant,fused_ms,fused_tflops,floor_ms,floor_tflops,x_floor,workspace_mib,host_ms\n");
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, fused linear cross-entropy, bfloat16, forward + grad_hidden + grad_weight\n", prop.name);
  std::printf("# TFLOP/s count 6 N H V; floor = the three bare cuBLASLt products of the same run\n\n");
  std::printf("| N x H x V | fused fwd+bwd | TFLOP/s | floor (bare GEMMs) | x floor | workspace (all extra memory) |\n");
  std::printf("|---|---|---|---|---|---|\n");
  if (graph.N > 0) {
    bench_graph(graph.N, graph.H, graph.V, quick ? 3 : 10);
    return 0;
  }
  BareGemm bare;
  if (one.N > 0) {
    bench(one, bare, 0, true, per_option, form, prop.name, nullptr);
    return 0;
  }
  const int iters = iters_given > 0 ? iters_given : quick ? 3 : 10;
  std::vector<Shape> shapes = {{4096, 4096, 128256, false}, {8192, 4096, 128256, false}, {16384, 2304, 256000, false},
                               {8192, 4096, 151936, false}, {8192, 4096, 128256, true}};
  if (!quick) shapes.push_back({32768, 4096, 128256, false});
  if (!given.empty()) shapes = given;
  for (const Shape& s : shapes) bench(s, bare, iters, true, per_option, form, prop.name, csv);
  if (csv) std::fclose(csv);
  return 0;
}
