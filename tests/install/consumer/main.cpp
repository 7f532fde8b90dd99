// Computes one small loss through the installed fusedce and checks it against the closed form.
#include <cmath>
#include <cstdio>

#include <fusedce/fusedce.h>

int main() {
  // Two rows over V = 3; row 1 ignored. loss = lse(0, 1, 2) - 2.
  float logits[6] = {0.0f, 1.0f, 2.0f, 5.0f, 5.0f, 5.0f};
  long long target[2] = {2, -100};
  float loss = 0.0f;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(&loss, fusedce::DType::kFloat32, 1);
  fusedce::Status s = fusedce::cross_entropy_forward(
      fusedce::Device::cpu(), fusedce::matrix(logits, fusedce::DType::kFloat32, 2, 3),
      fusedce::vector(target, fusedce::DType::kInt64, 2), fusedce::Options{}, out);
  const double expect = std::log(1.0 + std::exp(1.0) + std::exp(2.0)) - 2.0;
  if (!s.ok() || std::fabs(loss - expect) > 1e-6) {
    std::printf("FAIL: %s loss=%.8f expected %.8f\n", s.message().c_str(), loss, expect);
    return 1;
  }
  std::printf("installed fusedce %s: loss %.6f ok\n", fusedce::version(), loss);
  return 0;
}
