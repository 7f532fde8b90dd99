// Memory layouts and index types: logits as a strided, offset slice of a wider buffer, strided
// targets / weights / outputs, int32 and int64 targets, a custom ignore_index inside [0, V),
// an empty batch with null pointers, and on the CPU: independence from the thread count and
// concurrent callers; a CUDA handle in a build without CUDA.
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

#include "fixture.h"
#include "fusedce/version.h"
#include "harness.h"
#include "option_sets.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

class Layout : public BackendTest<Case> {};

// Every view strided and offset: logits rows 37 elements apart beyond V, starting 3 elements into
// the buffer (so not vector-aligned); targets every 3rd element, class weights every 2nd, the
// per-row losses every 2nd, lse every 3rd, dlogits with its own padding and offset, grad_loss
// every 2nd. The gaps hold NaN or out-of-range targets, so reading one shows.
TEST_P(Layout, StridedSlicesOfWiderBuffers) {
  const Case& c = GetParam();
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = c.dtype;
  gen.rows = 29;
  gen.vocab = 1001;
  gen.row_pad = 37;
  gen.offset = 3;
  gen.target_dtype = DType::kInt32;
  gen.target_stride = 3;
  gen.class_weight = true;
  gen.weight_stride = 2;
  const Problem p = make_problem(gen, rng);

  for (Reduction reduction : {Reduction::kNone, Reduction::kMean}) {
    SCOPED_TRACE(fusedce::reduction_name(reduction));
    RunSpec spec;
    spec.options = make_options(OptionSet::kAll);
    spec.options.reduction = reduction;
    spec.loss_stride = 2;
    spec.lse_stride = 3;
    spec.gradient = true;
    spec.dlogits_pad = 11;
    spec.dlogits_offset = 1;
    std::uniform_real_distribution<float> g(-2.0f, 2.0f);
    spec.grad_loss.resize(reduction == Reduction::kNone ? p.rows : 1);
    for (float& v : spec.grad_loss) v = g(rng);
    spec.grad_loss_stride = 2;
    const Reference ref(p, spec.options);
    const Outputs out = run_forward(backend(), p, spec);
    ASSERT_TRUE(out.status.ok()) << out.status.message();
    expect_forward_matches(out, p, ref, spec);
    expect_grad_matches(out.grad, p, ref, spec.grad_loss);
  }
}

INSTANTIATE_TEST_SUITE_P(Views, Layout, ::testing::ValuesIn(make_cases(float_dtypes())), CaseName());

class Targets : public BackendTest<Case> {};

// The same problem with int32 and with int64 targets: identical bits in every output.
TEST_P(Targets, Int32AndInt64GiveIdenticalResults) {
  const Case& c = GetParam();
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = c.dtype;
  gen.rows = 45;
  gen.vocab = 515;
  gen.class_weight = true;
  Problem p64 = make_problem(gen, rng);
  Problem p32 = p64;
  p32.target_dtype = DType::kInt32;

  RunSpec spec;
  spec.options = make_options(OptionSet::kAllReduceNone);
  spec.gradient = true;
  const Reference ref(p64, spec.options);
  const Outputs a = run_forward(backend(), p64, spec);
  const Outputs b = run_forward(backend(), p32, spec);
  ASSERT_TRUE(a.status.ok()) << a.status.message();
  ASSERT_TRUE(b.status.ok()) << b.status.message();
  expect_forward_matches(a, p64, ref, spec);
  expect_grad_matches(a.grad, p64, ref, {});
  EXPECT_EQ(std::memcmp(a.loss.data(), b.loss.data(), a.loss.size() * 4), 0) << "loss differs";
  EXPECT_EQ(std::memcmp(a.lse.data(), b.lse.data(), a.lse.size() * 4), 0) << "lse differs";
  EXPECT_EQ(a.num_correct, b.num_correct);
  EXPECT_EQ(std::memcmp(&a.entropy_sum, &b.entropy_sum, 4), 0) << "entropy_sum differs";
  std::string diff;
  EXPECT_TRUE(a.grad.same_bits(b.grad, &diff)) << "dlogits differ: " << diff;
}

// ignore_index = 5 lies inside [0, V): rows whose target is 5 are ignored, every other value in
// [0, V) is a class, and -100 is now an out-of-range target.
TEST_P(Targets, CustomIgnoreIndexInsideVocabulary) {
  const Case& c = GetParam();
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = c.dtype;
  gen.rows = 40;
  gen.vocab = 300;
  gen.ignore_index = 5;
  gen.class_weight = true;
  Problem p = make_problem(gen, rng);
  ASSERT_EQ(p.num_ignored(), 12);

  for (OptionSet set : {OptionSet::kAll, OptionSet::kAllReduceNone}) {
    SCOPED_TRACE(option_set_name(set));
    RunSpec spec;
    spec.options = make_options(set);
    spec.options.ignore_index = 5;
    spec.gradient = true;
    const Reference ref(p, spec.options);
    ASSERT_NEAR(ref.denominator(), [&] {
      double d = 0.0;
      for (int64_t i = 0; i < p.rows; ++i) d += p.target[i] == 5 ? 0.0 : p.class_weight[p.target[i]];
      return d;
    }(), 1e-9);
    const Outputs out = run_forward(backend(), p, spec);
    ASSERT_TRUE(out.status.ok()) << out.status.message();
    expect_forward_matches(out, p, ref, spec);
    expect_grad_matches(out.grad, p, ref, {});
  }

  // -100 is not the ignore_index here: an error naming the row.
  for (int64_t i = 0; i < p.rows; ++i) {
    if (p.target[i] != 5) {
      p.target[i] = -100;
      break;
    }
  }
  RunSpec spec;
  spec.options.ignore_index = 5;
  spec.options.check_targets = true;
  const Outputs out = run_forward(backend(), p, spec);
  EXPECT_EQ(out.status.code(), fusedce::StatusCode::kTargetOutOfRange) << out.status.message();
  EXPECT_NE(out.status.message().find("-100"), std::string::npos) << out.status.message();
}

INSTANTIATE_TEST_SUITE_P(Targets, Targets, ::testing::ValuesIn(make_cases(float_dtypes())), CaseName());

class EmptyBatch : public BackendTest<BackendKind> {};

// N = 0 with null logits, targets and (for kNone) loss: sum is 0, mean is NaN (as PyTorch),
// none has nothing to write; the gradient job accepts a null 0-row dlogits.
TEST_P(EmptyBatch, NullPointersAreFine) {
  Backend& b = backend();
  DeviceBuffer scalar(b, 4), correct(b, 8), entropy(b, 4);
  const fusedce::MatrixView logits = fusedce::matrix(nullptr, DType::kBFloat16, 0, 50257);
  const fusedce::VectorView target = fusedce::vector(nullptr, DType::kInt64, 0);
  for (Reduction r : {Reduction::kNone, Reduction::kSum, Reduction::kMean}) {
    SCOPED_TRACE(fusedce::reduction_name(r));
    fusedce::Options o;
    o.reduction = r;
    o.return_metrics = true;
    const float sentinel = 123.0f;
    const int64_t correct_sentinel = 77;
    scalar.upload(&sentinel, 4);
    correct.upload(&correct_sentinel, 8);
    entropy.upload(&sentinel, 4);
    fusedce::ForwardOutputs out;
    out.loss = r == Reduction::kNone ? fusedce::vector(nullptr, DType::kFloat32, 0)
                                     : fusedce::vector(scalar.data(), DType::kFloat32, 1);
    out.lse = fusedce::vector(nullptr, DType::kFloat32, 0);
    out.num_correct = fusedce::vector(correct.data(), DType::kInt64, 1);
    out.entropy_sum = fusedce::vector(entropy.data(), DType::kFloat32, 1);
    for (bool gradient : {false, true}) {
      SCOPED_TRACE(gradient ? "forward_backward" : "forward");
      const fusedce::Status s =
          gradient ? fusedce::cross_entropy_forward_backward(b.device(), logits, target, o, out, {},
                                                             fusedce::matrix(nullptr, DType::kBFloat16, 0, 50257))
                   : fusedce::cross_entropy_forward(b.device(), logits, target, o, out);
      b.synchronize();
      ASSERT_TRUE(s.ok()) << s.message();
      float loss = 0.0f, ent = -1.0f;
      int64_t n_correct = -1;
      scalar.download(&loss, 4);
      correct.download(&n_correct, 8);
      entropy.download(&ent, 4);
      if (r == Reduction::kSum) {
        EXPECT_EQ(loss, 0.0f);
      }
      if (r == Reduction::kMean) {
        EXPECT_TRUE(std::isnan(loss)) << loss;
      }
      if (r == Reduction::kNone) {
        EXPECT_EQ(loss, sentinel) << "nothing to write for kNone";
      }
      EXPECT_EQ(n_correct, 0);
      EXPECT_EQ(ent, 0.0f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Batch, EmptyBatch, ::testing::ValuesIn(all_backends()),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return std::string(backend_name(info.param));
                         });

// The CPU backend promises the same bits whatever the thread count (fixed row blocks, batch
// sums in a fixed order): 1, 2, 3 threads and "all" agree exactly.
TEST(CpuThreads, SameBitsForAnyThreadCount) {
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.dtype = DType::kBFloat16;
  gen.rows = 67;
  gen.vocab = 4099;  // 15 rows per 64K-element block: 5 blocks of rows
  gen.class_weight = true;
  const Problem p = make_problem(gen, rng);
  Backend& b = *cpu_test_backend();
  RunSpec spec;
  spec.options = make_options(OptionSet::kAll);
  spec.gradient = true;
  spec.num_threads = 1;
  const Outputs one = run_forward(b, p, spec);
  ASSERT_TRUE(one.status.ok()) << one.status.message();
  const Reference ref(p, spec.options);
  expect_forward_matches(one, p, ref, spec);
  expect_grad_matches(one.grad, p, ref, {});
  for (int threads : {2, 3, 0}) {
    SCOPED_TRACE("num_threads " + std::to_string(threads));
    spec.num_threads = threads;
    const Outputs other = run_forward(b, p, spec);
    ASSERT_TRUE(other.status.ok()) << other.status.message();
    EXPECT_EQ(std::memcmp(one.loss.data(), other.loss.data(), 4), 0) << one.loss[0] << " vs " << other.loss[0];
    EXPECT_EQ(std::memcmp(one.lse.data(), other.lse.data(), one.lse.size() * 4), 0);
    EXPECT_EQ(one.num_correct, other.num_correct);
    EXPECT_EQ(std::memcmp(&one.entropy_sum, &other.entropy_sum, 4), 0);
    std::string diff;
    EXPECT_TRUE(one.grad.same_bits(other.grad, &diff)) << diff;
  }
}

// Two threads calling the CPU backend at once (as data-parallel workers in one process do):
// each gets its own results, bit for bit those of a call made alone, and nothing hangs.
TEST(CpuThreads, ConcurrentCallersGetTheirOwnResults) {
  std::mt19937_64 rng = test_rng();
  Backend& b = *cpu_test_backend();
  std::vector<Problem> problems;
  std::vector<Outputs> alone;
  RunSpec spec;
  spec.options = make_options(OptionSet::kAllReduceNone);
  spec.gradient = true;
  for (int k = 0; k < 2; ++k) {
    GenSpec gen;
    gen.dtype = k == 0 ? DType::kFloat32 : DType::kFloat16;
    gen.rows = 40 + k;
    gen.vocab = 3000 + 7 * k;
    gen.class_weight = true;
    problems.push_back(make_problem(gen, rng));
    alone.push_back(run_forward(b, problems[k], spec));
    ASSERT_TRUE(alone[k].status.ok()) << alone[k].status.message();
  }
  std::vector<int> mismatches(2, 0);
  auto worker = [&](int k) {
    for (int rep = 0; rep < 8; ++rep) {
      const Outputs out = run_forward(b, problems[k], spec);
      const bool same = out.status.ok() && out.loss == alone[k].loss && out.lse == alone[k].lse &&
                        out.grad.same_bits(alone[k].grad);
      mismatches[k] += same ? 0 : 1;
    }
  };
  std::thread other(worker, 1);
  worker(0);
  other.join();
  EXPECT_EQ(mismatches[0], 0);
  EXPECT_EQ(mismatches[1], 0);
}

// A CUDA device handle in a build without CUDA: kUnsupported, not a crash.
TEST(CudaDevice, UnsupportedWithoutCuda) {
  if (fusedce::built_with_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  float logits[6] = {0, 1, 2, 3, 4, 5}, loss = 0.0f;
  int64_t target[2] = {1, 2};
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(&loss, DType::kFloat32, 1);
  const fusedce::Status s = fusedce::cross_entropy_forward(fusedce::Device::cuda(), fusedce::matrix(logits, DType::kFloat32, 2, 3),
                                                           fusedce::vector(target, DType::kInt64, 2), {}, out);
  EXPECT_EQ(s.code(), fusedce::StatusCode::kUnsupported) << s.message();
  EXPECT_NE(s.message().find("CUDA"), std::string::npos) << s.message();
}

}  // namespace
}  // namespace fusedce_test
