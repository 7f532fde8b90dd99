// fusedce in a few lines: the loss and gradient of a generated batch of logits, with the time
// taken. Usage: fusedce_example [N=4096] [V=32000] [threads=0]
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "fusedce/fusedce.h"

int main(int argc, char** argv) {
  const int64_t N = argc > 1 ? std::atoll(argv[1]) : 4096;
  const int64_t V = argc > 2 ? std::atoll(argv[2]) : 32000;
  const int threads = argc > 3 ? std::atoi(argv[3]) : 0;

  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::uniform_int_distribution<int64_t> token(0, V - 1);
  std::vector<float> logits(N * V), dlogits(N * V);
  std::vector<int64_t> target(N);
  for (auto& x : logits) x = normal(rng);
  for (auto& t : target) t = (rng() % 10 == 0) ? -100 : token(rng);  // 10% ignored (padding)

  fusedce::Options opt;  // defaults: mean over non-ignored rows, as F.cross_entropy
  opt.label_smoothing = 0.1f;
  opt.return_metrics = true;
  float loss = 0.0f, entropy = 0.0f;
  int64_t correct = 0;
  std::vector<float> lse(N);
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(&loss, fusedce::DType::kFloat32, 1);
  out.lse = fusedce::vector(lse.data(), fusedce::DType::kFloat32, N);
  out.num_correct = fusedce::vector(&correct, fusedce::DType::kInt64, 1);
  out.entropy_sum = fusedce::vector(&entropy, fusedce::DType::kFloat32, 1);

  const auto start = std::chrono::steady_clock::now();
  fusedce::Status s = fusedce::cross_entropy_forward_backward(
      fusedce::Device::cpu(threads), fusedce::matrix(logits.data(), fusedce::DType::kFloat32, N, V),
      fusedce::vector(target.data(), fusedce::DType::kInt64, N), opt, out, fusedce::VectorView{},
      fusedce::matrix(dlogits.data(), fusedce::DType::kFloat32, N, V));
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  if (!s.ok()) {
    std::fprintf(stderr, "fusedce: %s\n", s.message().c_str());
    return 1;
  }
  std::printf("fusedce %s  N=%lld V=%lld float32 (CPU)\n", fusedce::version(), (long long)N, (long long)V);
  std::printf("loss (mean, label_smoothing 0.1) = %.6f\n", loss);
  std::printf("num_correct = %lld, mean entropy = %.4f nats\n", (long long)correct,
              entropy / static_cast<double>(N));
  std::printf("dlogits[0, 0:4] = %.3e %.3e %.3e %.3e\n", dlogits[0], dlogits[1], dlogits[2], dlogits[3]);
  std::printf("forward + gradient: %.2f ms (%.2f GB/s of logits read + dlogits written)\n", ms,
              2.0 * N * V * sizeof(float) / (ms * 1e6));
  return 0;
}
