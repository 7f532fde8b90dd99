// Bit-for-bit A/B of the cross-entropy over logits on a GPU: every output of a fixed set of calls
// (dtypes, shapes of each kernel regime, option sets, forward and forward + gradient) through the
// public API only, on deterministic inputs, as one hash line per call. Built against two trees
// (dev/ab_check/ab_check.sh, STEPS=bits), the two lists must be equal line for line: a change that
// only moves code leaves every bit of every result where it was.
//
// Usage: ab_bits  (prints "<case> <hash of loss, lse, metrics, dlogits>" per call)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "fusedce/fusedce.h"

namespace {

using fusedce::DType;

uint64_t mix(uint64_t& s) {  // splitmix64
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv(const void* p, size_t n, uint64_t h = 1469598103934665603ull) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

uint16_t to_half_bits(float f, DType d) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (d == DType::kBFloat16) return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  // float16 from a value in [-40, 40]: exponent rebias, mantissa rounded to nearest (ties up).
  const uint32_t sign = (u >> 16) & 0x8000u;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  const uint32_t mant = (u & 0x7FFFFFu) + 0x1000u;
  return static_cast<uint16_t>(sign | ((static_cast<uint32_t>(exp) << 10) + (mant >> 13)));
}

#define CHECK_CUDA(x)                                                     \
  do {                                                                    \
    cudaError_t e_ = (x);                                                 \
    if (e_ != cudaSuccess) {                                              \
      std::fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e_));       \
      std::exit(2);                                                       \
    }                                                                     \
  } while (0)

std::string run_case(DType d, int64_t N, int64_t V, const fusedce::Options& o, const char* oname, bool grad,
                     uint64_t seed) {
  const size_t es = d == DType::kFloat32 ? 4 : 2;
  std::vector<unsigned char> x(N * V * es);
  std::vector<int64_t> t(N);
  for (int64_t i = 0; i < N * V; ++i) {
    // Logits in [-8, 8) with one in 500 raised by 20 (outliers that move the running max).
    float v = static_cast<float>(static_cast<double>(mix(seed) >> 11) * 0x1.0p-53 * 16.0 - 8.0);
    if (mix(seed) % 500 == 0) v += 20.0f;
    if (es == 4) {
      std::memcpy(&x[i * 4], &v, 4);
    } else {
      const uint16_t h = to_half_bits(v, d);
      std::memcpy(&x[i * 2], &h, 2);
    }
  }
  for (int64_t i = 0; i < N; ++i) t[i] = mix(seed) % 10 < 3 ? -100 : static_cast<int64_t>(mix(seed) % V);
  std::vector<float> weights(V);
  for (int64_t j = 0; j < V; ++j) weights[j] = 0.5f + static_cast<float>(mix(seed) % 1000) / 1000.0f;

  void *dx_in, *dx_out, *ws = nullptr;
  int64_t *dt, *dcorrect;
  float *dloss, *dlse, *dent, *dw;
  CHECK_CUDA(cudaMalloc(&dx_in, x.size()));
  CHECK_CUDA(cudaMalloc(&dx_out, x.size()));
  CHECK_CUDA(cudaMalloc(&dt, N * 8));
  CHECK_CUDA(cudaMalloc(&dloss, N * 4 + 4));
  CHECK_CUDA(cudaMalloc(&dlse, N * 4 + 4));
  CHECK_CUDA(cudaMalloc(&dent, 4));
  CHECK_CUDA(cudaMalloc(&dcorrect, 8));
  CHECK_CUDA(cudaMalloc(&dw, V * 4));
  CHECK_CUDA(cudaMemcpy(dx_in, x.data(), x.size(), cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dt, t.data(), N * 8, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemcpy(dw, weights.data(), V * 4, cudaMemcpyHostToDevice));
  CHECK_CUDA(cudaMemset(dx_out, 0, x.size()));
  fusedce::Options opt = o;
  if (std::strcmp(oname, "weights") == 0) opt.class_weight = fusedce::vector(dw, DType::kFloat32, V);
  const fusedce::Job job = grad ? fusedce::Job::kForwardBackward : fusedce::Job::kForward;
  const size_t ws_bytes = fusedce::cross_entropy_workspace_size(job, fusedce::Device::cuda(), N, V, opt);
  if (ws_bytes) CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  const int64_t loss_n = opt.reduction == fusedce::Reduction::kNone ? N : 1;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(dloss, DType::kFloat32, loss_n);
  out.lse = fusedce::vector(dlse, DType::kFloat32, N);
  if (opt.return_metrics) {
    out.num_correct = fusedce::vector(dcorrect, DType::kInt64, 1);
    out.entropy_sum = fusedce::vector(dent, DType::kFloat32, 1);
  }
  const fusedce::MatrixView logits = fusedce::matrix(dx_in, d, N, V);
  const fusedce::VectorView target = fusedce::vector(dt, DType::kInt64, N);
  const fusedce::Workspace w{ws, ws_bytes};
  const fusedce::Status s =
      grad ? fusedce::cross_entropy_forward_backward(fusedce::Device::cuda(), logits, target, opt, out, {},
                                                     fusedce::matrix(dx_out, d, N, V), w)
           : fusedce::cross_entropy_forward(fusedce::Device::cuda(), logits, target, opt, out, w);
  CHECK_CUDA(cudaDeviceSynchronize());
  char line[256];
  if (!s.ok()) {
    std::snprintf(line, sizeof line, "error: %s", s.message().c_str());
  } else {
    std::vector<unsigned char> buf(x.size());
    uint64_t h = 1469598103934665603ull;
    std::vector<float> f(N + 1);
    CHECK_CUDA(cudaMemcpy(f.data(), dloss, loss_n * 4, cudaMemcpyDeviceToHost));
    h = fnv(f.data(), loss_n * 4, h);
    CHECK_CUDA(cudaMemcpy(f.data(), dlse, N * 4, cudaMemcpyDeviceToHost));
    h = fnv(f.data(), N * 4, h);
    if (opt.return_metrics) {
      int64_t c = 0;
      float e = 0;
      CHECK_CUDA(cudaMemcpy(&c, dcorrect, 8, cudaMemcpyDeviceToHost));
      CHECK_CUDA(cudaMemcpy(&e, dent, 4, cudaMemcpyDeviceToHost));
      h = fnv(&c, 8, fnv(&e, 4, h));
    }
    if (grad) {
      CHECK_CUDA(cudaMemcpy(buf.data(), dx_out, buf.size(), cudaMemcpyDeviceToHost));
      h = fnv(buf.data(), buf.size(), h);
    }
    std::snprintf(line, sizeof line, "%016llx", static_cast<unsigned long long>(h));
  }
  for (void* p : {dx_in, dx_out, ws, static_cast<void*>(dt), static_cast<void*>(dloss), static_cast<void*>(dlse),
                  static_cast<void*>(dent), static_cast<void*>(dcorrect), static_cast<void*>(dw)}) {
    cudaFree(p);
  }
  return line;
}

}  // namespace

int main() {
  fusedce::Options plain, all, smooth, none, weights, negative;
  all.label_smoothing = 0.1f;
  all.z_loss = 1e-3f;
  all.softcap = 25.0f;
  all.return_metrics = true;
  smooth.label_smoothing = 0.05f;
  smooth.return_metrics = true;
  smooth.reduction = fusedce::Reduction::kSum;
  none.reduction = fusedce::Reduction::kNone;
  weights.label_smoothing = 0.1f;
  negative.logit_scale = -0.5f;
  const struct {
    const char* name;
    const fusedce::Options* o;
  } sets[] = {{"plain", &plain}, {"all", &all}, {"smooth", &smooth}, {"none", &none}, {"weights", &weights},
              {"negative", &negative}};
  // One chunk or less a row, short rows (two consumer groups), long rows, few rows (splits),
  // rows that overflow the L2 (halves with the gradient), and many rows of the benchmark's V = 32000.
  const struct {
    int64_t N, V;
  } shapes[] = {{1, 1}, {3, 7}, {257, 127}, {257, 1024}, {700, 32003}, {2000, 16387}, {555, 61081},
                {3, 262147}, {64, 131071}, {140, 262147}, {2048, 32000}};
  uint64_t seed = 1;
  for (const auto& sh : shapes) {
    for (DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      for (const auto& set : sets) {
        for (bool grad : {false, true}) {
          const std::string h = run_case(d, sh.N, sh.V, *set.o, set.name, grad, seed++);
          std::printf("%s N=%lld V=%lld %s %s %s\n", fusedce::dtype_name(d), static_cast<long long>(sh.N),
                      static_cast<long long>(sh.V), set.name, grad ? "fwd+grad" : "forward", h.c_str());
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
