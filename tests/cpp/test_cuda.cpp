// Tests only the CUDA backend can fail: capture and replay in a CUDA graph (cross-entropy over
// logits and fused linear cross-entropy), the same bits run to run (split rows publish partials
// that one pass folds in a fixed order), and CPU-vs-CUDA agreement on random problems. Skipped
// where no GPU is present.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "common/call.h"
#include "common/numeric.h"
#include "cuda/ce/plan.h"
#include "cuda/linear/cutlass_products.h"
#include "cuda/logprobs/lp_fused_products.h"
#include "fusedce/fusedce.h"
#include "harness.h"
#include "linear_form.h"
#include "problem.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using Choices = fusedce::cuda::PlanChoices;
using Force = Choices::Force;

#define ASSERT_CUDA(x) ASSERT_EQ((x), cudaSuccess) << #x
#define ASSERT_OK(s)                     \
  do {                                   \
    const fusedce::Status st_ = (s);     \
    ASSERT_TRUE(st_.ok()) << st_.message(); \
  } while (0)

bool have_gpu() {
  int n = 0;
  if (!fusedce::built_with_cuda() || cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    cudaGetLastError();
    return false;
  }
  return true;
}

/// Device buffers freed when it goes out of scope; upload() copies `bytes` of `host` in (null:
/// left as allocated).
struct DeviceAllocs {
  std::vector<void*> owned;
  DeviceAllocs() = default;
  DeviceAllocs(const DeviceAllocs&) = delete;
  DeviceAllocs& operator=(const DeviceAllocs&) = delete;
  ~DeviceAllocs() {
    for (void* d : owned) cudaFree(d);
  }
  void* upload(const void* host, size_t bytes) {
    void* d = nullptr;
    EXPECT_EQ(cudaMalloc(&d, std::max<size_t>(bytes, 1)), cudaSuccess);
    if (host != nullptr) {
      EXPECT_EQ(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice), cudaSuccess);
    }
    owned.push_back(d);
    return d;
  }
};

/// A random (N, V) problem on host and device: logits ~ N(0, 2) with outliers, 30% ignored.
struct DeviceProblem {
  DType dtype;
  int64_t N, V;
  std::vector<uint8_t> host_x;
  std::vector<int64_t> host_t;
  void *x = nullptr, *dx = nullptr, *ws = nullptr;
  int64_t* t = nullptr;
  float *loss = nullptr, *lse = nullptr, *entropy = nullptr;
  int64_t* correct = nullptr;
  size_t ws_bytes = 0;

  DeviceProblem(DType d, int64_t n, int64_t v, std::mt19937_64& rng) : dtype(d), N(n), V(v) {
    host_x.resize(N * V * elem_size(d));
    host_t.resize(N);
    std::normal_distribution<float> normal(0.0f, 2.0f);
    for (int64_t i = 0; i < N * V; ++i) store_value(host_x.data(), d, i, normal(rng) + (rng() % 997 == 0 ? 15.0f : 0.0f));
    for (int64_t i = 0; i < N; ++i) host_t[i] = rng() % 10 < 3 ? -100 : static_cast<int64_t>(rng() % V);
    cudaMalloc(&x, host_x.size());
    cudaMalloc(&dx, host_x.size());
    cudaMalloc(&t, N * sizeof(int64_t));
    cudaMalloc(&loss, std::max<int64_t>(N, 1) * sizeof(float));
    cudaMalloc(&lse, std::max<int64_t>(N, 1) * sizeof(float));
    cudaMalloc(&entropy, sizeof(float));
    cudaMalloc(&correct, sizeof(int64_t));
    upload();
  }
  ~DeviceProblem() {
    for (void* p : {x, dx, ws, static_cast<void*>(t), static_cast<void*>(loss), static_cast<void*>(lse),
                    static_cast<void*>(entropy), static_cast<void*>(correct)}) {
      cudaFree(p);
    }
  }
  void upload() {
    cudaMemcpy(x, host_x.data(), host_x.size(), cudaMemcpyHostToDevice);
    cudaMemcpy(t, host_t.data(), N * sizeof(int64_t), cudaMemcpyHostToDevice);
    // A pageable host-to-device copy may return before its DMA lands: wait for it.
    cudaDeviceSynchronize();
  }
  void reserve_workspace(const fusedce::Options& o) {
    ws_bytes = fusedce::cross_entropy_workspace_size(fusedce::Job::kForwardBackward, fusedce::Device::cuda(), N, V, o);
    cudaMalloc(&ws, std::max<size_t>(ws_bytes, 1));
  }
  fusedce::ForwardOutputs outputs(const fusedce::Options& o) const {
    fusedce::ForwardOutputs out;
    out.loss = fusedce::vector(loss, DType::kFloat32, o.reduction == fusedce::Reduction::kNone ? N : 1);
    out.lse = fusedce::vector(lse, DType::kFloat32, N);
    if (o.return_metrics) {
      out.num_correct = fusedce::vector(correct, DType::kInt64, 1);
      out.entropy_sum = fusedce::vector(entropy, DType::kFloat32, 1);
    }
    return out;
  }
  // Through the backend entry with explicit plan choices (the defaults: the public entry points'
  // plan), so a test can steer the launcher for one call without any global setting.
  fusedce::Status forward_backward(const fusedce::Options& o, cudaStream_t stream, const Choices& choices = {}) const {
    fusedce::detail::CeCall call = base_call(fusedce::Job::kForwardBackward, o, stream);
    call.out = outputs(o);
    call.dlogits = fusedce::matrix(dx, dtype, N, V);
    return run(call, choices);
  }
  fusedce::Status forward(const fusedce::Options& o, cudaStream_t stream, const Choices& choices = {}) const {
    fusedce::detail::CeCall call = base_call(fusedce::Job::kForward, o, stream);
    call.out = outputs(o);
    return run(call, choices);
  }
  fusedce::detail::CeCall base_call(fusedce::Job job, const fusedce::Options& o, cudaStream_t stream) const {
    fusedce::detail::CeCall call{};
    call.job = job;
    call.device = fusedce::Device::cuda(0, stream);
    call.logits = fusedce::matrix(x, dtype, N, V);
    call.target = fusedce::vector(t, DType::kInt64, N);
    call.options = o;
    call.workspace = fusedce::Workspace{ws, ws_bytes};
    return call;
  }
  static fusedce::Status run(const fusedce::detail::CeCall& call, const Choices& choices) {
    const fusedce::Status s = fusedce::detail::validate_call(call);
    return s.ok() ? fusedce::cuda::run(call, choices) : s;
  }
  /// Every output's bytes, for bit comparisons.
  std::vector<uint8_t> results(const fusedce::Options& o) const {
    const size_t loss_n = o.reduction == fusedce::Reduction::kNone ? N : 1;
    std::vector<uint8_t> r(host_x.size() + (loss_n + N) * 4 + 12);
    cudaDeviceSynchronize();
    uint8_t* at = r.data();
    cudaMemcpy(at, dx, host_x.size(), cudaMemcpyDeviceToHost);
    at += host_x.size();
    cudaMemcpy(at, loss, loss_n * 4, cudaMemcpyDeviceToHost);
    at += loss_n * 4;
    cudaMemcpy(at, lse, N * 4, cudaMemcpyDeviceToHost);
    at += N * 4;
    if (o.return_metrics) {
      cudaMemcpy(at, entropy, 4, cudaMemcpyDeviceToHost);
      cudaMemcpy(at + 4, correct, 8, cudaMemcpyDeviceToHost);
    }
    return r;
  }
};

fusedce::Options all_options() {
  fusedce::Options o;
  o.label_smoothing = 0.1f;
  o.z_loss = 1e-3f;
  o.softcap = 25.0f;
  o.return_metrics = true;
  return o;
}

// Shapes for the two kernel regimes: whole rows per block (many rows) and rows split over blocks
// (few rows, partials merged through workspace), each with an odd V.
struct Shape {
  int64_t N, V;
};
const Shape kShapes[] = {{700, 32003}, {3, 262147}, {1, 5}};

TEST(CudaGraph, CapturedForwardBackwardReplaysOnNewInputs) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  for (const Shape& sh : kShapes) {
    for (const fusedce::Options& o : {fusedce::Options{}, all_options()}) {
      SCOPED_TRACE("N=" + std::to_string(sh.N) + " V=" + std::to_string(sh.V));
      DeviceProblem p(DType::kBFloat16, sh.N, sh.V, rng);
      p.reserve_workspace(o);
      cudaStream_t stream;
      ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
      cudaGraph_t graph;
      cudaGraphExec_t exec;
      ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
      ASSERT_OK(p.forward_backward(o, stream));
      ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
      ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
      for (int replay = 0; replay < 3; ++replay) {
        // New inputs in the same buffers, then the graph, then the direct call: same bits.
        std::normal_distribution<float> normal(0.0f, 3.0f);
        for (int64_t i = 0; i < sh.N * sh.V; ++i) store_value(p.host_x.data(), p.dtype, i, normal(rng));
        p.upload();
        ASSERT_CUDA(cudaGraphLaunch(exec, stream));
        ASSERT_CUDA(cudaStreamSynchronize(stream));
        const std::vector<uint8_t> from_graph = p.results(o);
        p.upload();
        ASSERT_OK(p.forward_backward(o, stream));
        ASSERT_CUDA(cudaStreamSynchronize(stream));
        EXPECT_TRUE(from_graph == p.results(o)) << "replay " << replay << " differs from a direct call";
      }
      cudaGraphExecDestroy(exec);
      cudaGraphDestroy(graph);
      cudaStreamDestroy(stream);
    }
  }
}

// The stream kernel's asynchronous row reduction (the default; PlanChoices::async_reduce off gives
// the synchronous one) folds
// the same warp partials in the same tree as the synchronous one, only in another warp: forward
// results are the same bits. Shapes whose forward runs whole rows per block (the only case it
// applies to), short and long rows, 30% ignored rows interleaved.
TEST(CudaStream, AsyncReductionGivesTheSameBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  const Shape shapes[] = {{3000, 32003}, {1500, 50257}, {2000, 7}, {700, 4099}, {1, 5}};
  fusedce::Options none;
  none.reduction = fusedce::Reduction::kNone;
  for (const Shape& sh : shapes) {
    for (DType d : {DType::kFloat32, DType::kBFloat16}) {
      for (const fusedce::Options& o : {fusedce::Options{}, all_options(), none}) {
        SCOPED_TRACE("N=" + std::to_string(sh.N) + " V=" + std::to_string(sh.V) + " " + dtype_tag(d));
        DeviceProblem p(d, sh.N, sh.V, rng);
        p.reserve_workspace(o);
        Choices sync;
        sync.async_reduce = false;
        ASSERT_OK(p.forward(o, nullptr, sync));
        const std::vector<uint8_t> sync_bits = p.results(o);
        ASSERT_OK(p.forward(o, nullptr));
        const std::vector<uint8_t> async_bits = p.results(o);
        EXPECT_TRUE(sync_bits == async_bits) << "asynchronous reduction changed the forward's bits";
      }
    }
  }
}

// Metrics (token accuracy, entropy) ride along the statistics sweep: they must not change the
// row statistics. Loss, lse and dlogits with metrics on are the bits of the same call without
// them, run after run. The stream kernel resolves the argmax per item from memory after the sweep;
// that load exposed a race (a stage handed back to the copy engine before the warp's reads of it
// had returned: fwd+grad rows of 300 to 555 x 32003 to 262144 lost or gained a segment's exps,
// about one row in 300, different rows each run). The metrics-off call is the plain kernel, the
// metrics-on one the options kernel: their sums are the same arithmetic.
void expect_metrics_leave_bits(const Shape& sh, DType d, const fusedce::Options& o, std::mt19937_64& rng) {
  SCOPED_TRACE("N=" + std::to_string(sh.N) + " V=" + std::to_string(sh.V) + " " + dtype_tag(d) +
               (o.softcap ? " softcap" : " logit_scale"));
  DeviceProblem p(d, sh.N, sh.V, rng);
  fusedce::Options with = o;
  with.return_metrics = true;
  p.reserve_workspace(with);
  ASSERT_OK(p.forward_backward(o, nullptr));
  const std::vector<uint8_t> plain = p.results(o);
  for (int run = 0; run < 3; ++run) {
    ASSERT_OK(p.forward_backward(with, nullptr));
    EXPECT_TRUE(plain == p.results(o)) << "run " << run << ": metrics changed loss, lse or dlogits";
  }
}

fusedce::Options scaled_options() {
  fusedce::Options o;
  o.logit_scale = 0.5f;
  return o;
}

// Whole rows (61081), rows halved over clusters (262144, fp32), both option kernels.
TEST(CudaStream, MetricsLeaveLossAndGradientBits) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  fusedce::Options capped = all_options();
  capped.return_metrics = false;
  for (const Shape& sh : {Shape{555, 61081}, Shape{257, 262144}}) {
    for (DType d : {DType::kFloat32, DType::kBFloat16}) {
      for (const fusedce::Options& o : {scaled_options(), capped}) expect_metrics_leave_bits(sh, d, o, rng);
    }
  }
}

// The smallest case that failed: 4 chunks a row, 2 to 3 rows a block, so every stage of the ring
// turns over several times. Small enough for compute-sanitizer (memcheck in scripts/gpu_check.sh).
TEST(CudaStream, MetricsLeaveBitsWhileStagesTurnOver) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  expect_metrics_leave_bits(Shape{300, 32003}, DType::kFloat32, scaled_options(), rng);
}

TEST(CudaDeterminism, SameBitsRunToRun) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  for (const Shape& sh : kShapes) {
    for (DType d : {DType::kFloat32, DType::kBFloat16}) {
      const fusedce::Options o = all_options();
      DeviceProblem p(d, sh.N, sh.V, rng);
      p.reserve_workspace(o);
      ASSERT_OK(p.forward_backward(o, nullptr));
      const std::vector<uint8_t> first = p.results(o);
      for (int run = 0; run < 4; ++run) {
        p.upload();
        ASSERT_OK(p.forward_backward(o, nullptr));
        EXPECT_TRUE(first == p.results(o)) << "run " << run << " N=" << sh.N << " V=" << sh.V;
      }
    }
  }
}

/// p's forward+backward (or, with_grad false, its forward alone: the forward kernels differ from
/// the fwd+grad ones, by consumer groups, the asynchronous reduction, splits) on the GPU and on
/// the CPU backend: loss, lse, metrics and gradients within the per-dtype tolerance of each other.
void expect_gpu_agrees_with_cpu(DeviceProblem& p, const fusedce::Options& o, bool with_grad = true,
                                const Choices& choices = {}) {
  const DType d = p.dtype;
  const int64_t N = p.N, V = p.V;
  p.reserve_workspace(o);
  ASSERT_OK(with_grad ? p.forward_backward(o, nullptr, choices) : p.forward(o, nullptr, choices));
  const size_t loss_n = o.reduction == fusedce::Reduction::kNone ? N : 1;
  std::vector<float> g_loss(loss_n), g_lse(N), c_loss(loss_n), c_lse(N);
  std::vector<uint8_t> g_dx(p.host_x.size()), c_dx(p.host_x.size());
  float g_ent = 0, c_ent = 0;
  int64_t g_cor = 0, c_cor = 0;
  ASSERT_CUDA(cudaDeviceSynchronize());
  cudaMemcpy(g_loss.data(), p.loss, loss_n * 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(g_lse.data(), p.lse, N * 4, cudaMemcpyDeviceToHost);
  if (with_grad) cudaMemcpy(g_dx.data(), p.dx, g_dx.size(), cudaMemcpyDeviceToHost);
  cudaMemcpy(&g_ent, p.entropy, 4, cudaMemcpyDeviceToHost);
  cudaMemcpy(&g_cor, p.correct, 8, cudaMemcpyDeviceToHost);
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(c_loss.data(), DType::kFloat32, loss_n);
  out.lse = fusedce::vector(c_lse.data(), DType::kFloat32, N);
  if (o.return_metrics) {
    out.num_correct = fusedce::vector(&c_cor, DType::kInt64, 1);
    out.entropy_sum = fusedce::vector(&c_ent, DType::kFloat32, 1);
  }
  ASSERT_OK(fusedce::cross_entropy_forward_backward(fusedce::Device::cpu(), fusedce::matrix(p.host_x.data(), d, N, V),
                                                    fusedce::vector(p.host_t.data(), DType::kInt64, N), o, out, {},
                                                    fusedce::matrix(c_dx.data(), d, N, V)));
  const Tolerance lt = tolerance(d, Quantity::kLoss), gt = tolerance(d, Quantity::kGradient);
  Mismatches loss("loss"), lse("lse"), grad("dlogits"), metrics("metrics");
  for (size_t i = 0; i < loss_n; ++i) loss.check(g_loss[i], c_loss[i], std::fabs(c_loss[i]) + 1.0, lt, i);
  for (int64_t i = 0; i < N; ++i) lse.check(g_lse[i], c_lse[i], std::fabs(c_lse[i]) + 1.0, lt, i);
  if (o.return_metrics) {
    // entropy = lse - sum p z: its rounding error scales with the terms that cancel (|lse|),
    // not with the (possibly small) entropy itself.
    double ent_scale = 1.0;
    for (int64_t i = 0; i < N; ++i) ent_scale += std::fabs(c_lse[i]) + 1.0;
    metrics.check(g_ent, c_ent, ent_scale, lt, 0);
    // Near-ties of the argmax may resolve differently under the two backends' rounding.
    if (std::llabs(g_cor - c_cor) > 1 + N / 100) metrics.add("num_correct " + std::to_string(g_cor) + " vs " + std::to_string(c_cor));
  }
  int64_t valid = 0;
  for (int64_t i = 0; i < N; ++i) valid += p.host_t[i] != -100;
  for (int64_t i = 0; with_grad && i < N; ++i) {
    // The magnitude of the terms that cancel in row i's gradient (as the reference's scale):
    // |g| (|a| + b_t + eps/V) max dz/dx, a = 1 + 2 z_loss lse; at least the largest entry.
    const double g = o.reduction == fusedce::Reduction::kMean ? 1.0 / std::max<int64_t>(valid, 1) : 1.0;
    double scale = g * (1.0 + 2.0 * o.z_loss * std::fabs(c_lse[i]) + 1.0 + o.label_smoothing) * o.logit_scale;
    for (int64_t j = 0; j < V; ++j) scale = std::max(scale, std::fabs(load_value(c_dx.data(), d, i * V + j)));
    for (int64_t j = 0; j < V; ++j) {
      grad.check(load_value(g_dx.data(), d, i * V + j), load_value(c_dx.data(), d, i * V + j), scale + 1e-30, gt, i, j);
    }
  }
  loss.report();
  lse.report();
  grad.report();
  metrics.report();
}

// The CPU and CUDA backends on the same random problems (random shapes, dtypes, options): loss,
// lse, metrics and gradients within the per-dtype tolerance of each other.
TEST(CudaAgreement, CpuAndCudaAgreeOnRandomProblems) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  for (int trial = 0; trial < 24; ++trial) {
    const DType d = trial % 3 == 0 ? DType::kFloat32 : trial % 3 == 1 ? DType::kBFloat16 : DType::kFloat16;
    const int64_t N = 1 + rng() % (trial % 4 == 0 ? 5 : 600);
    const int64_t V = 1 + rng() % (trial % 2 ? 70000 : 3000);
    fusedce::Options o;
    if (rng() % 2) o.label_smoothing = 0.05f;
    if (rng() % 2) o.z_loss = 1e-4f;
    if (rng() % 3 == 0) o.softcap = 30.0f;
    if (rng() % 3 == 0) o.logit_scale = 0.5f;
    o.return_metrics = rng() % 2;
    o.reduction = static_cast<fusedce::Reduction>(rng() % 3);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": " + fusedce::dtype_name(d) + " N=" + std::to_string(N) +
                 " V=" + std::to_string(V));
    DeviceProblem p(d, N, V, rng);
    expect_gpu_agrees_with_cpu(p, o);
  }
}

// Long rows halved over 2-block clusters (forced here: PlanChoices::halves on; by default only
// rows that would overflow L2 on all SMs; forward + gradient,
// statistics swapped through distributed shared memory): the same agreement with the CPU
// backend, for every dtype and option set, odd V (ragged ends in both halves), ignored rows.
TEST(CudaStream, ClusterHalvesAgreeWithCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  fusedce::Options smooth, capped, none;
  smooth.label_smoothing = 0.1f;
  smooth.z_loss = 1e-4f;
  capped.softcap = 30.0f;
  capped.logit_scale = 0.5f;
  none.reduction = fusedce::Reduction::kNone;
  Choices halves;
  halves.halves = Force::kOn;
  for (const DType d : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
    for (const Shape sh : {Shape{300, 262147}, Shape{150, 65537}, Shape{140, 131071}}) {
      for (const fusedce::Options& o : {fusedce::Options{}, all_options(), smooth, capped, none}) {
        SCOPED_TRACE(std::string(fusedce::dtype_name(d)) + " N=" + std::to_string(sh.N) + " V=" + std::to_string(sh.V));
        DeviceProblem p(d, sh.N, sh.V, rng);
        expect_gpu_agrees_with_cpu(p, o, /*with_grad=*/true, halves);
      }
    }
  }
}

// Consumer groups: two groups of 8 warps, each on a ring of its own (kernels of the plain and
// options sets). By default over rows of <= 2 chunks; forced here on every row with
// PlanChoices::groups = 2, then one group forced: rows of 1 to 8 chunks (kept in the ring, or
// streamed twice with the gradient), ragged ends, ignored rows, several items per group and
// block, each option set, each reduction, and rows long enough for halves (which take one group).
struct GroupsCase {
  DType d;
  Shape sh;
};
const GroupsCase kGroupsCases[] = {{DType::kBFloat16, {1100, 32000}}, {DType::kBFloat16, {2000, 7}},
                                   {DType::kBFloat16, {1100, 16387}}, {DType::kBFloat16, {1200, 50257}},
                                   {DType::kBFloat16, {1100, 131071}}, {DType::kFloat32, {1500, 8000}},
                                   {DType::kFloat32, {1100, 32003}},  {DType::kFloat16, {1100, 24001}},
                                   {DType::kFloat32, {300, 131071}},  {DType::kBFloat16, {1, 5}}};

TEST(CudaStream, ConsumerGroupsForwardAgreesWithCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  fusedce::Options none, metrics;
  none.reduction = fusedce::Reduction::kNone;
  metrics.return_metrics = true;
  metrics.label_smoothing = 0.05f;
  for (const int groups : {2, 1}) {
    Choices forced;
    forced.groups = groups;
    for (const GroupsCase& k : kGroupsCases) {
      for (const fusedce::Options& o : {fusedce::Options{}, none, metrics, all_options()}) {
        SCOPED_TRACE("groups " + std::to_string(groups) + " N=" + std::to_string(k.sh.N) + " V=" +
                     std::to_string(k.sh.V) + " " + dtype_tag(k.d));
        DeviceProblem p(k.d, k.sh.N, k.sh.V, rng);
        expect_gpu_agrees_with_cpu(p, o, /*with_grad=*/false, forced);
      }
    }
  }
}

// With the gradient (two groups by default on rows of <= 2 chunks; forced here on every row):
// loss, lse, metrics and dlogits against the CPU backend.
TEST(CudaStream, ConsumerGroupsGradientAgreesWithCpu) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  fusedce::Options metrics;
  metrics.return_metrics = true;
  metrics.label_smoothing = 0.05f;
  metrics.reduction = fusedce::Reduction::kSum;
  Choices two;
  two.groups = 2;
  for (const GroupsCase& k : kGroupsCases) {
    for (const fusedce::Options& o : {fusedce::Options{}, metrics}) {
      SCOPED_TRACE("N=" + std::to_string(k.sh.N) + " V=" + std::to_string(k.sh.V) + " " + dtype_tag(k.d));
      DeviceProblem p(k.d, k.sh.N, k.sh.V, rng);
      expect_gpu_agrees_with_cpu(p, o, /*with_grad=*/true, two);
    }
  }
}

// Small problems (the sizes of the sanitizer runs: a chunk or less a row, a few rows to a few
// hundred) under the plan variants the sanitizers must see besides the default one, each with
// explicit choices and against the CPU backend: the synchronous row reduction (racecheck follows
// its barriers; the asynchronous handoff it cannot), two consumer groups forced (with the
// gradient too), both, and the row kernel for forward jobs (the path of GPUs before sm_90).
// Every option at once here with the grid's soft-cap of 10: both backends form tanh as
// 1 - 2 / (e^2y + 1), whose absolute error (about 1e-7, from different exp and reciprocal
// approximations) the cap multiplies; at a cap of 25 two such errors reach the loss tolerance of a
// row whose lse is near 0 (V = 1: lse is the one capped logit), which says nothing about the plan.
void expect_small_problems_agree(const Choices& choices) {
  std::mt19937_64 rng = test_rng();
  fusedce::Options none, all = all_options();
  none.reduction = fusedce::Reduction::kNone;
  all.softcap = 10.0f;
  const Shape shapes[] = {{3, 7}, {257, 127}, {257, 1024}, {1, 1}};
  for (const Shape& sh : shapes) {
    for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (const fusedce::Options& o : {fusedce::Options{}, all, none}) {
        for (bool grad : {false, true}) {
          SCOPED_TRACE("N=" + std::to_string(sh.N) + " V=" + std::to_string(sh.V) + " " + dtype_tag(d) +
                       (grad ? " fwd+grad" : " forward"));
          DeviceProblem p(d, sh.N, sh.V, rng);
          expect_gpu_agrees_with_cpu(p, o, grad, choices);
        }
      }
    }
  }
}

TEST(CudaSanitize, SyncReduction) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Choices c;
  c.async_reduce = false;
  expect_small_problems_agree(c);
}

TEST(CudaSanitize, TwoGroups) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Choices c;
  c.groups = 2;
  expect_small_problems_agree(c);
}

TEST(CudaSanitize, TwoGroupsSyncReduction) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Choices c;
  c.groups = 2;
  c.async_reduce = false;
  expect_small_problems_agree(c);
}

TEST(CudaSanitize, RowKernelForward) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Choices c;
  c.stream = Force::kOff;
  expect_small_problems_agree(c);
}

// The stream kernel finishes a call itself (finish.cuh: a split row's partials merged by its last
// split, the batch sums by the block that finishes last, the mean's 1 / denominator counted in
// every block with the gradient). Against the separate passes it replaces
// (PlanChoices::stream_finish off): the row results and dlogits are the same bits, the batch sums
// agree to rounding (another summation order). Its counters live in a workspace nobody clears:
// the same results whatever the workspace held (all ones, random bytes), and a second call on
// the workspace the first one left gives the first one's bits.
TEST(CudaStream, OneLaunchFinishMatchesSeparatePasses) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  fusedce::Options sum_metrics = all_options(), none, smooth;
  sum_metrics.reduction = fusedce::Reduction::kSum;
  none.reduction = fusedce::Reduction::kNone;
  smooth.label_smoothing = 0.1f;
  const Shape shapes[] = {{3, 262147}, {40, 131071}, {700, 32003}, {2000, 7}, {1, 5}};
  for (const Shape& sh : shapes) {
    for (DType d : {DType::kBFloat16, DType::kFloat32}) {
      for (const fusedce::Options& o : {fusedce::Options{}, sum_metrics, none, smooth}) {
        for (bool grad : {false, true}) {
          SCOPED_TRACE("N=" + std::to_string(sh.N) + " V=" + std::to_string(sh.V) + " " + dtype_tag(d) +
                       (grad ? " fwd+grad" : " forward") + " reduction " + std::to_string(int(o.reduction)));
          DeviceProblem p(d, sh.N, sh.V, rng);
          p.reserve_workspace(o);
          auto call = [&](const Choices& c) {
            return grad ? p.forward_backward(o, nullptr, c) : p.forward(o, nullptr, c);
          };
          Choices separate;
          separate.stream_finish = false;
          ASSERT_OK(call(separate));
          const std::vector<uint8_t> ref = p.results(o);
          const size_t loss_n = o.reduction == fusedce::Reduction::kNone ? sh.N : 1;
          const size_t dx_bytes = p.host_x.size(), loss_at = dx_bytes, lse_at = loss_at + loss_n * 4;
          const size_t ent_at = lse_at + sh.N * 4;
          auto f32 = [](const std::vector<uint8_t>& r, size_t at) {
            float v;
            std::memcpy(&v, r.data() + at, 4);
            return v;
          };
          for (int fill = 0; fill < 2; ++fill) {
            std::vector<uint8_t> stale(p.ws_bytes, 0xFF);
            if (fill == 1) {
              for (auto& b : stale) b = static_cast<uint8_t>(rng());
            }
            ASSERT_CUDA(cudaMemcpy(p.ws, stale.data(), p.ws_bytes, cudaMemcpyHostToDevice));
            ASSERT_OK(call(Choices{}));
            const std::vector<uint8_t> got = p.results(o);
            EXPECT_TRUE(std::equal(ref.begin(), ref.begin() + dx_bytes, got.begin())) << "dlogits bits";
            EXPECT_TRUE(std::equal(ref.begin() + lse_at, ref.begin() + ent_at, got.begin() + lse_at)) << "lse bits";
            if (loss_n > 1) {
              EXPECT_TRUE(std::equal(ref.begin() + loss_at, ref.begin() + lse_at, got.begin() + loss_at)) << "row losses";
            } else {
              const float a = f32(ref, loss_at), b = f32(got, loss_at);
              EXPECT_TRUE((std::isnan(a) && std::isnan(b)) || std::fabs(a - b) <= 1e-6f * std::fabs(a)) << a << " vs " << b;
            }
            if (o.return_metrics) {
              EXPECT_NEAR(f32(got, ent_at), f32(ref, ent_at), 1e-6f * std::fabs(f32(ref, ent_at)) + 1e-6f) << "entropy";
              EXPECT_TRUE(std::equal(ref.begin() + ent_at + 4, ref.end(), got.begin() + ent_at + 4)) << "num_correct";
            }
            ASSERT_OK(call(Choices{}));  // on the workspace the first call left
            EXPECT_TRUE(got == p.results(o)) << "a second call on the same workspace";
          }
        }
      }
    }
  }
}

// The upstream-gradient rescale on persistent blocks (a grid of a few blocks per SM walking the
// (row, chunk) items): with many more items than blocks every row is scaled by its own factor
// (rows of factor 1 keep their bits), a scalar factor scales every row, and a scalar of 1
// leaves the gradient alone. Reference: the float product rounded to the dtype (fp32: exact).
TEST(CudaRescale, PersistentBlocksScaleEveryRow) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  const int64_t N = 3001, V = 50003;
  for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    SCOPED_TRACE(dtype_tag(d));
    const size_t es = elem_size(d);
    std::vector<uint8_t> host(N * V * es);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (int64_t i = 0; i < N * V; ++i) store_value(host.data(), d, i, normal(rng));
    std::uniform_real_distribution<float> uf(-3.0f, 3.0f);
    std::vector<float> per_row(N);
    for (int64_t i = 0; i < N; ++i) per_row[i] = i % 3 == 0 ? 1.0f : uf(rng);
    void *x = nullptr, *g = nullptr;
    ASSERT_CUDA(cudaMalloc(&x, host.size()));
    ASSERT_CUDA(cudaMalloc(&g, N * sizeof(float)));
    // One unit in the last place (fp32: exact), and for float16 the subnormal spacing 2^-24
    // (products under 6.1e-5 round to it: ~1 element in 40000 here).
    const double rel = d == DType::kFloat32 ? 0.0 : d == DType::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
    const double abs_tol = d == DType::kFloat16 ? std::ldexp(1.0, -24) : 0.0;
    for (const std::vector<float>& factors : {per_row, std::vector<float>{0.37f}, std::vector<float>{1.0f}}) {
      SCOPED_TRACE(factors.size() == 1 ? "scalar " + std::to_string(factors[0]) : std::string("per row"));
      ASSERT_CUDA(cudaMemcpy(x, host.data(), host.size(), cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaMemcpy(g, factors.data(), factors.size() * sizeof(float), cudaMemcpyHostToDevice));
      ASSERT_OK(fusedce::cross_entropy_rescale_grad(
          fusedce::Device::cuda(), fusedce::vector(g, DType::kFloat32, static_cast<int64_t>(factors.size())),
          fusedce::matrix(x, d, N, V), fusedce::Workspace{}));
      std::vector<uint8_t> got(host.size());
      ASSERT_CUDA(cudaMemcpy(got.data(), x, got.size(), cudaMemcpyDeviceToHost));
      int64_t bad = 0;
      for (int64_t i = 0; i < N; ++i) {
        const float f = factors.size() == 1 ? factors[0] : factors[i];
        if (f == 1.0f) {
          bad += std::memcmp(got.data() + i * V * es, host.data() + i * V * es, V * es) != 0;
          continue;
        }
        for (int64_t j = 0; j < V; ++j) {
          const double want = static_cast<double>(static_cast<float>(load_value(host.data(), d, i * V + j)) * f);
          const double have = load_value(got.data(), d, i * V + j);
          if (std::fabs(have - want) > rel * std::fabs(want) + abs_tol) ++bad;
        }
      }
      EXPECT_EQ(bad, 0) << "elements (or factor-1 rows) off";
    }
    cudaFree(x);
    cudaFree(g);
  }
}

// Fused linear cross-entropy in a CUDA graph: the chunked path (float32 grad_weight accumulator),
// one chunk, and low_memory (vocabulary slices), each captured once with a caller's workspace and
// replayed on new hidden states; every replay gives the bits of a direct call on those inputs.
TEST(CudaGraph, LinearCapturedReplaysOnNewInputs) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  const DType d = DType::kBFloat16;
  const int64_t N = 300, H = 72, V = 3001;
  std::vector<uint8_t> hid(N * H * 2), w(V * H * 2), b(V * 2);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int64_t k = 0; k < N * H; ++k) store_value(hid.data(), d, k, normal(rng));
  for (int64_t k = 0; k < V * H; ++k) store_value(w.data(), d, k, 0.3f * normal(rng));
  for (int64_t k = 0; k < V; ++k) store_value(b.data(), d, k, normal(rng));
  std::vector<int64_t> tgt(N);
  for (auto& t : tgt) t = rng() % 4 == 0 ? -100 : static_cast<int64_t>(rng() % V);
  void *d_hid, *d_w, *d_b, *d_t, *d_loss, *d_lse, *d_ent, *d_cor, *d_gh, *d_gw, *d_gb;
  ASSERT_CUDA(cudaMalloc(&d_hid, hid.size()));
  ASSERT_CUDA(cudaMalloc(&d_w, w.size()));
  ASSERT_CUDA(cudaMalloc(&d_b, b.size()));
  ASSERT_CUDA(cudaMalloc(&d_t, N * 8));
  ASSERT_CUDA(cudaMalloc(&d_loss, 4));
  ASSERT_CUDA(cudaMalloc(&d_lse, N * 4));
  ASSERT_CUDA(cudaMalloc(&d_ent, 4));
  ASSERT_CUDA(cudaMalloc(&d_cor, 8));
  ASSERT_CUDA(cudaMalloc(&d_gh, N * H * 2));
  ASSERT_CUDA(cudaMalloc(&d_gw, V * H * 2));
  ASSERT_CUDA(cudaMalloc(&d_gb, V * 2));
  ASSERT_CUDA(cudaMemcpy(d_w, w.data(), w.size(), cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_b, b.data(), b.size(), cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_t, tgt.data(), N * 8, cudaMemcpyHostToDevice));
  fusedce::Options o;
  o.label_smoothing = 0.1f;
  o.return_metrics = true;
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(d_gh, d, N, H);
  g.grad_weight = fusedce::matrix(d_gw, d, V, H);
  g.grad_bias = fusedce::vector(d_gb, d, V);
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(d_loss, DType::kFloat32, 1);
  out.lse = fusedce::vector(d_lse, DType::kFloat32, N);
  out.entropy_sum = fusedce::vector(d_ent, DType::kFloat32, 1);
  out.num_correct = fusedce::vector(d_cor, DType::kInt64, 1);
  auto results = [&] {
    std::vector<uint8_t> all;
    for (auto [ptr, bytes] : {std::pair<void*, size_t>{d_loss, 4}, {d_lse, N * 4}, {d_ent, 4}, {d_cor, 8},
                              {d_gh, N * H * 2}, {d_gw, V * H * 2}, {d_gb, V * 2}}) {
      std::vector<uint8_t> v(bytes);
      cudaMemcpy(v.data(), ptr, bytes, cudaMemcpyDeviceToHost);
      all.insert(all.end(), v.begin(), v.end());
    }
    return all;
  };
  struct Mode { const char* name; size_t budget; bool low_memory; };
  for (const Mode m : {Mode{"chunked", size_t(64) * V * 2, false}, Mode{"one chunk", 0, false},
                       Mode{"low_memory", size_t(40) * V * 2, true}}) {
    SCOPED_TRACE(m.name);
    fusedce::LinearOptions lo;
    lo.chunk_budget_bytes = m.budget;
    lo.low_memory = m.low_memory;
    const size_t ws_bytes = fusedce::linear_cross_entropy_workspace_size(
        fusedce::Job::kForwardBackward, fusedce::Device::cuda(0, nullptr), N, H, V, d, o, lo, g);
    void* ws;
    ASSERT_CUDA(cudaMalloc(&ws, ws_bytes));
    cudaStream_t stream;
    ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    auto call = [&] {
      return fusedce::linear_cross_entropy_forward_backward(
          fusedce::Device::cuda(0, stream), fusedce::matrix(d_hid, d, N, H), fusedce::matrix(d_w, d, V, H),
          fusedce::vector(d_b, d, V), fusedce::vector(d_t, DType::kInt64, N), o, lo, out, {}, g,
          fusedce::Workspace{ws, ws_bytes});
    };
    // One direct call first, as frameworks warm up before capturing: cuBLASLt's handle is
    // created on first use, which a capturing stream would not allow.
    ASSERT_CUDA(cudaMemcpy(d_hid, hid.data(), hid.size(), cudaMemcpyHostToDevice));
    ASSERT_OK(call());
    ASSERT_CUDA(cudaStreamSynchronize(stream));
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    const fusedce::Status captured = call();
    ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
    ASSERT_OK(captured);
    ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
    for (int replay = 0; replay < 3; ++replay) {
      for (int64_t k = 0; k < N * H; ++k) store_value(hid.data(), d, k, normal(rng));
      ASSERT_CUDA(cudaMemcpy(d_hid, hid.data(), hid.size(), cudaMemcpyHostToDevice));
      ASSERT_CUDA(cudaGraphLaunch(exec, stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      const std::vector<uint8_t> from_graph = results();
      ASSERT_OK(call());
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      EXPECT_TRUE(from_graph == results()) << "replay " << replay << " differs from a direct call";
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    cudaFree(ws);
  }
  for (void* ptr : {d_hid, d_w, d_b, d_t, d_loss, d_lse, d_ent, d_cor, d_gh, d_gw, d_gb}) cudaFree(ptr);
}

// The linear form's shard steps with the causal shift and skip_ignored on a stream capturing a
// CUDA graph: nothing may wait for the count of kept rows there, so every row runs through the
// products; the replayed graph gives what a direct (compacting) call gives, up to the order of
// float32 sums over rows: the statistics of every kept row, and the gradients.
TEST(CudaGraph, ShardStepsWithShiftAndSkipCaptureEveryRow) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng = test_rng();
  const DType d = DType::kFloat32;
  const int64_t L = 41, N = 3 * L, H = 40, V = 170, V_total = 301;
  const int64_t W = fusedce::kShardStatsWidth;
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> hid(N * H), w(V * H), b(V);
  for (auto& x : hid) x = normal(rng);
  for (auto& x : w) x = 0.3f * normal(rng);
  for (auto& x : b) x = normal(rng);
  std::vector<int64_t> tgt(N);
  for (auto& t : tgt) t = rng() % 4 == 0 ? -100 : static_cast<int64_t>(rng() % V_total);
  for (int64_t i = 0; i < 17; ++i) tgt[i] = -100;  // a prompt-masked head
  float *d_hid, *d_w, *d_b, *d_stats, *d_loss, *d_lse, *d_rw, *d_batch, *d_gh, *d_gw, *d_gb, *d_up;
  int64_t* d_t;
  const float one = 1.0f;
  ASSERT_CUDA(cudaMalloc(&d_up, 4));
  ASSERT_CUDA(cudaMemcpy(d_up, &one, 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMalloc(&d_hid, N * H * 4));
  ASSERT_CUDA(cudaMalloc(&d_w, V * H * 4));
  ASSERT_CUDA(cudaMalloc(&d_b, V * 4));
  ASSERT_CUDA(cudaMalloc(&d_t, N * 8));
  ASSERT_CUDA(cudaMalloc(&d_stats, (N + 1) * W * 4));
  ASSERT_CUDA(cudaMalloc(&d_loss, 4));
  ASSERT_CUDA(cudaMalloc(&d_lse, N * 4));
  ASSERT_CUDA(cudaMalloc(&d_rw, N * 4));
  ASSERT_CUDA(cudaMalloc(&d_batch, 8));
  ASSERT_CUDA(cudaMalloc(&d_gh, N * H * 4));
  ASSERT_CUDA(cudaMalloc(&d_gw, V * H * 4));
  ASSERT_CUDA(cudaMalloc(&d_gb, V * 4));
  ASSERT_CUDA(cudaMemcpy(d_hid, hid.data(), N * H * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_w, w.data(), V * H * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_b, b.data(), V * 4, cudaMemcpyHostToDevice));
  ASSERT_CUDA(cudaMemcpy(d_t, tgt.data(), N * 8, cudaMemcpyHostToDevice));
  fusedce::Options o;
  o.label_smoothing = 0.1f;
  fusedce::LinearOptions lo;
  lo.shift_seq_len = L;
  lo.skip_ignored = true;
  lo.chunk_budget_bytes = size_t(50) * V * 4;  // several chunks
  const fusedce::ShardSpec shard{0, V_total};
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(d_gh, DType::kFloat32, N, H);
  g.grad_weight = fusedce::matrix(d_gw, d, V, H);
  g.grad_bias = fusedce::vector(d_gb, d, V);
  const fusedce::Device probe = fusedce::Device::cuda(0, nullptr);
  const size_t ws1 = fusedce::linear_cross_entropy_shard_workspace_size(1, probe, N, H, V, d, o, lo, {});
  const size_t ws3 = fusedce::linear_cross_entropy_shard_workspace_size(3, probe, N, H, V, d, o, lo, g);
  void *d_ws1, *d_ws3;
  ASSERT_CUDA(cudaMalloc(&d_ws1, ws1));
  ASSERT_CUDA(cudaMalloc(&d_ws3, ws3));
  cudaStream_t stream;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const fusedce::Device dev = fusedce::Device::cuda(0, stream);
  const auto T = fusedce::vector(d_t, DType::kInt64, N);
  auto step1 = [&] {
    return fusedce::linear_cross_entropy_shard_stats(dev, fusedce::matrix(d_hid, d, N, H), fusedce::matrix(d_w, d, V, H),
                                                     fusedce::vector(d_b, d, V), T, shard, o, lo,
                                                     fusedce::matrix(d_stats, DType::kFloat32, N + 1, W),
                                                     fusedce::Workspace{d_ws1, ws1});
  };
  auto step3 = [&] {
    return fusedce::linear_cross_entropy_shard_backward(
        dev, fusedce::matrix(d_hid, d, N, H), fusedce::matrix(d_w, d, V, H), fusedce::vector(d_b, d, V), T, shard, o,
        lo, fusedce::vector(d_lse, DType::kFloat32, N), fusedce::vector(d_rw, DType::kFloat32, N),
        fusedce::vector(d_batch, DType::kFloat32, 2), fusedce::vector(d_up, DType::kFloat32, 1), g,
        fusedce::Workspace{d_ws3, ws3});
  };
  auto download = [&](const float* ptr, int64_t n) {
    std::vector<float> v(n);
    cudaMemcpy(v.data(), ptr, n * 4, cudaMemcpyDeviceToHost);
    return v;
  };
  // Direct calls (compacting), with the merge between them.
  ASSERT_OK(step1());
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(d_loss, DType::kFloat32, 1);
  out.lse = fusedce::vector(d_lse, DType::kFloat32, N);
  ASSERT_OK(fusedce::linear_cross_entropy_shard_merge(dev, fusedce::matrix(d_stats, DType::kFloat32, N + 1, W), 1, T,
                                                      shard, o, lo, out, fusedce::vector(d_rw, DType::kFloat32, N),
                                                      fusedce::vector(d_batch, DType::kFloat32, 2)));
  ASSERT_OK(step3());
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<float> stats = download(d_stats, (N + 1) * W), gh = download(d_gh, N * H),
                           gw = download(d_gw, V * H), gb = download(d_gb, V);
  // Captured, then replayed.
  ASSERT_CUDA(cudaMemset(d_stats, 0xCD, (N + 1) * W * 4));
  ASSERT_CUDA(cudaMemset(d_gh, 0xCD, N * H * 4));
  ASSERT_CUDA(cudaMemset(d_gw, 0xCD, V * H * 4));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  const fusedce::Status s1 = step1();
  const fusedce::Status s3 = step3();
  ASSERT_CUDA(cudaStreamEndCapture(stream, &graph));
  ASSERT_OK(s1);
  ASSERT_OK(s3);
  ASSERT_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  ASSERT_CUDA(cudaGraphLaunch(exec, stream));
  ASSERT_CUDA(cudaStreamSynchronize(stream));
  const std::vector<float> stats_g = download(d_stats, (N + 1) * W), gh_g = download(d_gh, N * H),
                           gw_g = download(d_gw, V * H), gb_g = download(d_gb, V);
  int64_t bad = 0;
  for (int64_t i = 0; i < N; ++i) {
    const bool kept = i % L != L - 1 && tgt[i + 1] != -100;
    if (!kept) continue;  // the direct call leaves zeros there, the captured one every row's statistics
    for (int64_t k = 0; k < W; ++k) {
      const float a = stats[i * W + k], c = stats_g[i * W + k];
      bad += k == 7 ? std::memcmp(&a, &c, 4) != 0 : std::fabs(a - c) > 1e-5f * (std::fabs(c) + 1.0f);
    }
  }
  for (int64_t k = 0; k < W; ++k) bad += std::fabs(stats[N * W + k] - stats_g[N * W + k]) > 1e-5f * (std::fabs(stats[N * W + k]) + 1.0f);
  EXPECT_EQ(bad, 0) << "statistics of kept rows differ";
  auto close = [](const std::vector<float>& a, const std::vector<float>& c) {
    float scale = 1e-6f;
    for (float x : a) scale = std::max(scale, std::fabs(x));
    int64_t n = 0;
    for (size_t k = 0; k < a.size(); ++k) n += !(std::fabs(a[k] - c[k]) <= 1e-5f * scale);
    return n;
  };
  EXPECT_EQ(close(gh, gh_g), 0) << "grad_hidden";
  EXPECT_EQ(close(gw, gw_g), 0) << "grad_weight";
  EXPECT_EQ(close(gb, gb_g), 0) << "grad_bias";
  for (int64_t i = 0; i < N; ++i) {
    if (i % L == L - 1 || tgt[i + 1] == -100) {
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(gh[i * H + h], 0.0f) << "an ignored row's grad_hidden, row " << i;
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  for (void* ptr : std::initializer_list<void*>{d_hid, d_w, d_b, d_t, d_stats, d_loss, d_lse, d_rw, d_batch, d_gh,
                                                 d_gw, d_gb, d_up, d_ws1, d_ws3}) {
    cudaFree(ptr);
  }
}

// The linear log-probabilities' fused products (cuda/logprobs/lp_fused_products.h) against the
// row kernels they stand in for, over the same bf16 logits. On Hopper a bf16 call without a bias
// takes them, and a kUnsupported there would quietly hand the work to cuBLASLt and the row
// kernels, so this asks them directly: they must run, step 1's partials folded per row must merge
// into the row kernel's log-probability, entropy, lse (float32 roundoff of another summation
// order) and distribution statistics, and step 3's dlogits must be the row kernel's (the same
// formula on the same logits: at most one bf16 unit apart where the compilers contract
// differently). Inputs exact in bf16 (hidden in {-1, 0, 1}, weight in eighths of [-1, 1], H = 64:
// every logit a multiple of 1/8 of standard deviation about 4, exact in bf16 below 32, which is
// asserted), so the host's logits are the product's own rounding, ties at the max included.
TEST(CudaFusedLogprobs, ProductsMatchTheRowKernelsOnHopper) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  int dev = 0;
  ASSERT_CUDA(cudaGetDevice(&dev));
  if (!fusedce::cuda::cutlass_products_available(dev)) GTEST_SKIP() << "the fused products run on sm_90 builds with CUTLASS";
  namespace fc = fusedce::cuda;
  using fusedce::detail::bf16_to_float;
  using fusedce::detail::float_to_bf16;
  const int64_t N = 300, H = 64, V = 2001, kW = fusedce::kLogprobStatsWidth;
  const float temperature = 0.7f;
  std::mt19937_64 rng = test_rng();
  std::vector<uint16_t> hid(N * H), w(V * H), logits(N * V);
  for (auto& x : hid) x = float_to_bf16(static_cast<float>(static_cast<int>(rng() % 3) - 1));
  for (auto& x : w) x = float_to_bf16(static_cast<float>(static_cast<int>(rng() % 17) - 8) / 8.0f);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < V; ++j) {
      float dot = 0.0f;  // exact in float32: multiples of 1/8 of at most 64
      for (int64_t k = 0; k < H; ++k) dot += bf16_to_float(hid[i * H + k]) * bf16_to_float(w[j * H + k]);
      logits[i * V + j] = float_to_bf16(dot);
      ASSERT_EQ(bf16_to_float(logits[i * V + j]), dot);
    }
  std::vector<int64_t> tgt(N);
  for (auto& t : tgt) t = rng() % 5 == 0 ? -100 : static_cast<int64_t>(rng() % V);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> g_lp(N), g_h(N);
  for (int64_t i = 0; i < N; ++i) {
    g_lp[i] = normal(rng);
    g_h[i] = normal(rng);
  }
  DeviceAllocs mem;
  auto upload = [&](const void* host, size_t bytes) { return mem.upload(host, bytes); };
  void* d_hid = upload(hid.data(), hid.size() * 2);
  void* d_w = upload(w.data(), w.size() * 2);
  void* d_logits = upload(logits.data(), logits.size() * 2);
  void* d_t = upload(tgt.data(), N * 8);
  void* d_glp = upload(g_lp.data(), N * 4);
  void* d_gh = upload(g_h.data(), N * 4);
  for (const bool dist : {false, true}) {
    SCOPED_TRACE(dist ? "with the distribution statistics" : "without the distribution statistics");
    fc::LpRows r{d_t, 1, true, -100, N, 0, V, 1.0f / temperature, dist};
    const auto logits_view = fusedce::matrix(d_logits, DType::kBFloat16, N, V);
    // step 1 both ways, then step 2 (and 4) on each
    float* stats_row = static_cast<float*>(upload(nullptr, (N + 1) * kW * 4));
    float* stats_fused = static_cast<float*>(upload(nullptr, (N + 1) * kW * 4));
    auto* partials = static_cast<float4*>(upload(nullptr, fc::lp_fused_partial_bytes(N, V, dist)));
    fc::launch_lp_stats(r, logits_view, stats_row, nullptr);
    fc::LpFusedProduct p{N, V, H, d_hid, H, d_w, H, r, nullptr, dev};
    ASSERT_OK(fc::run_lp_stats_product(p, partials));
    fc::launch_lp_fold_tiles(r, partials, fc::lp_fused_tiles(V), fc::kLpFusedTile, V, stats_fused, nullptr);
    ASSERT_CUDA(cudaDeviceSynchronize());
    auto merged = [&](const float* stats) {
      float* out = static_cast<float*>(upload(nullptr, 6 * N * 4));
      fc::launch_lp_merge(r, stats, 1, fusedce::vector(out, DType::kFloat32, N),
                          fusedce::vector(out + N, DType::kFloat32, N), fusedce::vector(out + 2 * N, DType::kFloat32, N),
                          nullptr);
      if (dist)
        fc::launch_lp_distribution_stats(r, stats, 1, fusedce::vector(out + 3 * N, DType::kFloat32, N),
                                         fusedce::vector(out + 4 * N, DType::kFloat32, N),
                                         fusedce::vector(out + 5 * N, DType::kFloat32, N), nullptr);
      std::vector<float> h(6 * N, 0.0f);
      EXPECT_EQ(cudaMemcpy(h.data(), out, (dist ? 6 : 3) * N * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      return std::make_pair(out, h);
    };
    const auto [out_row, want] = merged(stats_row);
    const auto [out_fused, got] = merged(stats_fused);
    (void)out_fused;
    int bad = 0;
    for (int64_t i = 0; i < N && bad < 5; ++i) {
      // a few float32 ulps of lse's size; the mean logit's sums of 2001 terms of at most 64 / T
      const double scale = 2e-6 * (1.0 + std::abs(want[2 * N + i]));
      const bool ok = std::abs(got[i] - want[i]) <= scale && std::abs(got[N + i] - want[N + i]) <= 1e-5 * want[N + i] + 1e-7 &&
                      std::abs(got[2 * N + i] - want[2 * N + i]) <= scale &&
                      (!dist || (std::abs(got[3 * N + i] - want[3 * N + i]) <= 2e-6 * (1.0 + std::abs(want[3 * N + i])) &&
                                 std::abs(got[4 * N + i] - want[4 * N + i]) <= 1e-6 * 64 / temperature &&
                                 got[5 * N + i] == want[5 * N + i]));
      EXPECT_TRUE(ok) << "row " << i << ": logprob " << got[i] << " / " << want[i] << ", entropy " << got[N + i] << " / "
                      << want[N + i] << ", lse " << got[2 * N + i] << " / " << want[2 * N + i] << ", log_sum_sq "
                      << got[3 * N + i] << " / " << want[3 * N + i] << ", mean " << got[4 * N + i] << " / "
                      << want[4 * N + i] << ", is_top1 " << got[5 * N + i] << " / " << want[5 * N + i];
      bad += !ok;
    }
    // step 3 both ways from the row kernels' step 2, into rows of a stride the fused product
    // can write: a multiple of 8 (the logits buffer's: whole tiles staged through shared memory,
    // 16-byte stores) and one of 2 but not 8 (pair stores from registers only)
    float* o = out_row;
    fc::LpRows rg = r;  // the gradient gathers no distribution statistics
    rg.dist = false;
    fc::LpFusedProduct pg = p;
    pg.r = rg;
    const auto vec = [&](float* x) { return fusedce::vector(x, DType::kFloat32, N); };
    fc::LpFusedGrad g{o + 2 * N, o, o + N, static_cast<float*>(d_glp), static_cast<float*>(d_gh), 1, 1, 1, 1, 1,
                      nullptr, 0};
    for (const int64_t ld : {(V + 7) / 8 * 8, (V + 7) / 8 * 8 + 2}) {
      SCOPED_TRACE(ld % 8 == 0 ? "dlogits rows of a stride of 8" : "dlogits rows of a stride of 2 mod 8");
      void* dl_row = upload(nullptr, N * ld * 2);
      void* dl_fused = upload(nullptr, N * ld * 2);
      fc::launch_lp_backward(rg, logits_view, fusedce::matrix(dl_row, DType::kBFloat16, N, V, ld), vec(o + 2 * N),
                             vec(o), vec(o + N), vec(static_cast<float*>(d_glp)), vec(static_cast<float*>(d_gh)),
                             nullptr);
      g.dlogits = dl_fused;
      g.ld_dlogits = ld;
      ASSERT_OK(fc::run_lp_dlogits_product(pg, g));
      ASSERT_CUDA(cudaDeviceSynchronize());
      std::vector<uint16_t> a(N * ld), b(N * ld);
      ASSERT_CUDA(cudaMemcpy(a.data(), dl_row, a.size() * 2, cudaMemcpyDeviceToHost));
      ASSERT_CUDA(cudaMemcpy(b.data(), dl_fused, b.size() * 2, cudaMemcpyDeviceToHost));
      int64_t same = 0, far = 0;
      for (int64_t e = 0; e < N * V; ++e) {
        const int64_t k = e / V * ld + e % V;
        same += a[k] == b[k];
        // one unit of bf16 in the last place (same sign: adjacent bit patterns)
        const bool near = bf16_to_float(a[k]) == bf16_to_float(b[k]) ||
                          ((a[k] >> 15) == (b[k] >> 15) && std::abs(int(a[k]) - int(b[k])) <= 1);
        if (!near && far++ < 5)
          ADD_FAILURE() << "dlogits[" << e / V << ", " << e % V << "]: fused " << bf16_to_float(b[k]) << ", row kernel "
                        << bf16_to_float(a[k]);
      }
      EXPECT_EQ(far, 0);
      std::printf("[ fused dlogits ] row stride %lld: %lld of %lld bits identical to the row kernel's\n",
                  static_cast<long long>(ld), static_cast<long long>(same), static_cast<long long>(N * V));
    }
    // Two vocabulary chunks, [0, 1000) and [1000, V), as the recomputing backward walks them: the
    // first ends inside the tile [960, 1152), which holds the targets of the rows whose target
    // lies in [1000, 1152) (about 18 of them) without the chunk holding them. Each chunk by both
    // into a buffer whose rows run a tile past the chunk's columns, one row more: the same
    // dlogits, and the padding columns and the spare row untouched (a store past the chunk's end
    // lands there, whatever order the tiles' stores come in).
    if (!dist) {
      for (const int64_t v0 : {int64_t(0), int64_t(1000)})
      for (const int64_t pad : {int64_t(0), int64_t(2)}) {
        SCOPED_TRACE(v0 == 0 ? "vocabulary chunk [0, 1000)" : "vocabulary chunk [1000, V)");
        SCOPED_TRACE(pad == 0 ? "dlogits rows of a stride of 8" : "dlogits rows of a stride of 2 mod 8");
        const int64_t vc = v0 == 0 ? 1000 : V - 1000, ldc = (vc + 7) / 8 * 8 + fc::kLpFusedTile + pad;
        fc::LpRows rc = rg;
        rc.vocab_start = v0;
        fc::LpFusedProduct pc = pg;
        pc.r = rc;
        pc.cols = vc;
        pc.weight = static_cast<const uint16_t*>(d_w) + v0 * H;
        void* c_row = upload(nullptr, (N + 1) * ldc * 2);
        void* c_fused = upload(nullptr, (N + 1) * ldc * 2);
        ASSERT_CUDA(cudaMemset(c_row, 0xCD, (N + 1) * ldc * 2));
        ASSERT_CUDA(cudaMemset(c_fused, 0xCD, (N + 1) * ldc * 2));
        const auto chunk_logits = fusedce::matrix(static_cast<uint16_t*>(d_logits) + v0, DType::kBFloat16, N, vc, V);
        fc::launch_lp_backward(rc, chunk_logits, fusedce::matrix(c_row, DType::kBFloat16, N, vc, ldc), vec(o + 2 * N),
                               vec(o), vec(o + N), vec(static_cast<float*>(d_glp)), vec(static_cast<float*>(d_gh)),
                               nullptr);
        fc::LpFusedGrad gc = g;
        gc.dlogits = c_fused;
        gc.ld_dlogits = ldc;
        ASSERT_OK(fc::run_lp_dlogits_product(pc, gc));
        ASSERT_CUDA(cudaDeviceSynchronize());
        std::vector<uint16_t> ca((N + 1) * ldc), cb((N + 1) * ldc);
        ASSERT_CUDA(cudaMemcpy(ca.data(), c_row, ca.size() * 2, cudaMemcpyDeviceToHost));
        ASSERT_CUDA(cudaMemcpy(cb.data(), c_fused, cb.size() * 2, cudaMemcpyDeviceToHost));
        int64_t off = 0, touched = 0;
        for (int64_t k = 0; k < (N + 1) * ldc; ++k) {
          if (k / ldc < N && k % ldc < vc) {
            const bool near = bf16_to_float(ca[k]) == bf16_to_float(cb[k]) ||
                              ((ca[k] >> 15) == (cb[k] >> 15) && std::abs(int(ca[k]) - int(cb[k])) <= 1);
            if (!near && off++ < 5)
              ADD_FAILURE() << "dlogits[" << k / ldc << ", " << v0 + k % ldc << "]: fused " << bf16_to_float(cb[k])
                            << ", row kernel " << bf16_to_float(ca[k]);
          } else if (cb[k] != 0xCDCD && touched++ < 5) {
            ADD_FAILURE() << "the fused product stored past the chunk: row " << k / ldc << ", column " << k % ldc;
          }
        }
        EXPECT_EQ(off, 0);
        EXPECT_EQ(touched, 0);
      }
    }
  }
}

// The linear cross-entropy's window form (cuda/linear/window_forward.h), asked for
// (detail::LinearForm::kWindow: the planner keeps the metrics, the soft-cap and grad_bias on the
// logits path, and these cases check the form's epilogue with each of them). Against float64 (logits from the bf16 inputs, exact), on rows the window form treats
// three ways:
// ordinary rows (every tile at offset 0), hot rows (the target's logit about 59 nats: its tile
// takes its own offset and the row is rebased) and cold rows (every logit about -60 nats: every
// tile its own offset), with ignored rows between them; six option sets (mean with metrics;
// none with per-row upstream gradients, class weights, a negative logit scale, skip_ignored, V not
// a multiple of 8 and several token chunks; sum with a causal shift, metrics and V = 2; mean with
// z-loss 0.01, class weights and metrics, one cold row's class weighted -2 z_loss lse so that its
// softmax factor a = w_t + 2 z_loss lse cancels to rounding: that row is rescaled by a / w_t;
// mean with the soft-cap 20, scale 1.3 and metrics: the hot targets capped, the stored entries
// carrying 1 - (z / c)^2; none with a bias and grad_bias (E^T bf16(r): r's rounding besides E's),
// the soft-cap 30, z-loss and several chunks; three with label smoothing, whose uniform term rides
// the products' extra rows: mean with 0.1, class weights and metrics; none with 0.2, a bias and
// grad_bias, z-loss, scale 0.7, skip_ignored and several chunks; sum with 0.3, a causal shift,
// class weights and several chunks); and V = 385 (odd: the epilogue's last column pair split; with
// label smoothing, a bias and metrics) and V = 1 (with z-loss, so that the gradient is not 0).
// Tolerances: the loss and lse come from float32 logits (the product's accumulators and a float32
// dot product for the target), so a row's error is a few float32 roundoffs of its logits' size:
// 2e-5 (1 + |lse| + |z_t|), the loss that times its lse factor (1 - eps) w_t + eps W / V + 2 z_loss
// |lse| (W the class weights' sum, V without them; the smoothing's mean logit is within the
// largest |z|); bf16 logits would miss a
// 59-nat target logit by up to 0.125, which this fails. Gradients: dlogits r E carry E's bf16 rounding (2^-9) and grad_weight's operand
// bf16(r h) one more, the output one more: elementwise 2^-8 |ref| + 1e-2 max |ref| (the bf16
// rule of test_linear.cpp), and the projection sum got ref / sum ref ref within 2e-3 of 1, which
// averages the roundings out so that a 0.5% scale error fails (where at least 100 elements carry
// the norm). Metrics on and off: the same bits.
TEST(CudaLinearWindow, MatchesFloat64WithRowsOutsideTheWindow) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  int dev = 0;
  ASSERT_CUDA(cudaGetDevice(&dev));
  if (!fusedce::cuda::cutlass_products_available(dev)) GTEST_SKIP() << "the window form runs on sm_90 builds with CUTLASS";
  using fusedce::detail::bf16_to_float;
  using fusedce::detail::float_to_bf16;
  struct Case {
    const char* name;
    int64_t N, H, V;
    fusedce::Reduction reduction;
    float scale;
    bool class_weight, skip, metrics;
    int64_t shift;
    size_t budget;
    float z_loss;
    bool cancel;  // one cold row's target weighted -2 z_loss lse: its a = w_t + 2 z_loss lse cancels
    float softcap;
    bool bias;  // a bias and grad_bias
    float smoothing;
  };
  const Case cases[] = {
      {"mean, metrics", 200, 64, 1000, fusedce::Reduction::kMean, 1.0f, false, false, true, 0, 0, 0.0f, false, 0.0f, false, 0.0f},
      {"none, class weights, scale -0.8, skip_ignored, V 386, chunks", 200, 64, 386, fusedce::Reduction::kNone, -0.8f,
       true, true, false, 0, size_t(64) << 10, 0.0f, false, 0.0f, false, 0.0f},
      {"sum, shift, metrics, V 2", 120, 32, 2, fusedce::Reduction::kSum, 1.0f, false, false, true, 10, 0, 0.0f, false, 0.0f, false, 0.0f},
      {"mean, z-loss, class weights, a row whose a cancels, metrics", 200, 64, 1000, fusedce::Reduction::kMean, 1.0f,
       true, false, true, 0, 0, 0.01f, true, 0.0f, false, 0.0f},
      {"mean, soft-cap 20, scale 1.3, metrics", 200, 64, 1000, fusedce::Reduction::kMean, 1.3f, false, false, true, 0, 0,
       0.0f, false, 20.0f, false, 0.0f},
      {"none, bias and grad_bias, soft-cap 30, z-loss, chunks", 200, 64, 386, fusedce::Reduction::kNone, 1.0f, false,
       false, false, 0, size_t(64) << 10, 1e-3f, false, 30.0f, true, 0.0f},
      {"mean, label smoothing 0.1, class weights, metrics", 200, 64, 1000, fusedce::Reduction::kMean, 1.0f, true, false,
       true, 0, 0, 0.0f, false, 0.0f, false, 0.1f},
      {"none, label smoothing 0.2, bias and grad_bias, z-loss, scale 0.7, skip_ignored, chunks", 200, 64, 386,
       fusedce::Reduction::kNone, 0.7f, false, true, false, 0, size_t(64) << 10, 1e-3f, false, 0.0f, true, 0.2f},
      {"sum, label smoothing 0.3, shift, class weights, chunks", 200, 64, 1000, fusedce::Reduction::kSum, 1.0f, true,
       false, false, 10, size_t(128) << 10, 0.0f, false, 0.0f, false, 0.3f},
      {"mean, V 385 (odd: a split last pair), class weights, metrics, label smoothing 0.1, bias and grad_bias", 200,
       64, 385, fusedce::Reduction::kMean, 1.0f, true, false, true, 0, 0, 0.0f, false, 0.0f, true, 0.1f},
      {"none, V 1, z-loss 0.01", 60, 32, 1, fusedce::Reduction::kNone, 1.0f, false, false, false, 0, 0, 0.01f, false,
       0.0f, false, 0.0f},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const int64_t N = c.N, H = c.H, V = c.V;
    std::mt19937_64 rng = test_rng();
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> hid(N * H), w(V * H);
    // every weight row has 1 in column 0: a cold row's hidden state -60 there shifts all its logits
    for (int64_t j = 0; j < V; ++j)
      for (int64_t k = 0; k < H; ++k) w[j * H + k] = float_to_bf16(k == 0 ? 1.0f : normal(rng) * 2.0f / std::sqrt(float(H)));
    std::vector<int64_t> tgt(N);
    for (auto& t : tgt) t = static_cast<int64_t>(rng() % V);
    for (int64_t i = 0; i < N; ++i) {
      const bool hot = i % 7 == 3, cold = i % 11 == 5;
      const int64_t t = tgt[c.shift > 0 ? std::min(i + 1, N - 1) : i];
      for (int64_t k = 0; k < H; ++k) {
        float x = normal(rng);
        if (hot) x = 12.0f * bf16_to_float(w[t * H + k]);  // z_t = 12 |w_t|^2, about 59
        if (cold && k == 0) x = -60.0f;
        hid[i * H + k] = float_to_bf16(x);
      }
      if (i % 5 == 0) tgt[i] = -100;
    }
    if (c.shift > 0) tgt[1] = 0;  // at least one counted row
    std::vector<float> cw(c.class_weight ? V : 0), up(c.reduction == fusedce::Reduction::kNone ? N : 1, 1.75f);
    for (auto& x : cw) x = 0.25f + static_cast<float>(rng() % 100) / 50.0f;
    std::vector<uint16_t> bias(c.bias ? V : 0);
    for (auto& x : bias) x = float_to_bf16(normal(rng));
    if (c.reduction == fusedce::Reduction::kNone)
      for (auto& x : up) x = 0.5f + static_cast<float>(rng() % 100) / 100.0f;

    // float64 reference: each row's logits (they do not depend on the targets), then the targets'
    // weights, then the loss and the gradients
    auto logits_of = [&](int64_t i, std::vector<double>& z) {
      for (int64_t j = 0; j < V; ++j) {
        double x = 0.0;
        for (int64_t k = 0; k < H; ++k) x += double(bf16_to_float(hid[i * H + k])) * bf16_to_float(w[j * H + k]);
        if (c.bias) x += bf16_to_float(bias[j]);
        z[j] = c.softcap > 0.0f ? c.softcap * std::tanh(c.scale * x / c.softcap) : c.scale * x;
      }
    };
    std::vector<double> loss_row(N, 0.0), lse_ref(N, 0.0), zt_ref(N, 0.0), gh_ref(N * H, 0.0), gw_ref(V * H, 0.0),
        gb_ref(V, 0.0), z(V);
    auto lse_of = [&](const std::vector<double>& zz) {
      double mx = -INFINITY, s = 0.0;
      for (double x : zz) mx = std::max(mx, x);
      for (double x : zz) s += std::exp(x - mx);
      return mx + std::log(s);
    };
    if (c.cancel) {
      // the first counted cold row gets a class no other row targets, weighted so that its a cancels
      int64_t i0 = 5;
      while (i0 < N && (i0 % 11 != 5 || tgt[i0] == -100)) ++i0;
      ASSERT_LT(i0, N);
      std::vector<bool> used(V, false);
      for (int64_t i = 0; i < N; ++i)
        if (i != i0 && tgt[i] >= 0) used[tgt[i]] = true;
      int64_t u = 0;
      while (u < V && used[u]) ++u;
      ASSERT_LT(u, V);
      tgt[i0] = u;
      logits_of(i0, z);
      cw[u] = static_cast<float>(-2.0 * c.z_loss * lse_of(z));
      ASSERT_GT(cw[u], 0.0f) << "a cold row's lse is negative";
    }
    double wsum = 0.0;  // W: the class weights' sum, V without them
    for (int64_t j = 0; j < V; ++j) wsum += c.class_weight ? cw[j] : 1.0;
    const double eps = c.smoothing;
    double denom = 0.0, loss_sum = 0.0, ent_ref = 0.0;
    int64_t correct_ref = 0;
    auto target_of = [&](int64_t i) -> int64_t {
      if (c.shift > 0) return i % c.shift == c.shift - 1 ? -100 : tgt[i + 1];
      return tgt[i];
    };
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = target_of(i);
      if (t != -100) denom += c.class_weight ? cw[t] : 1.0;
    }
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = target_of(i);
      if (t == -100) continue;
      logits_of(i, z);
      int64_t am = 0;
      for (int64_t j = 1; j < V; ++j)
        if (z[j] > z[am]) am = j;
      const double lse = lse_of(z);
      double sz = 0.0;
      for (int64_t j = 0; j < V; ++j) sz += std::exp(z[j] - lse) * z[j];
      const double wt = c.class_weight ? cw[t] : 1.0;
      const double a = (1.0 - eps) * wt + eps / V * wsum + 2.0 * c.z_loss * lse;
      double smooth = 0.0;  // sum_j v_j (lse - z_j)
      for (int64_t j = 0; j < V; ++j) smooth += (c.class_weight ? cw[j] : 1.0) * (lse - z[j]);
      lse_ref[i] = lse;
      zt_ref[i] = z[t];
      loss_row[i] = (1.0 - eps) * wt * (lse - z[t]) + eps / V * smooth + c.z_loss * lse * lse;
      loss_sum += loss_row[i];
      ent_ref += lse - sz;
      correct_ref += am == t;
      const double g = c.reduction == fusedce::Reduction::kNone ? up[i]
                       : c.reduction == fusedce::Reduction::kSum ? up[0]
                                                                 : up[0] / denom;
      for (int64_t j = 0; j < V; ++j) {
        const double dz = c.softcap > 0.0f ? c.scale * (1.0 - (z[j] / c.softcap) * (z[j] / c.softcap)) : c.scale;
        const double vj = c.class_weight ? cw[j] : 1.0;
        const double d = g * (a * std::exp(z[j] - lse) - (j == t ? (1.0 - eps) * wt : 0.0) - eps / V * vj) * dz;
        if (d == 0.0) continue;
        gb_ref[j] += d;
        for (int64_t k = 0; k < H; ++k) {
          gh_ref[i * H + k] += d * bf16_to_float(w[j * H + k]);
          gw_ref[j * H + k] += d * bf16_to_float(hid[i * H + k]);
        }
      }
    }

    DeviceAllocs mem;
    auto upload = [&](const void* host, size_t bytes) { return mem.upload(host, bytes); };
    void* d_hid = upload(hid.data(), hid.size() * 2);
    void* d_w = upload(w.data(), w.size() * 2);
    void* d_t = upload(tgt.data(), N * 8);
    void* d_cw = upload(cw.data(), cw.size() * 4);
    void* d_up = upload(up.data(), up.size() * 4);
    void* d_bias = c.bias ? upload(bias.data(), V * 2) : nullptr;
    const int64_t loss_n = c.reduction == fusedce::Reduction::kNone ? N : 1;
    struct Out {
      std::vector<float> loss, lse;
      float entropy = 0.0f;
      int64_t correct = 0;
      std::vector<uint16_t> gh, gw, gb;
    };
    auto call = [&](bool metrics) {
      Out o;
      void* d_loss = upload(nullptr, loss_n * 4);
      void* d_lse = upload(nullptr, N * 4);
      void* d_ent = upload(nullptr, 4);
      void* d_cor = upload(nullptr, 8);
      void* d_gh = upload(nullptr, N * H * 2);
      void* d_gw = upload(nullptr, V * H * 2);
      void* d_gb = c.bias ? upload(nullptr, V * 2) : nullptr;
      fusedce::Options opt;
      opt.reduction = c.reduction;
      opt.logit_scale = c.scale;
      opt.z_loss = c.z_loss;
      opt.softcap = c.softcap;
      opt.label_smoothing = c.smoothing;
      opt.return_metrics = metrics;
      if (c.class_weight) opt.class_weight = fusedce::vector(d_cw, DType::kFloat32, V);
      fusedce::LinearOptions lo;
      lo.shift_seq_len = c.shift;
      lo.skip_ignored = c.skip;
      lo.chunk_budget_bytes = c.budget;
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(d_loss, DType::kFloat32, loss_n);
      out.lse = fusedce::vector(d_lse, DType::kFloat32, N);
      if (metrics) {
        out.entropy_sum = fusedce::vector(d_ent, DType::kFloat32, 1);
        out.num_correct = fusedce::vector(d_cor, DType::kInt64, 1);
      }
      fusedce::LinearGrads g;
      g.grad_hidden = fusedce::matrix(d_gh, DType::kBFloat16, N, H);
      g.grad_weight = fusedce::matrix(d_gw, DType::kBFloat16, V, H);
      if (c.bias) g.grad_bias = fusedce::vector(d_gb, DType::kBFloat16, V);
      const fusedce::Status st = linear_forward_backward_in(
          fusedce::detail::LinearForm::kWindow, fusedce::Device::cuda(dev), fusedce::matrix(d_hid, DType::kBFloat16, N, H),
          fusedce::matrix(d_w, DType::kBFloat16, V, H),
          c.bias ? fusedce::vector(d_bias, DType::kBFloat16, V) : fusedce::VectorView{}, fusedce::vector(d_t, DType::kInt64, N),
          opt, lo, out, fusedce::vector(d_up, DType::kFloat32, up.size()), g);
      EXPECT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      o.loss.resize(loss_n);
      o.lse.resize(N);
      o.gh.resize(N * H);
      o.gw.resize(V * H);
      EXPECT_EQ(cudaMemcpy(o.loss.data(), d_loss, loss_n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(o.lse.data(), d_lse, N * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(o.gh.data(), d_gh, N * H * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      EXPECT_EQ(cudaMemcpy(o.gw.data(), d_gw, V * H * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      if (c.bias) {
        o.gb.resize(V);
        EXPECT_EQ(cudaMemcpy(o.gb.data(), d_gb, V * 2, cudaMemcpyDeviceToHost), cudaSuccess);
      }
      if (metrics) {
        EXPECT_EQ(cudaMemcpy(&o.entropy, d_ent, 4, cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(cudaMemcpy(&o.correct, d_cor, 8, cudaMemcpyDeviceToHost), cudaSuccess);
      }
      return o;
    };
    const Out got = call(c.metrics);

    int bad = 0;
    for (int64_t i = 0; i < N; ++i) {
      const int64_t t = target_of(i);
      const double tol = 2e-5 * (1.0 + std::abs(lse_ref[i]) + std::abs(zt_ref[i]));
      // the loss's error: w_t times the lse's and z_t's, plus the z-loss's 2 z_loss |lse| times the lse's
      const double wt = t == -100 || !c.class_weight ? 1.0 : cw[t];
      const bool ok = std::abs(got.lse[i] - lse_ref[i]) <= tol &&
                      (loss_n == 1 || std::abs(got.loss[i] - loss_row[i]) <=
                                          tol * ((1.0 - eps) * wt + eps * wsum / V + 2.0 * c.z_loss * std::abs(lse_ref[i])));
      if (!ok && ++bad <= 5) ADD_FAILURE() << "row " << i << ": lse " << got.lse[i] << " / " << lse_ref[i] << ", loss " << (loss_n == 1 ? 0.0f : got.loss[i]) << " / " << loss_row[i];
    }
    EXPECT_EQ(bad, 0);
    if (loss_n == 1) {
      const double want = c.reduction == fusedce::Reduction::kMean ? loss_sum / denom : loss_sum;
      EXPECT_NEAR(got.loss[0], want, 2e-5 * (std::abs(want) + 1.0));
    }
    auto check_grad = [&](const char* what, const std::vector<uint16_t>& g, const std::vector<double>& ref) {
      double mx = 0.0, dot = 0.0, rr = 0.0, r4 = 0.0;
      for (double v : ref) mx = std::max(mx, std::abs(v));
      int wrong = 0;
      for (size_t k = 0; k < ref.size(); ++k) {
        const double x = bf16_to_float(g[k]);
        dot += x * ref[k];
        rr += ref[k] * ref[k];
        r4 += ref[k] * ref[k] * ref[k] * ref[k];
        if (!(std::abs(x - ref[k]) <= std::ldexp(1.0, -8) * std::abs(ref[k]) + 1e-2 * mx) && ++wrong <= 3) {
          ADD_FAILURE() << what << "[" << k << "]: " << x << " / " << ref[k] << " (largest " << mx << ")";
        }
      }
      EXPECT_EQ(wrong, 0) << what;
      // The projection averages the roundings over the elements that carry the norm, (sum ref^2)^2
      // / sum ref^4 of them: a few (V = 2: grad_weight's 64 elements, two of them dominant)
      // leave it one output rounding (2^-9) from 1, and only the elementwise check applies.
      if (rr * rr >= 100.0 * r4) {
        EXPECT_NEAR(dot / rr, 1.0, 2e-3) << what << ": the projection on the reference";
      }
    };
    check_grad("grad_hidden", got.gh, gh_ref);
    check_grad("grad_weight", got.gw, gw_ref);
    if (c.bias) check_grad("grad_bias", got.gb, gb_ref);
    if (c.metrics) {
      EXPECT_NEAR(got.entropy, ent_ref, 2e-4 * std::abs(ent_ref) + 1e-3);
      EXPECT_NEAR(static_cast<double>(got.correct), static_cast<double>(correct_ref), 1.0);
      const Out plain = call(false);
      EXPECT_EQ(plain.loss, got.loss);
      EXPECT_EQ(plain.lse, got.lse);
      EXPECT_EQ(plain.gh, got.gh);
      EXPECT_EQ(plain.gw, got.gw);
    }
  }
}

// The window form's argmax (metrics, asked for) in torch.argmax's order: the first NaN of a row,
// else the first of its largest logits. Exact ties: the weight rows of one tie set are copies of
// one another, so their logits are the same bits in float32 as in float64 (one MMA order for
// every column); every row is hot on one set (the set's logit 32, the others about N(0, 2^2)), so
// that the set holds its maximum by a wide margin (checked on the inputs: no near-tie outside a
// set). The sets span
// a lane's column pair, quads, tiles (192 columns) and the partial last tile (V = 1000). The
// cases: ties only; a hidden row with a NaN (its logits all NaN: its argmax is column 0); a
// weight row with a NaN (every row's argmax is that column, 450, in the third tile). The
// count of correct rows is compared exactly with the reference (targets on the lowest tie and
// on a later one), and metrics on and off give the same loss bits where nothing is NaN.
TEST(CudaLinearWindow, ArgmaxFollowsTorchOrder) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  int dev = 0;
  ASSERT_CUDA(cudaGetDevice(&dev));
  if (!fusedce::cuda::cutlass_products_available(dev)) GTEST_SKIP() << "the window form runs on sm_90 builds with CUTLASS";
  using fusedce::detail::bf16_to_float;
  using fusedce::detail::float_to_bf16;
  constexpr int64_t N = 300, H = 16, V = 1000;
  const std::vector<std::vector<int64_t>> sets = {{5, 200, 201, 383, 999}, {400, 401, 590, 768}, {961, 962, 998}};
  struct Case {
    const char* name;
    bool nan_hidden, nan_weight;
  };
  const Case cases[] = {{"ties", false, false}, {"ties, a NaN hidden row", true, false}, {"ties, a NaN weight row", false, true}};
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    std::mt19937_64 rng = test_rng();
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint16_t> hid(N * H), w(V * H);
    // set s: weight rows 4 e_s; the other rows 0.25 N(0, 1); a hot row of set s: 8 e_s plus 0.5
    // N(0, 1) off dimension s, so that the set's logit is 32 and the others about N(0, 2^2)
    for (auto& x : w) x = float_to_bf16(0.25f * normal(rng));
    for (size_t s = 0; s < sets.size(); ++s)
      for (int64_t j : sets[s])
        for (int64_t k = 0; k < H; ++k) w[j * H + k] = float_to_bf16(k == int64_t(s) ? 4.0f : 0.0f);
    std::vector<int64_t> tgt(N);
    for (int64_t i = 0; i < N; ++i) {
      const size_t s = i % sets.size();
      for (int64_t k = 0; k < H; ++k) hid[i * H + k] = float_to_bf16(k == int64_t(s) ? 8.0f : 0.5f * normal(rng));
      tgt[i] = i % 5 == 4 ? -100 : sets[s][(i / sets.size()) % sets[s].size()];  // the lowest tie, or a later one
    }
    const int64_t nan_row = 37;
    if (c.nan_hidden) {
      hid[nan_row * H + 3] = 0x7fc0;  // a quiet NaN
      tgt[nan_row] = 0;
    }
    if (c.nan_weight) {
      w[450 * H + 7] = 0x7fc0;
      for (int64_t i = 0; i < N; i += 4) tgt[i] = 450;
    }
    // float64 reference: torch.argmax of each row's logits (a NaN first, then the first maximum)
    int64_t correct_ref = 0;
    std::vector<double> z(V);
    for (int64_t i = 0; i < N; ++i) {
      int64_t am = -1;
      for (int64_t j = 0; j < V; ++j) {
        z[j] = 0.0;
        for (int64_t k = 0; k < H; ++k) z[j] += double(bf16_to_float(hid[i * H + k])) * bf16_to_float(w[j * H + k]);
        const bool nan = std::isnan(z[j]);
        if (am < 0 || (nan && !std::isnan(z[am])) || (!std::isnan(z[am]) && z[j] > z[am])) am = j;
      }
      if (!std::isnan(z[am])) {
        double second = -INFINITY;
        for (int64_t j = 0; j < V; ++j)
          if (z[j] < z[am]) second = std::max(second, z[j]);
        ASSERT_GT(z[am] - second, 1.0) << "row " << i << ": a near-tie outside a set";
      }
      if (tgt[i] != -100 && tgt[i] == am) ++correct_ref;
    }
    ASSERT_GT(correct_ref, 0);

    DeviceAllocs mem;
    auto upload = [&](const void* host, size_t bytes) { return mem.upload(host, bytes); };
    void* d_hid = upload(hid.data(), hid.size() * 2);
    void* d_w = upload(w.data(), w.size() * 2);
    void* d_t = upload(tgt.data(), N * 8);
    auto call = [&](bool metrics, std::vector<float>* loss) {
      void* d_loss = upload(nullptr, N * 4);
      void* d_ent = upload(nullptr, 4);
      void* d_cor = upload(nullptr, 8);
      fusedce::Options opt;
      opt.reduction = fusedce::Reduction::kNone;
      opt.return_metrics = metrics;
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(d_loss, DType::kFloat32, N);
      if (metrics) {
        out.entropy_sum = fusedce::vector(d_ent, DType::kFloat32, 1);
        out.num_correct = fusedce::vector(d_cor, DType::kInt64, 1);
      }
      std::vector<float> up(N, 1.0f);
      fusedce::LinearGrads g;
      g.grad_hidden = fusedce::matrix(upload(nullptr, N * H * 2), DType::kBFloat16, N, H);
      g.grad_weight = fusedce::matrix(upload(nullptr, V * H * 2), DType::kBFloat16, V, H);
      const fusedce::Status st = linear_forward_backward_in(
          fusedce::detail::LinearForm::kWindow, fusedce::Device::cuda(dev), fusedce::matrix(d_hid, DType::kBFloat16, N, H),
          fusedce::matrix(d_w, DType::kBFloat16, V, H), fusedce::VectorView{}, fusedce::vector(d_t, DType::kInt64, N), opt,
          fusedce::LinearOptions{}, out, fusedce::vector(upload(up.data(), N * 4), DType::kFloat32, N), g);
      EXPECT_TRUE(st.ok()) << st.message();
      EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      loss->resize(N);
      EXPECT_EQ(cudaMemcpy(loss->data(), d_loss, N * 4, cudaMemcpyDeviceToHost), cudaSuccess);
      int64_t correct = -1;
      if (metrics) {
        EXPECT_EQ(cudaMemcpy(&correct, d_cor, 8, cudaMemcpyDeviceToHost), cudaSuccess);
      }
      return correct;
    };
    std::vector<float> loss_on, loss_off;
    EXPECT_EQ(call(true, &loss_on), correct_ref);
    call(false, &loss_off);
    if (!c.nan_weight) {
      for (int64_t i = 0; i < N; ++i) {
        if (c.nan_hidden && i == nan_row) continue;
        EXPECT_EQ(0, std::memcmp(&loss_on[i], &loss_off[i], 4)) << "row " << i << ": metrics on and off";
      }
    }
  }
}

// The window form (asked for) over more than 2^31 logits in one chunk (8193 x 262144, the last row starting at
// element 2^31; a 5 GiB budget holds every row, so E, the partials and every product index past
// int32): reduction none, bf16, H = 16, logits exact in bf16 (hidden in {-1, 0, 1}, weight in
// k / 8) of standard deviation about 4; upstream gradients on four rows (the first, the middle,
// the last two), 0 elsewhere. Checked against float64: lse and loss at eight rows (2e-5 (1 + |lse|
// + |z_t|), the float32 sums' rounding), grad_hidden at the four rows and grad_weight over every
// entry (elementwise 2^-8 |ref| + 1e-2 max |ref|, the bf16 rule of the test above), and that the
// ignored rows give 0.
TEST(CudaLinearWindow, MoreThan2To31LogitsInOneChunk) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  int dev = 0;
  ASSERT_CUDA(cudaGetDevice(&dev));
  if (!fusedce::cuda::cutlass_products_available(dev)) GTEST_SKIP() << "the window form runs on sm_90 builds with CUTLASS";
  using fusedce::detail::bf16_to_float;
  using fusedce::detail::float_to_bf16;
  constexpr int64_t N = 8193, V = 262144, H = 16;
  ASSERT_EQ((N - 1) * V, int64_t(1) << 31) << "the last row starts at element 2^31";
  std::mt19937_64 rng = test_rng();
  std::vector<uint16_t> hid(N * H), w(V * H);
  for (auto& x : hid) x = float_to_bf16(static_cast<float>(static_cast<int>(rng() % 3) - 1));
  for (auto& x : w) x = float_to_bf16(static_cast<float>(static_cast<int>(rng() % 33) - 16) / 8.0f);
  const std::vector<int64_t> checked{0, 1, 4095, 4096, 8191, 8192, 1234, 7777};
  const std::vector<int64_t> weighted{0, 4096, 8191, 8192};
  std::vector<int64_t> tgt(N);
  for (int64_t i = 0; i < N; ++i) {
    const bool keep = std::find(checked.begin(), checked.end(), i) != checked.end();
    tgt[i] = !keep && rng() % 10 < 3 ? -100 : static_cast<int64_t>(rng() % V);
  }
  std::vector<float> up(N, 0.0f);
  for (int64_t i : weighted) up[i] = 0.5f + static_cast<float>(rng() % 100) / 100.0f;

  DeviceAllocs mem;
  void* d_hid = mem.upload(hid.data(), hid.size() * 2);
  void* d_w = mem.upload(w.data(), w.size() * 2);
  void* d_t = mem.upload(tgt.data(), N * 8);
  void* d_up = mem.upload(up.data(), N * 4);
  void* d_loss = mem.upload(nullptr, N * 4);
  void* d_lse = mem.upload(nullptr, N * 4);
  void* d_gh = mem.upload(nullptr, N * H * 2);
  void* d_gw = mem.upload(nullptr, V * H * 2);
  fusedce::Options opt;
  opt.reduction = fusedce::Reduction::kNone;
  fusedce::LinearOptions lo;
  lo.chunk_budget_bytes = size_t(5) << 30;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(d_loss, DType::kFloat32, N);
  out.lse = fusedce::vector(d_lse, DType::kFloat32, N);
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(d_gh, DType::kBFloat16, N, H);
  g.grad_weight = fusedce::matrix(d_gw, DType::kBFloat16, V, H);
  const fusedce::Status st = linear_forward_backward_in(
      fusedce::detail::LinearForm::kWindow, fusedce::Device::cuda(dev), fusedce::matrix(d_hid, DType::kBFloat16, N, H),
      fusedce::matrix(d_w, DType::kBFloat16, V, H), fusedce::VectorView{}, fusedce::vector(d_t, DType::kInt64, N), opt,
      lo, out, fusedce::vector(d_up, DType::kFloat32, N), g);
  ASSERT_TRUE(st.ok()) << st.message();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  std::vector<float> loss(N), lse(N);
  std::vector<uint16_t> gh(N * H), gw(V * H);
  ASSERT_EQ(cudaMemcpy(loss.data(), d_loss, N * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(lse.data(), d_lse, N * 4, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(gh.data(), d_gh, N * H * 2, cudaMemcpyDeviceToHost), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(gw.data(), d_gw, V * H * 2, cudaMemcpyDeviceToHost), cudaSuccess);

  int64_t bad = 0;
  for (int64_t i = 0; i < N; ++i) {
    if (tgt[i] == -100 && (loss[i] != 0.0f || lse[i] != 0.0f) && bad++ < 5) {
      ADD_FAILURE() << "ignored row " << i << ": loss " << loss[i] << ", lse " << lse[i];
    }
  }
  EXPECT_EQ(bad, 0);
  std::vector<double> gh_ref(N * H, 0.0), gw_ref(V * H, 0.0), z(V);
  for (int64_t i : checked) {
    double mx = -INFINITY;
    for (int64_t j = 0; j < V; ++j) {
      double x = 0.0;
      for (int64_t k = 0; k < H; ++k) x += double(bf16_to_float(hid[i * H + k])) * bf16_to_float(w[j * H + k]);
      z[j] = x;
      mx = std::max(mx, x);
    }
    double s = 0.0;
    for (int64_t j = 0; j < V; ++j) s += std::exp(z[j] - mx);
    const double l = mx + std::log(s), zt = z[tgt[i]];
    const double tol = 2e-5 * (1.0 + std::abs(l) + std::abs(zt));
    EXPECT_NEAR(lse[i], l, tol) << "row " << i;
    EXPECT_NEAR(loss[i], l - zt, tol) << "row " << i;
    if (up[i] == 0.0f) continue;
    for (int64_t j = 0; j < V; ++j) {
      const double d = up[i] * (std::exp(z[j] - l) - (j == tgt[i] ? 1.0 : 0.0));
      for (int64_t k = 0; k < H; ++k) {
        gh_ref[i * H + k] += d * bf16_to_float(w[j * H + k]);
        gw_ref[j * H + k] += d * bf16_to_float(hid[i * H + k]);
      }
    }
  }
  auto check = [&](const char* what, const std::vector<uint16_t>& got, const std::vector<double>& ref) {
    double mx = 0.0;
    for (double v : ref) mx = std::max(mx, std::abs(v));
    ASSERT_GT(mx, 0.0) << what;
    int64_t wrong = 0;
    for (size_t k = 0; k < ref.size(); ++k) {
      const double x = bf16_to_float(got[k]);
      if (!(std::abs(x - ref[k]) <= std::ldexp(1.0, -8) * std::abs(ref[k]) + 1e-2 * mx) && ++wrong <= 3) {
        ADD_FAILURE() << what << "[" << k << "]: " << x << " / " << ref[k] << " (largest " << mx << ")";
      }
    }
    EXPECT_EQ(wrong, 0) << what;
  };
  check("grad_hidden", gh, gh_ref);
  check("grad_weight", gw, gw_ref);
}

}  // namespace
}  // namespace fusedce_test
