// set_cpu_parallel_for: the CPU backend's loops run on a host's threads when one is handed over,
// with the same results bit for bit as on the core's own pool.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "fusedce/fusedce.h"

namespace fusedce_test {
namespace {

using fusedce::DType;

std::atomic<int> host_calls{0};

/// A host pool stand-in: [0, blocks) cut in two ranges, the second on a thread of its own.
void two_thread_host(int64_t blocks, int threads, void* ctx, void (*body)(void*, int64_t, int64_t)) {
  ++host_calls;
  EXPECT_GE(threads, 2);
  const int64_t mid = blocks / 2;
  std::thread other([&] { body(ctx, mid, blocks); });
  body(ctx, 0, mid);
  other.join();
}

struct Results {
  std::vector<float> ce_loss, ce_lse, ce_grad, lin_loss, lin_gh, lin_gw;
};

Results run_all() {
  const int64_t n = 96, v = 3001, h = 40;
  std::mt19937 rng(11);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  std::vector<float> logits(n * v), hid(n * h), w(v * h);
  for (float& x : logits) x = nd(rng);
  for (float& x : hid) x = 0.3f * nd(rng);
  for (float& x : w) x = 0.1f * nd(rng);
  std::vector<int64_t> target(n);
  for (int64_t i = 0; i < n; ++i) target[i] = i % 7 == 0 ? -100 : static_cast<int64_t>(rng() % v);
  const auto dev = fusedce::Device::cpu(2);
  const auto tv = fusedce::vector(target.data(), DType::kInt64, n);
  Results r;
  r.ce_loss.assign(1, 0.0f);
  r.ce_lse.assign(n, 0.0f);
  r.ce_grad.assign(n * v, 0.0f);
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(r.ce_loss.data(), DType::kFloat32, 1);
  out.lse = fusedce::vector(r.ce_lse.data(), DType::kFloat32, n);
  fusedce::Options o;
  o.label_smoothing = 0.1f;
  EXPECT_TRUE(fusedce::cross_entropy_forward_backward(dev, fusedce::matrix(logits.data(), DType::kFloat32, n, v), tv,
                                                      o, out, {}, fusedce::matrix(r.ce_grad.data(), DType::kFloat32, n, v))
                  .ok());
  r.lin_loss.assign(1, 0.0f);
  r.lin_gh.assign(n * h, 0.0f);
  r.lin_gw.assign(v * h, 0.0f);
  fusedce::ForwardOutputs lo;
  lo.loss = fusedce::vector(r.lin_loss.data(), DType::kFloat32, 1);
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(r.lin_gh.data(), DType::kFloat32, n, h);
  g.grad_weight = fusedce::matrix(r.lin_gw.data(), DType::kFloat32, v, h);
  EXPECT_TRUE(fusedce::linear_cross_entropy_forward_backward(dev, fusedce::matrix(hid.data(), DType::kFloat32, n, h),
                                                             fusedce::matrix(w.data(), DType::kFloat32, v, h), {}, tv, o,
                                                             {}, lo, {}, g)
                  .ok());
  return r;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST(CpuThreads, AHostsThreadsRunTheLoopsWithTheSameBits) {
  const Results own = run_all();
  host_calls = 0;
  fusedce::set_cpu_parallel_for(&two_thread_host);
  const Results hosted = run_all();
  fusedce::set_cpu_parallel_for(nullptr);
  EXPECT_GT(host_calls.load(), 0);
  EXPECT_TRUE(same_bits(own.ce_loss, hosted.ce_loss));
  EXPECT_TRUE(same_bits(own.ce_lse, hosted.ce_lse));
  EXPECT_TRUE(same_bits(own.ce_grad, hosted.ce_grad));
  EXPECT_TRUE(same_bits(own.lin_loss, hosted.lin_loss));
  EXPECT_TRUE(same_bits(own.lin_gh, hosted.lin_gh));
  EXPECT_TRUE(same_bits(own.lin_gw, hosted.lin_gw));
  // Restored: the core's own pool again, and the host is no longer called.
  host_calls = 0;
  const Results again = run_all();
  EXPECT_EQ(host_calls.load(), 0);
  EXPECT_TRUE(same_bits(own.ce_grad, again.ce_grad));
}

}  // namespace
}  // namespace fusedce_test
