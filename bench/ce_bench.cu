// Cross-entropy kernel benchmark: the ceilings first, then each job at language-model shapes
// (the `shapes` list in main: vocabularies of 32000 to 262144 in bfloat16, one float32 case, and
// 64 x 262144 for few rows).
//
// Ceilings, measured in the same run: device-to-device copy (cudaMemcpyAsync; bytes = read +
// written) and a streaming read (a plain reduction kernel of our own; bytes = read).
// Jobs and their byte formulas (the fewest bytes each must move):
//   forward            N * V * elem          (logits read once; N floats out are negligible)
//   forward+gradient   2 * N * V * elem      (logits read once, dlogits written once)
//   backward           2 * N * V * elem      (logits read, dlogits written)
// Timing: CUDA events around each launch sequence, after warm-up; median of many; inputs rotated
// over enough copies to exceed the L2 several times, so every run reads from device memory.
// "median ms" waits for each call before the next (an isolated call: the host's launch latency
// counts where the GPU work is shorter); "queued ms" enqueues all calls back to back with their
// events and waits once (the GPU time per call in a stream kept busy, as in training).
// Usage: fusedce_bench [--quick] [--csv FILE] [--shapes NxV[:f32|bf16|f16],... (instead of the
//        default shapes: cheaper A/B runs)] [--variant NAME (the launcher's plan under one
//        explicit choice, for A/B runs in one binary: sync, halves, groups1, groups2, separate,
//        rowkernel)] [--sweep-splits (few rows: chunks per split)] [--options (each option
//        alone, fwd+grad)]
//        [--profile (for ncu)] [--l2-persist-kb KB|max (the L2 set-aside for persisting lines,
//        cudaLimitPersistingL2CacheSize, set before timing: the first sweep's evict_last lines
//        live there; a dev experiment)]
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common/call.h"
#include "cuda/ce/plan.h"
#include "fusedce/fusedce.h"

#define CHECK_CUDA(x)                                                                       \
  do {                                                                                      \
    cudaError_t e_ = (x);                                                                   \
    if (e_ != cudaSuccess) {                                                                \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

namespace {

using fusedce::DType;

struct Timing {
  double median_ms, min_ms, max_ms;
};

template <typename F>
Timing time_it(F&& fn, int warmup, int iters) {
  cudaEvent_t a, b;
  CHECK_CUDA(cudaEventCreate(&a));
  CHECK_CUDA(cudaEventCreate(&b));
  for (int i = 0; i < warmup; ++i) fn(i);
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<double> ms;
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(a));
    fn(warmup + i);
    CHECK_CUDA(cudaEventRecord(b));
    CHECK_CUDA(cudaEventSynchronize(b));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, a, b));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK_CUDA(cudaEventDestroy(a));
  CHECK_CUDA(cudaEventDestroy(b));
  return Timing{ms[ms.size() / 2], ms.front(), ms.back()};
}

/// Events around each call, all enqueued before one wait: per-call GPU time, the host ahead.
template <typename F>
double time_queued(F&& fn, int warmup, int iters) {
  std::vector<cudaEvent_t> ev(2 * iters);
  for (auto& e : ev) CHECK_CUDA(cudaEventCreate(&e));
  for (int i = 0; i < warmup; ++i) fn(i);
  for (int i = 0; i < iters; ++i) {
    CHECK_CUDA(cudaEventRecord(ev[2 * i]));
    fn(warmup + i);
    CHECK_CUDA(cudaEventRecord(ev[2 * i + 1]));
  }
  CHECK_CUDA(cudaDeviceSynchronize());
  std::vector<double> ms(iters);
  for (int i = 0; i < iters; ++i) {
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, ev[2 * i], ev[2 * i + 1]));
    ms[i] = t;
  }
  for (auto& e : ev) CHECK_CUDA(cudaEventDestroy(e));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

__global__ void read_kernel(const uint4* p, int64_t n, unsigned* out) {
  unsigned acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const uint4 v = __ldcs(p + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (acc == 0x12345678u) *out = acc;  // keeps the loads alive; practically never stores
}

// Logits ~ N(0, 2) with a few outliers, from a counter hash (no host upload).
template <typename T>
__global__ void fill_kernel(T* p, int64_t n, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 1) * 0x9E3779B97F4A7C15ull ^ seed;
    h ^= h >> 31;
    h *= 0xBF58476D1CE4E5B9ull;
    h ^= h >> 29;
    const float u1 = ((h >> 40) + 1) * (1.0f / 16777217.0f), u2 = ((h >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    float v = 2.0f * sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
    if ((h & 0x3ff) == 0) v += 12.0f;
    p[i] = static_cast<T>(v);
  }
}

__global__ void target_kernel(int64_t* t, int64_t n, int64_t V, uint64_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint64_t h = (i + 7) * 0xD1B54A32D192ED03ull ^ seed;
    h ^= h >> 33;
    t[i] = static_cast<int64_t>(h % static_cast<uint64_t>(V));
  }
}

size_t elem_size(DType d) { return d == DType::kFloat32 ? 4 : 2; }

void fill(void* p, DType d, int64_t n, uint64_t seed) {
  if (d == DType::kFloat32) fill_kernel<<<4096, 256>>>(static_cast<float*>(p), n, seed);
  if (d == DType::kBFloat16) fill_kernel<<<4096, 256>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  if (d == DType::kFloat16) fill_kernel<<<4096, 256>>>(static_cast<__half*>(p), n, seed);
  CHECK_CUDA(cudaGetLastError());
}

void ok(const fusedce::Status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "fusedce: %s\n", s.message().c_str());
    std::exit(1);
  }
}

// The launcher's plan for A/B runs (--variant, --sweep-splits), passed to it explicitly; with
// none the calls go through the public entry points.
fusedce::cuda::PlanChoices g_choices;
bool g_variant = false;

fusedce::Status run_variant(const fusedce::detail::CeCall& call) {
  const fusedce::Status s = fusedce::detail::validate_call(call);
  return s.ok() ? fusedce::cuda::run(call, g_choices) : s;
}

fusedce::Status ce_forward(const fusedce::Device& dev, const fusedce::MatrixView& x, const fusedce::VectorView& t,
                           const fusedce::Options& o, const fusedce::ForwardOutputs& out, fusedce::Workspace w) {
  if (!g_variant) return fusedce::cross_entropy_forward(dev, x, t, o, out, w);
  fusedce::detail::CeCall c{};
  c.job = fusedce::Job::kForward;
  c.device = dev;
  c.logits = x;
  c.target = t;
  c.options = o;
  c.out = out;
  c.workspace = w;
  return run_variant(c);
}

fusedce::Status ce_forward_backward(const fusedce::Device& dev, const fusedce::MatrixView& x,
                                    const fusedce::VectorView& t, const fusedce::Options& o,
                                    const fusedce::ForwardOutputs& out, const fusedce::MatrixView& d,
                                    fusedce::Workspace w) {
  if (!g_variant) return fusedce::cross_entropy_forward_backward(dev, x, t, o, out, {}, d, w);
  fusedce::detail::CeCall c{};
  c.job = fusedce::Job::kForwardBackward;
  c.device = dev;
  c.logits = x;
  c.target = t;
  c.options = o;
  c.out = out;
  c.dlogits = d;
  c.workspace = w;
  return run_variant(c);
}

/// --variant NAME: false if the name is unknown.
bool set_variant(const char* name) {
  using Force = fusedce::cuda::PlanChoices::Force;
  fusedce::cuda::PlanChoices c;
  if (!std::strcmp(name, "sync")) c.async_reduce = false;
  else if (!std::strcmp(name, "halves")) c.halves = Force::kOn;
  else if (!std::strcmp(name, "groups1")) c.groups = 1;
  else if (!std::strcmp(name, "groups2")) c.groups = 2;
  else if (!std::strcmp(name, "separate")) c.stream_finish = false;
  else if (!std::strcmp(name, "rowkernel")) c.stream = Force::kOff;
  else if (std::strcmp(name, "default") != 0) return false;
  g_choices = c;
  g_variant = std::strcmp(name, "default") != 0;
  return true;
}

struct Ceilings {
  double copy_gbs, read_gbs;
};

Ceilings measure_ceilings(int iters) {
  const size_t bytes = size_t(2) << 30;
  void *a, *b;
  unsigned* sink;
  CHECK_CUDA(cudaMalloc(&a, bytes));
  CHECK_CUDA(cudaMalloc(&b, bytes));
  CHECK_CUDA(cudaMalloc(&sink, 4));
  CHECK_CUDA(cudaMemset(a, 1, bytes));
  Timing copy = time_it([&](int) { CHECK_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, 3, iters);
  int sms = 0;
  CHECK_CUDA(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Timing read = time_it([&](int i) {
    read_kernel<<<sms * 8, 512>>>(static_cast<const uint4*>(i % 2 ? a : b), bytes / 16, sink);
  }, 3, iters);
  CHECK_CUDA(cudaFree(a));
  CHECK_CUDA(cudaFree(b));
  CHECK_CUDA(cudaFree(sink));
  return Ceilings{2.0 * bytes / (copy.median_ms * 1e6), bytes / (read.median_ms * 1e6)};
}

struct Shape {
  int64_t N, V;
  DType dtype;
};

/// "NxV[:dtype],..." (dtype f32, bf16 or f16; bf16 when left out) into `out`; false on a bad list.
bool parse_shapes(const char* arg, std::vector<Shape>& out) {
  std::vector<Shape> parsed;
  std::string list(arg);
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    long long n = 0, v = 0;
    char dt[8] = "bf16";
    const int got = std::sscanf(item.c_str(), "%lldx%lld:%7s", &n, &v, dt);
    if (got < 2 || n < 1 || v < 1) return false;
    const std::string d(dt);
    if (d != "f32" && d != "bf16" && d != "f16") return false;
    parsed.push_back({n, v, d == "f32" ? DType::kFloat32 : d == "f16" ? DType::kFloat16 : DType::kBFloat16});
    at = end + 1;
  }
  if (parsed.empty()) return false;
  out = parsed;
  return true;
}

enum class JobKind { kForward, kForwardGrad, kForwardGradInplace, kBackward, kForwardGradAllOptions };

const char* job_name(JobKind j) {
  switch (j) {
    case JobKind::kForward: return "forward";
    case JobKind::kForwardGrad: return "fwd+grad";
    case JobKind::kForwardGradInplace: return "fwd+grad inplace";
    case JobKind::kBackward: return "backward";
    case JobKind::kForwardGradAllOptions: return "fwd+grad all options";
  }
  return "?";
}

// A quick CPU-vs-GPU agreement check before timing anything (the test suite does this in
// depth): a fast wrong kernel must not get a line in the table.
bool verify(DType dtype, int64_t N, int64_t V, const fusedce::Options& opt) {
  const size_t elem = elem_size(dtype);
  std::vector<char> hx(N * V * elem), hd_gpu(N * V * elem), hd_cpu(N * V * elem);
  void *x, *d;
  int64_t* t;
  float *loss, *lse;
  CHECK_CUDA(cudaMalloc(&x, hx.size()));
  CHECK_CUDA(cudaMalloc(&d, hx.size()));
  CHECK_CUDA(cudaMalloc(&t, N * 8));
  CHECK_CUDA(cudaMalloc(&loss, 4));
  CHECK_CUDA(cudaMalloc(&lse, N * 4));
  fill(x, dtype, N * V, 5);
  target_kernel<<<16, 256>>>(t, N, V, 3);
  std::vector<int64_t> ht(N);
  CHECK_CUDA(cudaMemcpy(hx.data(), x, hx.size(), cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(ht.data(), t, N * 8, cudaMemcpyDeviceToHost));
  for (int64_t i = 0; i < N; i += 3) ht[i] = -100;
  CHECK_CUDA(cudaMemcpy(t, ht.data(), N * 8, cudaMemcpyHostToDevice));
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(loss, DType::kFloat32, 1);
  out.lse = fusedce::vector(lse, DType::kFloat32, N);
  ok(fusedce::cross_entropy_forward_backward(fusedce::Device::cuda(), fusedce::matrix(x, dtype, N, V),
                                             fusedce::vector(t, DType::kInt64, N), opt, out, {},
                                             fusedce::matrix(d, dtype, N, V)));
  float gpu_loss;
  std::vector<float> gpu_lse(N), cpu_lse(N);
  CHECK_CUDA(cudaMemcpy(&gpu_loss, loss, 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(gpu_lse.data(), lse, N * 4, cudaMemcpyDeviceToHost));
  CHECK_CUDA(cudaMemcpy(hd_gpu.data(), d, hx.size(), cudaMemcpyDeviceToHost));
  float cpu_loss;
  fusedce::ForwardOutputs hout;
  hout.loss = fusedce::vector(&cpu_loss, DType::kFloat32, 1);
  hout.lse = fusedce::vector(cpu_lse.data(), DType::kFloat32, N);
  ok(fusedce::cross_entropy_forward_backward(fusedce::Device::cpu(), fusedce::matrix(hx.data(), dtype, N, V),
                                             fusedce::vector(ht.data(), DType::kInt64, N), opt, hout, {},
                                             fusedce::matrix(hd_cpu.data(), dtype, N, V)));
  auto get = [&](const std::vector<char>& b, int64_t i) -> double {
    if (dtype == DType::kFloat32) return reinterpret_cast<const float*>(b.data())[i];
    uint16_t h = reinterpret_cast<const uint16_t*>(b.data())[i];
    if (dtype == DType::kBFloat16) {
      uint32_t u = uint32_t(h) << 16;
      float f;
      std::memcpy(&f, &u, 4);
      return f;
    }
    return __half2float(*reinterpret_cast<const __half*>(&h));
  };
  double max_d = 0, max_g = 0, max_lse = 0;
  for (int64_t i = 0; i < N * V; ++i) {
    max_d = std::max(max_d, std::fabs(get(hd_gpu, i) - get(hd_cpu, i)));
    max_g = std::max(max_g, std::fabs(get(hd_cpu, i)));
  }
  for (int64_t i = 0; i < N; ++i) max_lse = std::max(max_lse, double(std::fabs(gpu_lse[i] - cpu_lse[i])));
  const double loss_rel = std::fabs(gpu_loss - cpu_loss) / std::fabs(cpu_loss);
  const bool good = loss_rel < 1e-4 && max_lse < 1e-3 && max_d <= 0.02 * max_g && std::isfinite(gpu_loss);
  std::printf("# verify %s N=%lld V=%lld: loss gpu %.6f cpu %.6f (rel %.1e), max |lse diff| %.1e, max |grad diff| %.1e of max |grad| %.1e: %s\n",
              fusedce::dtype_name(dtype), (long long)N, (long long)V, gpu_loss, cpu_loss, loss_rel, max_lse, max_d,
              max_g, good ? "ok" : "MISMATCH");
  CHECK_CUDA(cudaFree(x));
  CHECK_CUDA(cudaFree(d));
  CHECK_CUDA(cudaFree(t));
  CHECK_CUDA(cudaFree(loss));
  CHECK_CUDA(cudaFree(lse));
  return good;
}

}  // namespace

// --options: what each option costs. bf16 forward and forward+gradient at a long-row and a
// short-row shape, plain and with one option at a time, then all together; time and the
// fraction of the copy ceiling by the same byte formulas as the main table. Inputs rotated past
// 3x the L2.
int bench_options(int iters, const cudaDeviceProp& prop) {
  const Ceilings c0 = measure_ceilings(iters);
  std::printf("# options: device-to-device copy %.0f GB/s, streaming read %.0f GB/s\n", c0.copy_gbs, c0.read_gbs);
  std::printf("| N x V | options | forward ms | of read | fwd+grad ms | of copy | fwd+grad x plain |\n"
              "|---|---|---|---|---|---|---|\n");
  struct Opt { const char* name; fusedce::Options o; bool weights; };
  std::vector<Opt> opts;
  auto add = [&](const char* name, auto set, bool weights = false) {
    fusedce::Options o;
    set(o);
    opts.push_back({name, o, weights});
  };
  add("plain", [](fusedce::Options&) {});
  add("label_smoothing 0.1", [](fusedce::Options& o) { o.label_smoothing = 0.1f; });
  add("z_loss 1e-4", [](fusedce::Options& o) { o.z_loss = 1e-4f; });
  add("softcap 30", [](fusedce::Options& o) { o.softcap = 30.0f; });
  add("logit_scale 0.5", [](fusedce::Options& o) { o.logit_scale = 0.5f; });
  add("metrics", [](fusedce::Options& o) { o.return_metrics = true; });
  add("class_weight", [](fusedce::Options&) {}, true);
  add("class_weight + smoothing", [](fusedce::Options& o) { o.label_smoothing = 0.1f; }, true);
  add("reduction sum", [](fusedce::Options& o) { o.reduction = fusedce::Reduction::kSum; });
  add("all (smoothing, z_loss, softcap, metrics)", [](fusedce::Options& o) {
    o.label_smoothing = 0.1f;
    o.z_loss = 1e-4f;
    o.softcap = 30.0f;
    o.return_metrics = true;
  });
  struct Sh { int64_t N, V; };
  for (const Sh sh : {Sh{8192, 128256}, Sh{16384, 32000}}) {
    const size_t bytes = size_t(sh.N) * sh.V * 2;
    const int copies = static_cast<int>(std::max<size_t>(1, (3 * size_t(prop.l2CacheSize) + bytes - 1) / bytes));
    std::vector<void*> xs(copies);
    for (int c = 0; c < copies; ++c) {
      CHECK_CUDA(cudaMalloc(&xs[c], bytes));
      fill(xs[c], DType::kBFloat16, sh.N * sh.V, 500 + c);
    }
    void *dx, *ws;
    int64_t *t, *correct;
    float *loss, *lse, *entropy, *w;
    CHECK_CUDA(cudaMalloc(&dx, bytes));
    CHECK_CUDA(cudaMalloc(&t, sh.N * 8));
    CHECK_CUDA(cudaMalloc(&loss, 4));
    CHECK_CUDA(cudaMalloc(&lse, sh.N * 4));
    CHECK_CUDA(cudaMalloc(&entropy, 4));
    CHECK_CUDA(cudaMalloc(&correct, 8));
    CHECK_CUDA(cudaMalloc(&w, sh.V * 4));
    std::vector<float> hw(sh.V);
    for (int64_t j = 0; j < sh.V; ++j) hw[j] = 0.5f + static_cast<float>((j * 2654435761u) % 1000) / 1000.0f;
    CHECK_CUDA(cudaMemcpy(w, hw.data(), sh.V * 4, cudaMemcpyHostToDevice));
    target_kernel<<<64, 256>>>(t, sh.N, sh.V, 11);
    size_t ws_bytes = 0;
    for (Opt& op : opts) {
      if (op.weights) op.o.class_weight = fusedce::vector(w, DType::kFloat32, sh.V);
      ws_bytes = std::max(ws_bytes, fusedce::cross_entropy_workspace_size(fusedce::Job::kForwardBackward,
                                                                           fusedce::Device::cuda(), sh.N, sh.V, op.o));
    }
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
    const fusedce::Workspace work{ws, ws_bytes};
    const auto T = fusedce::vector(t, DType::kInt64, sh.N);
    const auto D = fusedce::matrix(dx, DType::kBFloat16, sh.N, sh.V);
    double plain_grad = 0.0;
    for (const Opt& op : opts) {
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(loss, DType::kFloat32, 1);
      out.lse = fusedce::vector(lse, DType::kFloat32, sh.N);
      if (op.o.return_metrics) {
        out.num_correct = fusedce::vector(correct, DType::kInt64, 1);
        out.entropy_sum = fusedce::vector(entropy, DType::kFloat32, 1);
      }
      auto X = [&](int i) { return fusedce::matrix(xs[i % copies], DType::kBFloat16, sh.N, sh.V); };
      const Timing f = time_it([&](int i) { ok(fusedce::cross_entropy_forward(fusedce::Device::cuda(), X(i), T, op.o, out, work)); },
                               3, iters);
      const Timing g = time_it(
          [&](int i) { ok(fusedce::cross_entropy_forward_backward(fusedce::Device::cuda(), X(i), T, op.o, out, {}, D, work)); },
          3, iters);
      if (plain_grad == 0.0) plain_grad = g.median_ms;
      std::printf("| %lld x %lld | %s | %.4f | %.1f%% | %.4f | %.1f%% | %.2f |\n", (long long)sh.N, (long long)sh.V,
                  op.name, f.median_ms, 100.0 * bytes / (f.median_ms * 1e6) / c0.read_gbs, g.median_ms,
                  100.0 * 2 * bytes / (g.median_ms * 1e6) / c0.copy_gbs, g.median_ms / plain_grad);
    }
    for (void* ptr : xs) CHECK_CUDA(cudaFree(ptr));
    for (void* ptr : {dx, ws, (void*)t, (void*)loss, (void*)lse, (void*)entropy, (void*)correct, (void*)w}) CHECK_CUDA(cudaFree(ptr));
  }
  return 0;
}

int main(int argc, char** argv) {
  bool quick = false, profile = false, sweep_splits = false, options = false;
  const char* l2_persist = nullptr;
  const char* csv_path = nullptr;
  const char* shapes_arg = nullptr;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--shapes") && i + 1 < argc) shapes_arg = argv[++i];
    if (!std::strcmp(argv[i], "--quick")) quick = true;
    if (!std::strcmp(argv[i], "--variant") && i + 1 < argc && !set_variant(argv[++i])) {
      std::fprintf(stderr, "fusedce_bench: unknown --variant %s\n", argv[i]);
      return 2;
    }
    if (!std::strcmp(argv[i], "--profile")) profile = true;
    if (!std::strcmp(argv[i], "--sweep-splits")) sweep_splits = true;
    if (!std::strcmp(argv[i], "--options")) options = true;
    if (!std::strcmp(argv[i], "--l2-persist-kb") && i + 1 < argc) l2_persist = argv[++i];
    if (!std::strcmp(argv[i], "--csv") && i + 1 < argc) csv_path = argv[++i];
  }
  const int iters = quick ? 10 : 50;
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  {
    size_t persist = 0;
    CHECK_CUDA(cudaDeviceGetLimit(&persist, cudaLimitPersistingL2CacheSize));
    if (l2_persist) {
      const size_t want = !std::strcmp(l2_persist, "max") ? size_t(prop.persistingL2CacheMaxSize)
                                                          : size_t(std::atoll(l2_persist)) << 10;
      CHECK_CUDA(cudaDeviceSetLimit(cudaLimitPersistingL2CacheSize, want));
      size_t now = 0;
      CHECK_CUDA(cudaDeviceGetLimit(&now, cudaLimitPersistingL2CacheSize));
      std::printf("# L2 set-aside for persisting lines: %zu KB by default, %zu KB now (largest %d KB)\n",
                  persist >> 10, now >> 10, prop.persistingL2CacheMaxSize >> 10);
    } else {
      std::printf("# L2 set-aside for persisting lines: %zu KB (largest %d KB)\n", persist >> 10,
                  prop.persistingL2CacheMaxSize >> 10);
    }
  }
  if (options) return bench_options(iters, prop);
  if (sweep_splits) {
    // Few rows, forward, bf16: the stream kernel's work split (chunks of 32 KB per split, passed
    // as PlanChoices::split_chunks; 0 = the plan's choice) against the streaming-read ceiling.
    // Inputs rotated past 3x the L2. Two times per setting: events around one call (what an eager
    // caller sees, host launch latency included) and the GPU time per call from a CUDA graph of
    // kGraphCalls calls (the kernels alone). Each setting's loss is checked against the plan's
    // (another split only reorders the sums).
    constexpr int kGraphCalls = 20;
    const Ceilings c0 = measure_ceilings(iters);
    std::printf("# sweep-splits: streaming read %.0f GB/s\n", c0.read_gbs);
    std::printf("| N x V | chunks per split | median ms (one call) | of read | GPU ms per call (graph) | of read | loss rel. diff vs plan |\n"
                "|---|---|---|---|---|---|---|\n");
    cudaStream_t stream;
    CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    struct Few { int64_t N, V; };
    for (const Few k : {Few{64, 262144}, Few{16, 262144}, Few{4, 262144}, Few{1, 262144}, Few{256, 128256}}) {
      const size_t bytes = size_t(k.N) * k.V * 2;
      const int copies = static_cast<int>(std::max<size_t>(1, (3 * size_t(prop.l2CacheSize) + bytes - 1) / bytes));
      std::vector<void*> xs(copies);
      for (int c = 0; c < copies; ++c) {
        CHECK_CUDA(cudaMalloc(&xs[c], bytes));
        fill(xs[c], DType::kBFloat16, k.N * k.V, 300 + c);
      }
      void* ws;
      int64_t* t;
      float *loss, *lse;
      const size_t ws_bytes = fusedce::cross_entropy_workspace_size(fusedce::Job::kForward, fusedce::Device::cuda(), k.N,
                                                                    k.V, fusedce::Options{});
      CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
      CHECK_CUDA(cudaMalloc(&t, k.N * 8));
      CHECK_CUDA(cudaMalloc(&loss, 4));
      CHECK_CUDA(cudaMalloc(&lse, k.N * 4));
      target_kernel<<<16, 256>>>(t, k.N, k.V, 7);
      CHECK_CUDA(cudaDeviceSynchronize());
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(loss, DType::kFloat32, 1);
      out.lse = fusedce::vector(lse, DType::kFloat32, k.N);
      const auto T = fusedce::vector(t, DType::kInt64, k.N);
      const fusedce::Workspace w{ws, ws_bytes};
      auto call = [&](int i, cudaStream_t st) {
        ok(ce_forward(fusedce::Device::cuda(0, st), fusedce::matrix(xs[i % copies], DType::kBFloat16, k.N, k.V), T, {},
                      out, w));
      };
      float ref_loss = 0.0f;
      for (int knob : {0, 1, 2, 4, 8, 16, 1 << 20}) {
        g_choices = fusedce::cuda::PlanChoices{};
        g_choices.split_chunks = knob;
        g_variant = knob != 0;
        call(0, nullptr);
        float l = 0.0f;
        CHECK_CUDA(cudaMemcpy(&l, loss, 4, cudaMemcpyDeviceToHost));
        if (!knob) ref_loss = l;
        const Timing one = time_it([&](int i) { call(i, nullptr); }, 5, iters);
        // kGraphCalls calls (rotating inputs) captured once; each replay timed, per call.
        cudaGraph_t graph;
        cudaGraphExec_t exec;
        CHECK_CUDA(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
        for (int i = 0; i < kGraphCalls; ++i) call(i, stream);
        CHECK_CUDA(cudaStreamEndCapture(stream, &graph));
        CHECK_CUDA(cudaGraphInstantiate(&exec, graph, 0));
        cudaEvent_t a, b;
        CHECK_CUDA(cudaEventCreate(&a));
        CHECK_CUDA(cudaEventCreate(&b));
        std::vector<double> per;
        for (int r = 0; r < iters / 2 + 3; ++r) {
          CHECK_CUDA(cudaEventRecord(a, stream));
          CHECK_CUDA(cudaGraphLaunch(exec, stream));
          CHECK_CUDA(cudaEventRecord(b, stream));
          CHECK_CUDA(cudaEventSynchronize(b));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, a, b));
          if (r >= 3) per.push_back(ms / kGraphCalls);  // the first replays warm up
        }
        std::sort(per.begin(), per.end());
        const double graph_ms = per[per.size() / 2];
        CHECK_CUDA(cudaEventDestroy(a));
        CHECK_CUDA(cudaEventDestroy(b));
        CHECK_CUDA(cudaGraphExecDestroy(exec));
        CHECK_CUDA(cudaGraphDestroy(graph));
        const double frac_one = 100.0 * bytes / (one.median_ms * 1e6) / c0.read_gbs;
        const double frac_graph = 100.0 * bytes / (graph_ms * 1e6) / c0.read_gbs;
        const std::string label = knob == 0 ? "plan" : knob == (1 << 20) ? "whole rows" : std::to_string(knob);
        std::printf("| %lld x %lld | %s | %.4f | %.1f%% | %.4f | %.1f%% | %.1e |\n", (long long)k.N, (long long)k.V,
                    label.c_str(), one.median_ms, frac_one, graph_ms, frac_graph, std::fabs(l - ref_loss) / std::fabs(ref_loss));
      }
      g_choices = fusedce::cuda::PlanChoices{};
      g_variant = false;
      for (void* ptr : xs) CHECK_CUDA(cudaFree(ptr));
      for (void* ptr : {ws, (void*)t, (void*)loss, (void*)lse}) CHECK_CUDA(cudaFree(ptr));
    }
    CHECK_CUDA(cudaStreamDestroy(stream));
    return 0;
  }
  if (profile) {
    // For ncu: the cases whose gaps docs/performance.md explains, each run twice (warm-up, then
    // the one to read), nothing timed. bf16: forward 64 x 262144 (few rows), forward 16384 x 32000
    // (short rows), forward and fwd+grad 8192 x 128256, and the soft-cap's forward (the slowest
    // option).
    struct Case { int64_t N, V; bool grad; float softcap; };
    for (const Case k : {Case{64, 262144, false, 0.0f}, Case{16384, 32000, false, 0.0f},
                         Case{8192, 128256, false, 0.0f}, Case{8192, 128256, true, 0.0f},
                         Case{8192, 128256, false, 30.0f}}) {
      const size_t bytes = size_t(k.N) * k.V * 2;
      void *x, *d, *ws;
      int64_t* t;
      float *loss, *lse;
      CHECK_CUDA(cudaMalloc(&x, bytes));
      CHECK_CUDA(cudaMalloc(&d, bytes));
      CHECK_CUDA(cudaMalloc(&t, k.N * 8));
      CHECK_CUDA(cudaMalloc(&loss, 4));
      CHECK_CUDA(cudaMalloc(&lse, k.N * 4));
      CHECK_CUDA(cudaMalloc(&ws, 16 << 20));
      fill(x, DType::kBFloat16, k.N * k.V, 9);
      target_kernel<<<64, 256>>>(t, k.N, k.V, 1);
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(loss, DType::kFloat32, 1);
      out.lse = fusedce::vector(lse, DType::kFloat32, k.N);
      const auto X = fusedce::matrix(x, DType::kBFloat16, k.N, k.V);
      const auto D = fusedce::matrix(d, DType::kBFloat16, k.N, k.V);
      const auto T = fusedce::vector(t, DType::kInt64, k.N);
      const fusedce::Workspace w{ws, 16 << 20};
      fusedce::Options o;
      o.softcap = k.softcap;
      for (int rep = 0; rep < 2; ++rep) {
        if (k.grad) ok(fusedce::cross_entropy_forward_backward(fusedce::Device::cuda(), X, T, o, out, {}, D, w));
        else ok(fusedce::cross_entropy_forward(fusedce::Device::cuda(), X, T, o, out, w));
      }
      CHECK_CUDA(cudaDeviceSynchronize());
      std::printf("profiled %lld x %lld %s%s\n", (long long)k.N, (long long)k.V, k.grad ? "fwd+grad" : "forward",
                  k.softcap > 0.0f ? " softcap 30" : "");
      for (void* ptr : {x, d, ws, (void*)t, (void*)loss, (void*)lse}) CHECK_CUDA(cudaFree(ptr));
    }
    return 0;
  }
  bool verified = true;
  fusedce::Options extras;
  extras.label_smoothing = 0.1f;
  extras.softcap = 20.0f;
  extras.z_loss = 1e-3f;
  for (DType d : {DType::kBFloat16, DType::kFloat32, DType::kFloat16}) {
    verified &= verify(d, 37, 50257, fusedce::Options{});
    verified &= verify(d, 5, 262147, extras);
    verified &= verify(d, 9, 1000, extras);
  }
  // Enough rows that each block owns whole rows (the fused-gradient path), plain and with options.
  verified &= verify(DType::kBFloat16, 700, 32003, fusedce::Options{});
  verified &= verify(DType::kBFloat16, 700, 32003, extras);
  verified &= verify(DType::kFloat32, 600, 4099, extras);
  if (!verified) {
    std::fprintf(stderr, "fusedce_bench: GPU results disagree with the CPU backend; not timing\n");
    return 2;
  }
  const Ceilings ceil = measure_ceilings(iters);
  std::printf("# %s, %d SMs, L2 %d MB, fusedce %s\n", prop.name, prop.multiProcessorCount,
              prop.l2CacheSize >> 20, fusedce::version());
  std::printf("# ceilings: device-to-device copy %.0f GB/s (read + write), streaming read %.0f GB/s\n\n",
              ceil.copy_gbs, ceil.read_gbs);
  std::printf("| N x V | dtype | job | median ms | min..max ms | GB/s | of copy | of read | queued ms | queued: of read (forward) or copy |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv) std::fprintf(csv, "gpu,N,V,dtype,job,median_ms,min_ms,max_ms,gbs,frac_copy,frac_read,copy_gbs,read_gbs,queued_ms\n");

  std::vector<Shape> shapes = {
      {16384, 32000, DType::kBFloat16}, {8192, 128256, DType::kBFloat16}, {4096, 262144, DType::kBFloat16},
      {64, 262144, DType::kBFloat16},   {8192, 151936, DType::kBFloat16}, {8192, 128256, DType::kFloat32},
  };
  if (shapes_arg != nullptr && !parse_shapes(shapes_arg, shapes)) {
    std::fprintf(stderr, "fusedce_bench: --shapes takes NxV[:f32|bf16|f16],... (got \"%s\")\n", shapes_arg);
    return 2;
  }
  for (const Shape& sh : shapes) {
    const size_t elem = elem_size(sh.dtype);
    const size_t bytes = size_t(sh.N) * sh.V * elem;
    // Enough copies that one pass over all of them is over 3x the L2: every run reads DRAM.
    const int copies = static_cast<int>(std::max<size_t>(1, (3 * size_t(prop.l2CacheSize) + bytes - 1) / bytes));
    std::vector<void*> logits(copies), dlogits(copies);
    for (int k = 0; k < copies; ++k) {
      CHECK_CUDA(cudaMalloc(&logits[k], bytes));
      CHECK_CUDA(cudaMalloc(&dlogits[k], bytes));
      fill(logits[k], sh.dtype, sh.N * sh.V, 1000 + k);
    }
    int64_t* target;
    float *loss, *lse, *entropy;
    int64_t* correct;
    CHECK_CUDA(cudaMalloc(&target, sh.N * sizeof(int64_t)));
    CHECK_CUDA(cudaMalloc(&loss, sizeof(float)));
    CHECK_CUDA(cudaMalloc(&lse, sh.N * sizeof(float)));
    CHECK_CUDA(cudaMalloc(&entropy, sizeof(float)));
    CHECK_CUDA(cudaMalloc(&correct, sizeof(int64_t)));
    float* one;
    CHECK_CUDA(cudaMalloc(&one, sizeof(float)));
    const float one_h = 1.0f;
    CHECK_CUDA(cudaMemcpy(one, &one_h, sizeof(float), cudaMemcpyHostToDevice));
    target_kernel<<<256, 256>>>(target, sh.N, sh.V, 77);
    fusedce::Options all;
    all.label_smoothing = 0.1f;
    all.softcap = 30.0f;
    all.z_loss = 1e-4f;
    all.return_metrics = true;
    size_t ws_bytes = 0;
    for (auto job : {fusedce::Job::kForward, fusedce::Job::kForwardBackward, fusedce::Job::kBackward}) {
      ws_bytes = std::max(ws_bytes, fusedce::cross_entropy_workspace_size(job, fusedce::Device::cuda(), sh.N, sh.V, all));
    }
    void* ws;
    CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
    const fusedce::Workspace workspace{ws, ws_bytes};
    const auto dev = fusedce::Device::cuda(0, nullptr);
    const auto tgt = fusedce::vector(target, DType::kInt64, sh.N);

    for (JobKind job : {JobKind::kForward, JobKind::kForwardGrad, JobKind::kForwardGradInplace, JobKind::kBackward,
                        JobKind::kForwardGradAllOptions}) {
      fusedce::Options opt = job == JobKind::kForwardGradAllOptions ? all : fusedce::Options{};
      fusedce::ForwardOutputs out;
      out.loss = fusedce::vector(loss, DType::kFloat32, 1);
      out.lse = fusedce::vector(lse, DType::kFloat32, sh.N);
      if (opt.return_metrics) {
        out.num_correct = fusedce::vector(correct, DType::kInt64, 1);
        out.entropy_sum = fusedce::vector(entropy, DType::kFloat32, 1);
      }
      if (job == JobKind::kForwardGradInplace) opt.inplace_backward = true;
      auto run = [&](int i) {
        void* x = logits[i % copies];
        void* d = job == JobKind::kForwardGradInplace ? x : dlogits[i % copies];
        const auto X = fusedce::matrix(x, sh.dtype, sh.N, sh.V);
        const auto D = fusedce::matrix(d, sh.dtype, sh.N, sh.V);
        switch (job) {
          case JobKind::kForward: ok(ce_forward(dev, X, tgt, opt, out, workspace)); break;
          case JobKind::kBackward:
            ok(fusedce::cross_entropy_backward(dev, X, tgt, out.lse, fusedce::vector(one, DType::kFloat32, 1), opt, D, workspace));
            break;
          default: ok(ce_forward_backward(dev, X, tgt, opt, out, D, workspace)); break;
        }
      };
      if (job == JobKind::kBackward) {  // lse from a forward first
        ok(fusedce::cross_entropy_forward(dev, fusedce::matrix(logits[0], sh.dtype, sh.N, sh.V), tgt, opt, out, workspace));
      }
      const Timing t = time_it(run, 5, iters);
      const double queued = time_queued(run, 5, iters);
      const double moved = (job == JobKind::kForward ? 1.0 : 2.0) * double(bytes);
      const double gbs = moved / (t.median_ms * 1e6);
      const double q_frac = moved / (queued * 1e6) / (job == JobKind::kForward ? ceil.read_gbs : ceil.copy_gbs);
      const char* dt = fusedce::dtype_name(sh.dtype);
      std::printf("| %lld x %lld | %s | %s | %.4f | %.4f..%.4f | %.0f | %.1f%% | %.1f%% | %.4f | %.1f%% |\n", (long long)sh.N,
                  (long long)sh.V, dt, job_name(job), t.median_ms, t.min_ms, t.max_ms, gbs, 100 * gbs / ceil.copy_gbs,
                  100 * gbs / ceil.read_gbs, queued, 100 * q_frac);
      std::fflush(stdout);
      if (csv) {
        std::fprintf(csv, "%s,%lld,%lld,%s,%s,%.5f,%.5f,%.5f,%.1f,%.4f,%.4f,%.1f,%.1f,%.5f\n", prop.name, (long long)sh.N,
                     (long long)sh.V, dt, job_name(job), t.median_ms, t.min_ms, t.max_ms, gbs, gbs / ceil.copy_gbs,
                     gbs / ceil.read_gbs, ceil.copy_gbs, ceil.read_gbs, queued);
      }
    }
    for (int k = 0; k < copies; ++k) {
      CHECK_CUDA(cudaFree(logits[k]));
      CHECK_CUDA(cudaFree(dlogits[k]));
    }
    CHECK_CUDA(cudaFree(target));
    CHECK_CUDA(cudaFree(loss));
    CHECK_CUDA(cudaFree(lse));
    CHECK_CUDA(cudaFree(entropy));
    CHECK_CUDA(cudaFree(correct));
    CHECK_CUDA(cudaFree(one));
    CHECK_CUDA(cudaFree(ws));
  }
  if (csv) std::fclose(csv);
  return 0;
}
