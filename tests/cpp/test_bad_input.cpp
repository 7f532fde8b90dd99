// docs/contract.md, "Bad input": each malformed call returns kInvalidArgument with a message
// naming the argument, before any work (outputs keep their contents); a target outside [0, V)
// that is not ignore_index returns kTargetOutOfRange naming the first bad row and its value.
#include <algorithm>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "fixture.h"
#include "harness.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Job;
using fusedce::Reduction;
using fusedce::StatusCode;

constexpr int64_t kRows = 6;
constexpr int64_t kVocab = 10;
constexpr uint8_t kSentinel = 0xAB;

// Device buffers of a small valid problem, and the arguments of one call made from them.
struct Buffers {
  DeviceBuffer logits, logits16, target, weight, loss, lse, grad_loss, dlogits, dlogits16, correct, entropy, workspace;

  explicit Buffers(Backend& b) {
    std::vector<float> x(kRows * kVocab);
    for (size_t k = 0; k < x.size(); ++k) x[k] = static_cast<float>(k % 7) * 0.5f - 1.0f;
    logits = DeviceBuffer::from_vector(b, x);
    logits16 = DeviceBuffer(b, x.size() * 2);
    logits16.fill(0);
    target = DeviceBuffer::from_vector(b, std::vector<int64_t>{1, 2, -100, 9, 0, 4});
    weight = DeviceBuffer::from_vector(b, std::vector<float>(kVocab, 1.5f));
    loss = DeviceBuffer(b, kRows * 4);
    lse = DeviceBuffer(b, kRows * 4);
    grad_loss = DeviceBuffer::from_vector(b, std::vector<float>(kRows, 0.5f));
    dlogits = DeviceBuffer(b, x.size() * 4);
    dlogits16 = DeviceBuffer(b, x.size() * 2);
    correct = DeviceBuffer(b, 8);
    entropy = DeviceBuffer(b, 4);
    size_t ws = 0;
    for (Job job : {Job::kForward, Job::kBackward, Job::kForwardBackward, Job::kRescale}) {
      ws = std::max(ws, fusedce::cross_entropy_workspace_size(job, b.device(), kRows, kVocab, fusedce::Options{}));
    }
    workspace = DeviceBuffer(b, ws);
    workspace_bytes = ws;
  }
  size_t workspace_bytes = 0;
  void fill_outputs() {
    for (DeviceBuffer* d : {&loss, &lse, &dlogits, &dlogits16, &correct, &entropy}) d->fill(kSentinel);
  }
  // Whether no output byte changed since fill_outputs().
  bool outputs_untouched() const {
    for (const DeviceBuffer* d : {&loss, &lse, &dlogits, &dlogits16, &correct, &entropy}) {
      for (uint8_t byte : d->to_host()) {
        if (byte != kSentinel) return false;
      }
    }
    return true;
  }
};

struct Call {
  Job job;
  fusedce::MatrixView logits;
  fusedce::VectorView target;
  fusedce::Options options;
  fusedce::ForwardOutputs out;
  fusedce::VectorView lse;  // backward's input
  fusedce::VectorView grad_loss;
  fusedce::MatrixView dlogits;
  fusedce::Device device;
  fusedce::Workspace workspace;
};

// The valid call of each job: reduction mean, scalar grad_loss.
Call valid_call(Job job, Buffers& b, const fusedce::Device& device) {
  Call c;
  c.job = job;
  c.device = device;
  c.logits = fusedce::matrix(b.logits.data(), DType::kFloat32, kRows, kVocab);
  c.target = fusedce::vector(b.target.data(), DType::kInt64, kRows);
  if (job == Job::kForward || job == Job::kForwardBackward) {
    c.out.loss = fusedce::vector(b.loss.data(), DType::kFloat32, 1);
    c.out.lse = fusedce::vector(b.lse.data(), DType::kFloat32, kRows);
  }
  if (job == Job::kBackward) {
    c.lse = fusedce::vector(b.lse.data(), DType::kFloat32, kRows);
    c.grad_loss = fusedce::vector(b.grad_loss.data(), DType::kFloat32, 1);
  }
  if (job == Job::kRescale) c.grad_loss = fusedce::vector(b.grad_loss.data(), DType::kFloat32, 1);
  if (job != Job::kForward) c.dlogits = fusedce::matrix(b.dlogits.data(), DType::kFloat32, kRows, kVocab);
  if (b.workspace_bytes > 0) c.workspace = fusedce::Workspace{b.workspace.data(), b.workspace_bytes};
  return c;
}

fusedce::Status invoke(const Call& c) {
  switch (c.job) {
    case Job::kForward:
      return fusedce::cross_entropy_forward(c.device, c.logits, c.target, c.options, c.out, c.workspace);
    case Job::kBackward:
      return fusedce::cross_entropy_backward(c.device, c.logits, c.target, c.lse, c.grad_loss, c.options, c.dlogits,
                                             c.workspace);
    case Job::kForwardBackward:
      return fusedce::cross_entropy_forward_backward(c.device, c.logits, c.target, c.options, c.out, c.grad_loss,
                                                     c.dlogits, c.workspace);
    case Job::kRescale: return fusedce::cross_entropy_rescale_grad(c.device, c.grad_loss, c.dlogits, c.workspace);
  }
  return fusedce::Status(StatusCode::kInvalidArgument, "unknown job");
}

struct BadCall {
  const char* name;
  Job job;
  const char* names;  // the argument the message must name
  std::function<void(Call&, Buffers&)> mutate;
};

const std::vector<BadCall>& bad_calls() {
  using F = Job;
  static const std::vector<BadCall> calls = {
      // logits
      {"logits_dtype_int32", F::kForward, "logits", [](Call& c, Buffers&) { c.logits.dtype = DType::kInt32; }},
      {"logits_dtype_unknown", F::kForward, "logits", [](Call& c, Buffers&) { c.logits.dtype = static_cast<DType>(42); }},
      {"vocab_zero", F::kForward, "logits", [](Call& c, Buffers&) { c.logits.cols = 0; c.logits.row_stride = 0; }},
      {"rows_negative", F::kForward, "logits", [](Call& c, Buffers&) { c.logits.rows = -1; }},
      {"row_stride_below_vocab", F::kForward, "logits row_stride", [](Call& c, Buffers&) { c.logits.row_stride = kVocab - 1; }},
      {"logits_null", F::kForward, "logits", [](Call& c, Buffers&) { c.logits.data = nullptr; }},
      // target
      {"target_size_mismatch", F::kForward, "target", [](Call& c, Buffers&) { c.target.size = kRows - 1; }},
      {"target_dtype_float32", F::kForward, "target", [](Call& c, Buffers&) { c.target.dtype = DType::kFloat32; }},
      {"target_null", F::kForward, "target", [](Call& c, Buffers&) { c.target.data = nullptr; }},
      // options
      {"class_weight_size", F::kForward, "class_weight",
       [](Call& c, Buffers& b) { c.options.class_weight = fusedce::vector(b.weight.data(), DType::kFloat32, kVocab - 1); }},
      {"class_weight_dtype", F::kForward, "class_weight",
       [](Call& c, Buffers& b) { c.options.class_weight = fusedce::vector(b.weight.data(), DType::kBFloat16, kVocab); }},
      {"class_weight_null", F::kForward, "class_weight",
       [](Call& c, Buffers&) { c.options.class_weight = fusedce::vector(nullptr, DType::kFloat32, kVocab); }},
      {"label_smoothing_negative", F::kForward, "label_smoothing", [](Call& c, Buffers&) { c.options.label_smoothing = -0.1f; }},
      {"label_smoothing_above_one", F::kForward, "label_smoothing", [](Call& c, Buffers&) { c.options.label_smoothing = 1.5f; }},
      {"label_smoothing_nan", F::kForward, "label_smoothing",
       [](Call& c, Buffers&) { c.options.label_smoothing = std::numeric_limits<float>::quiet_NaN(); }},
      {"softcap_negative", F::kForward, "softcap", [](Call& c, Buffers&) { c.options.softcap = -1.0f; }},
      {"logit_scale_zero", F::kForward, "logit_scale", [](Call& c, Buffers&) { c.options.logit_scale = 0.0f; }},
      {"z_loss_negative", F::kForward, "z_loss", [](Call& c, Buffers&) { c.options.z_loss = -1e-4f; }},
      {"reduction_unknown", F::kForward, "reduction", [](Call& c, Buffers&) { c.options.reduction = static_cast<Reduction>(7); }},
      // forward outputs
      {"loss_size_for_none", F::kForward, "loss", [](Call& c, Buffers&) { c.options.reduction = Reduction::kNone; }},
      {"loss_size_for_mean", F::kForward, "loss", [](Call& c, Buffers&) { c.out.loss.size = kRows; }},
      {"loss_size_for_sum", F::kForwardBackward, "loss",
       [](Call& c, Buffers&) { c.options.reduction = Reduction::kSum; c.out.loss.size = 2; }},
      {"loss_dtype", F::kForward, "loss", [](Call& c, Buffers&) { c.out.loss.dtype = DType::kFloat16; }},
      {"loss_null", F::kForward, "loss", [](Call& c, Buffers&) { c.out.loss.data = nullptr; }},
      {"lse_size", F::kForward, "lse", [](Call& c, Buffers&) { c.out.lse.size = kRows + 1; }},
      {"num_correct_missing", F::kForward, "num_correct", [](Call& c, Buffers& b) {
         c.options.return_metrics = true;
         c.out.entropy_sum = fusedce::vector(b.entropy.data(), DType::kFloat32, 1);
       }},
      {"num_correct_dtype", F::kForward, "num_correct", [](Call& c, Buffers& b) {
         c.options.return_metrics = true;
         c.out.num_correct = fusedce::vector(b.correct.data(), DType::kInt32, 1);
         c.out.entropy_sum = fusedce::vector(b.entropy.data(), DType::kFloat32, 1);
       }},
      {"entropy_sum_missing", F::kForward, "entropy_sum", [](Call& c, Buffers& b) {
         c.options.return_metrics = true;
         c.out.num_correct = fusedce::vector(b.correct.data(), DType::kInt64, 1);
       }},
      // backward
      {"backward_lse_size", F::kBackward, "lse", [](Call& c, Buffers&) { c.lse.size = kRows - 1; }},
      {"backward_lse_null", F::kBackward, "lse", [](Call& c, Buffers&) { c.lse.data = nullptr; }},
      {"backward_grad_loss_size_mean", F::kBackward, "grad_loss", [](Call& c, Buffers&) { c.grad_loss.size = kRows; }},
      {"backward_grad_loss_size_none", F::kBackward, "grad_loss",
       [](Call& c, Buffers&) { c.options.reduction = Reduction::kNone; }},
      {"backward_grad_loss_null", F::kBackward, "grad_loss", [](Call& c, Buffers&) { c.grad_loss.data = nullptr; }},
      {"backward_grad_loss_dtype", F::kBackward, "grad_loss", [](Call& c, Buffers&) { c.grad_loss.dtype = DType::kInt64; }},
      {"backward_dlogits_rows", F::kBackward, "dlogits", [](Call& c, Buffers&) { c.dlogits.rows = kRows - 1; }},
      {"backward_dlogits_cols", F::kBackward, "dlogits", [](Call& c, Buffers&) { c.dlogits.cols = kVocab + 1; c.dlogits.row_stride = kVocab + 1; }},
      {"backward_dlogits_dtype", F::kBackward, "dlogits",
       [](Call& c, Buffers& b) { c.dlogits = fusedce::matrix(b.dlogits16.data(), DType::kBFloat16, kRows, kVocab); }},
      {"backward_dlogits_null", F::kBackward, "dlogits", [](Call& c, Buffers&) { c.dlogits.data = nullptr; }},
      // forward with gradient
      {"dlogits_shape", F::kForwardBackward, "dlogits", [](Call& c, Buffers&) { c.dlogits.rows = kRows + 1; }},
      {"dlogits_dtype", F::kForwardBackward, "dlogits",
       [](Call& c, Buffers& b) { c.dlogits = fusedce::matrix(b.dlogits16.data(), DType::kFloat16, kRows, kVocab); }},
      {"dlogits_stride_below_vocab", F::kForwardBackward, "dlogits", [](Call& c, Buffers&) { c.dlogits.row_stride = 3; }},
      {"inplace_backward_other_buffer", F::kForwardBackward, "inplace_backward", [](Call& c, Buffers&) { c.options.inplace_backward = true; }},
      {"inplace_backward_other_stride", F::kForwardBackward, "inplace_backward", [](Call& c, Buffers&) {
         c.options.inplace_backward = true;
         c.logits.rows = kRows / 2;  // rows 2 x stride apart: a view of the same buffer
         c.logits.row_stride = 2 * kVocab;
         c.target.size = kRows / 2;
         c.out.lse.size = kRows / 2;
         c.dlogits = c.logits;
         c.dlogits.row_stride = kVocab;
       }},
      {"dlogits_is_logits_without_inplace_backward", F::kForwardBackward, "inplace_backward",
       [](Call& c, Buffers&) { c.dlogits = c.logits; }},
      {"dlogits_overlaps_logits", F::kForwardBackward, "dlogits", [](Call& c, Buffers&) {
         c.logits.rows = 3;
         c.target.size = 3;
         c.out.lse.size = 3;
         c.dlogits = c.logits;
         c.dlogits.data = static_cast<float*>(c.logits.data) + 2 * kVocab;
       }},
      {"forward_backward_grad_loss_size", F::kForwardBackward, "grad_loss",
       [](Call& c, Buffers& b) { c.grad_loss = fusedce::vector(b.grad_loss.data(), DType::kFloat32, 2); }},
      // rescale
      {"rescale_grad_loss_size", F::kRescale, "grad_loss", [](Call& c, Buffers&) { c.grad_loss.size = 3; }},
      {"rescale_grad_loss_null", F::kRescale, "grad_loss", [](Call& c, Buffers&) { c.grad_loss.data = nullptr; }},
      {"rescale_grad_loss_dtype", F::kRescale, "grad_loss", [](Call& c, Buffers&) { c.grad_loss.dtype = DType::kFloat16; }},
      {"rescale_dlogits_dtype", F::kRescale, "dlogits", [](Call& c, Buffers&) { c.dlogits.dtype = DType::kInt32; }},
      {"rescale_dlogits_null", F::kRescale, "dlogits", [](Call& c, Buffers&) { c.dlogits.data = nullptr; }},
      // device
      {"device_type_unknown", F::kForward, "device",
       [](Call& c, Buffers&) { c.device.type = static_cast<fusedce::DeviceType>(9); }},
  };
  return calls;
}

struct BadCase {
  BackendKind backend;
  size_t index;
};
void PrintTo(const BadCase& c, std::ostream* os) { *os << backend_name(c.backend) << "_" << bad_calls()[c.index].name; }

std::vector<BadCase> bad_cases() {
  std::vector<BadCase> cases;
  for (BackendKind b : all_backends()) {
    for (size_t k = 0; k < bad_calls().size(); ++k) cases.push_back({b, k});
  }
  return cases;
}

class BadInput : public BackendTest<BadCase> {};

TEST_P(BadInput, RejectedBeforeAnyWorkNamingTheArgument) {
  const BadCall& bad = bad_calls()[GetParam().index];
  Backend& b = backend();
  Buffers buffers(b);
  Call call = valid_call(bad.job, buffers, b.device());
  {
    const fusedce::Status s = invoke(call);
    b.synchronize();
    ASSERT_TRUE(s.ok()) << "the unmodified call must be valid: " << s.message();
  }
  buffers.fill_outputs();
  bad.mutate(call, buffers);
  const fusedce::Status s = invoke(call);
  b.synchronize();
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s.message();
  EXPECT_NE(s.message().find(bad.names), std::string::npos)
      << "the message should name '" << bad.names << "': " << s.message();
  EXPECT_TRUE(buffers.outputs_untouched()) << "a rejected call wrote to an output";
}

INSTANTIATE_TEST_SUITE_P(Validation, BadInput, ::testing::ValuesIn(bad_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) {
                           return std::string(backend_name(info.param.backend)) + "_" + bad_calls()[info.param.index].name;
                         });

class TargetRange : public BackendTest<BackendKind> {};

// Out-of-range targets, for both target dtypes and the three jobs that read targets: the first
// bad row and its value are named, with StatusCode::kTargetOutOfRange. Values: V, -1, -101 (next
// to ignore_index), 2^40 (int64 only), and INT32_MIN (int32 only).
TEST_P(TargetRange, OutOfRangeTargetNamesFirstBadRowAndValue) {
  Backend& b = backend();
  std::mt19937_64 rng = test_rng();
  GenSpec gen;
  gen.rows = 40;
  gen.vocab = 100;
  const Problem base = make_problem(gen, rng);
  struct Bad {
    int64_t row, value;
    bool int64_only, int32_only;
  };
  const std::vector<Bad> bads = {{27, 100, false, false},
                                 {11, -1, false, false},
                                 {39, -101, false, false},
                                 {0, int64_t(1) << 40, true, false},
                                 {33, std::numeric_limits<int32_t>::min(), false, true}};
  for (DType tdtype : {DType::kInt32, DType::kInt64}) {
    for (const Bad& bad : bads) {
      if ((bad.int64_only && tdtype != DType::kInt64) || (bad.int32_only && tdtype != DType::kInt32)) continue;
      Problem p = base;
      p.target_dtype = tdtype;
      p.target[bad.row] = bad.value;
      if (bad.row < 39) p.target[39] = 1000;  // a later bad row must not be the one reported
      for (Job job : {Job::kForward, Job::kForwardBackward, Job::kBackward}) {
        SCOPED_TRACE(std::string(dtype_name(tdtype)) + " row " + std::to_string(bad.row) + " value " +
                     std::to_string(bad.value) + " job " + std::to_string(static_cast<int>(job)));
        fusedce::Options o;
        o.check_targets = true;  // CUDA reports only when asked; the CPU always checks
        Outputs out;
        if (job == Job::kBackward) {
          out = run_backward(b, p, o, std::vector<float>(p.rows, 5.0f), {1.0f});
        } else {
          RunSpec spec;
          spec.options = o;
          spec.gradient = job == Job::kForwardBackward;
          out = run_forward(b, p, spec);
        }
        EXPECT_EQ(out.status.code(), StatusCode::kTargetOutOfRange) << out.status.message();
        const std::string& m = out.status.message();
        EXPECT_NE(m.find(std::to_string(bad.row)), std::string::npos) << "row not named: " << m;
        EXPECT_NE(m.find(std::to_string(bad.value)), std::string::npos) << "value not named: " << m;
        if (bad.row < 39) {
          EXPECT_EQ(m.find("1000"), std::string::npos) << "a later bad row was reported: " << m;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Validation, TargetRange, ::testing::ValuesIn(all_backends()),
                         [](const ::testing::TestParamInfo<BackendKind>& info) {
                           return std::string(backend_name(info.param));
                         });

}  // namespace
}  // namespace fusedce_test
