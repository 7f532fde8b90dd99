#include "harness.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include "gtest/gtest.h"

namespace fusedce_test {

using fusedce::DType;
using fusedce::Reduction;

namespace {

constexpr uint8_t kSentinelByte = 0xCD;  // fills output buffers: 0xCDCD... is a finite garbage value
constexpr int64_t kGuard = 16;           // elements of guard before and after every output

std::string fmt(double v) {
  std::ostringstream os;
  os.precision(9);
  os << v;
  return os.str();
}

// A strided output vector of `n` elements of `es` bytes, with kGuard elements of sentinel on
// each side.
struct OutVector {
  DeviceBuffer buf;
  int64_t n = 0, stride = 1;
  size_t es = 4;

  OutVector(Backend& b, int64_t n_, int64_t stride_, size_t es_)
      : buf(b, static_cast<size_t>(2 * kGuard + (n_ > 0 ? (n_ - 1) * stride_ + 1 : 0)) * es_),
        n(n_), stride(stride_), es(es_) {
    buf.fill(kSentinelByte);
  }
  void* data() const { return buf.at(kGuard * es); }
  fusedce::VectorView view(DType dtype) const { return fusedce::vector(data(), dtype, n, stride); }

  // Downloads the elements; fails the test if anything outside them changed.
  template <typename T>
  std::vector<T> fetch(const char* name) const {
    const std::vector<uint8_t> all = buf.to_host();
    std::vector<T> v(n);
    int64_t touched = 0;
    for (int64_t k = 0; k < static_cast<int64_t>(all.size() / es); ++k) {
      const int64_t rel = k - kGuard;
      const bool inside = rel >= 0 && rel % stride == 0 && rel / stride < n;
      if (inside) {
        std::memcpy(&v[rel / stride], &all[k * es], es);
      } else {
        for (size_t b = 0; b < es; ++b) touched += all[k * es + b] != kSentinelByte;
      }
    }
    EXPECT_EQ(touched, 0) << name << ": bytes outside the output vector (guards or stride gaps) were written";
    return v;
  }
};

// Target values encoded in the problem's dtype and stride; the gaps hold an out-of-range value,
// so a kernel that reads them reports an error.
DeviceBuffer upload_target(Backend& b, const Problem& p) {
  const int64_t slots = std::max<int64_t>(1, p.rows * p.target_stride);
  const int64_t bad = p.vocab + 12345;
  if (p.target_dtype == DType::kInt32) {
    std::vector<int32_t> t(slots, static_cast<int32_t>(bad));
    for (int64_t i = 0; i < p.rows; ++i) t[i * p.target_stride] = static_cast<int32_t>(p.target[i]);
    return DeviceBuffer::from_vector(b, t);
  }
  std::vector<int64_t> t(slots, bad);
  for (int64_t i = 0; i < p.rows; ++i) t[i * p.target_stride] = p.target[i];
  return DeviceBuffer::from_vector(b, t);
}

// A float vector with NaN in the stride gaps.
DeviceBuffer upload_floats(Backend& b, const std::vector<float>& v, int64_t stride) {
  std::vector<float> s(std::max<size_t>(1, v.size() * stride), std::numeric_limits<float>::quiet_NaN());
  for (size_t k = 0; k < v.size(); ++k) s[k * stride] = v[k];
  return DeviceBuffer::from_vector(b, s);
}

struct Inputs {
  DeviceBuffer logits, target, weight;
  fusedce::MatrixView logits_view;
  fusedce::VectorView target_view;
  fusedce::Options options;

  Inputs(Backend& b, const Problem& p, const fusedce::Options& o) : options(o) {
    logits = DeviceBuffer::from_host(b, p.logits.data(), p.logits.size());
    logits_view = fusedce::matrix(logits.at(p.offset * elem_size(p.dtype)), p.dtype, p.rows, p.vocab,
                                  p.row_stride);
    target = upload_target(b, p);
    target_view = fusedce::vector(target.data(), p.target_dtype, p.rows, p.target_stride);
    if (!p.class_weight.empty()) {
      weight = upload_floats(b, p.class_weight, p.weight_stride);
      options.class_weight = fusedce::vector(weight.data(), DType::kFloat32, p.vocab, p.weight_stride);
    }
  }
};

// A dlogits matrix with sentinel guards, padding and offset.
struct OutMatrix {
  DeviceBuffer buf;
  DType dtype;
  int64_t rows, vocab, stride, offset;  // offset in elements, guard included

  OutMatrix(Backend& b, DType dtype_, int64_t rows_, int64_t vocab_, int64_t pad, int64_t offset_)
      : buf(b, static_cast<size_t>(2 * kGuard + offset_ + rows_ * (vocab_ + pad)) * elem_size(dtype_)),
        dtype(dtype_), rows(rows_), vocab(vocab_), stride(vocab_ + pad), offset(kGuard + offset_) {
    buf.fill(kSentinelByte);
  }
  fusedce::MatrixView view() const {
    return fusedce::matrix(buf.at(offset * elem_size(dtype)), dtype, rows, vocab, stride);
  }
  GradMatrix fetch() const {
    GradMatrix g;
    g.dtype = dtype;
    g.rows = rows;
    g.vocab = vocab;
    g.stride = stride;
    g.offset = offset;
    g.bytes = buf.to_host();
    // The gaps: [0, offset), each row's padding, and everything after the last row.
    const size_t es = elem_size(dtype);
    const int64_t total = static_cast<int64_t>(g.bytes.size() / es);
    int64_t touched = 0;
    auto scan = [&](int64_t from, int64_t to) {
      for (int64_t b = from * static_cast<int64_t>(es); b < to * static_cast<int64_t>(es); ++b) {
        touched += g.bytes[b] != kSentinelByte;
      }
    };
    scan(0, offset);
    for (int64_t i = 0; i < rows; ++i) scan(offset + i * stride + vocab, offset + (i + 1) * stride);
    scan(offset + rows * stride, total);
    EXPECT_EQ(touched, 0) << "dlogits: bytes outside the gradient matrix (guards, row padding) were written";
    return g;
  }
};

// Checks that the logits buffer is as uploaded: entirely (out-of-place), or outside the logits
// matrix (in place, where the matrix holds the gradient now).
void expect_logits_buffer_intact(const Problem& p, const DeviceBuffer& now, bool matrix_too) {
  if (matrix_too) {
    // In slices of 16 MB, so a large case needs no second full-size host copy.
    constexpr size_t kSlice = size_t(1) << 24;
    std::vector<uint8_t> slice(std::min(kSlice, p.logits.size()));
    bool same = true;
    for (size_t b = 0; b < p.logits.size() && same; b += kSlice) {
      const size_t n = std::min(kSlice, p.logits.size() - b);
      now.download(slice.data(), n, b);
      same = std::memcmp(slice.data(), &p.logits[b], n) == 0;
    }
    EXPECT_TRUE(same) << "logits were modified by a call that must only read them";
    return;
  }
  const std::vector<uint8_t> bytes = now.to_host();
  const size_t es = elem_size(p.dtype);
  int64_t changed = 0;
  auto compare = [&](int64_t from, int64_t to) {
    if (to > from) changed += std::memcmp(&bytes[from * es], &p.logits[from * es], (to - from) * es) != 0;
  };
  compare(0, p.offset);
  for (int64_t i = 0; i < p.rows; ++i) compare(p.index(i, p.vocab), p.index(i + 1, 0));
  EXPECT_EQ(changed, 0) << "the logits buffer was written outside the logits matrix";
}

GradMatrix grad_from_logits(const Problem& p, std::vector<uint8_t> bytes) {
  GradMatrix g;
  g.dtype = p.dtype;
  g.rows = p.rows;
  g.vocab = p.vocab;
  g.stride = p.row_stride;
  g.offset = p.offset;
  g.bytes = std::move(bytes);
  return g;
}

DeviceBuffer make_workspace(Backend& b, fusedce::Job job, const Problem& p, const fusedce::Options& o,
                            fusedce::Workspace* ws) {
  const size_t bytes = fusedce::cross_entropy_workspace_size(job, b.device(), p.rows, p.vocab, o);
  DeviceBuffer buf(b, bytes);
  *ws = fusedce::Workspace{bytes > 0 ? buf.data() : nullptr, bytes};
  return buf;
}

}  // namespace

// ---- tolerances ------------------------------------------------------------------------------

Tolerance tolerance(DType dtype, Quantity quantity) {
  if (quantity == Quantity::kLoss) return {1e-5, 2e-6, 0.0};
  switch (dtype) {
    case DType::kBFloat16: return {8e-3, 2e-6, 0.0};
    case DType::kFloat16: return {1e-3, 2e-6, std::ldexp(1.0, -24)};
    default: return {1e-5, 2e-6, 0.0};
  }
}

bool within(double got, double ref, double scale, const Tolerance& tol, double* bound) {
  const double b = tol.rtol * std::fabs(ref) + tol.atol * scale + tol.floor;
  if (bound != nullptr) *bound = b;
  if (std::isnan(ref)) return std::isnan(got);
  if (std::isinf(ref)) return got == ref;
  if (!std::isfinite(got)) return false;
  return std::fabs(got - ref) <= b;
}

void Mismatches::check(double got, double ref, double scale, const Tolerance& tol, int64_t row, int64_t col) {
  ++checked_;
  double bound = 0.0;
  const bool ok = within(got, ref, scale, tol, &bound);
  if (std::isfinite(got) && std::isfinite(ref) && bound > 0.0) {
    worst_ratio_ = std::max(worst_ratio_, std::fabs(got - ref) / bound);
  }
  if (ok) return;
  std::ostringstream os;
  os << "row " << row;
  if (col >= 0) os << " col " << col;
  os << ": got " << fmt(got) << ", reference " << fmt(ref) << " (|diff| " << fmt(std::fabs(got - ref))
     << " > allowed " << fmt(bound) << ")";
  add(os.str());
}

void Mismatches::add(const std::string& message) {
  ++count_;
  if (first_.size() < 8) first_.push_back(message);
}

void Mismatches::report() const {
  std::string key = what_ + "_worst_error_ratio";
  for (char& ch : key) {
    if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
  }
  ::testing::Test::RecordProperty(key, fmt(worst_ratio_));
  if (count_ == 0) return;
  std::ostringstream os;
  os << what_ << ": " << count_ << " of " << std::max(checked_, count_) << " values mismatch; first:";
  for (const auto& m : first_) os << "\n  " << m;
  ADD_FAILURE() << os.str();
}

bool GradMatrix::row_same_bits(const GradMatrix& other, int64_t i) const {
  const size_t es = elem_size(dtype);
  return std::memcmp(&bytes[(offset + i * stride) * es], &other.bytes[(other.offset + i * other.stride) * es],
                     vocab * es) == 0;
}

bool GradMatrix::same_bits(const GradMatrix& other, std::string* first_difference) const {
  if (dtype != other.dtype || rows != other.rows || vocab != other.vocab) {
    if (first_difference) *first_difference = "shapes or dtypes differ";
    return false;
  }
  const size_t es = elem_size(dtype);
  for (int64_t i = 0; i < rows; ++i) {
    if (row_same_bits(other, i)) continue;
    for (int64_t j = 0; j < vocab; ++j) {
      if (std::memcmp(&bytes[(offset + i * stride + j) * es], &other.bytes[(other.offset + i * other.stride + j) * es],
                      es) != 0) {
        if (first_difference) {
          *first_difference = "row " + std::to_string(i) + " col " + std::to_string(j) + ": " + fmt(at(i, j)) +
                              " vs " + fmt(other.at(i, j));
        }
        return false;
      }
    }
  }
  return true;
}

// ---- running ---------------------------------------------------------------------------------

Outputs run_forward(Backend& b, const Problem& p, const RunSpec& spec) {
  Inputs in(b, p, spec.options);
  fusedce::Options& o = in.options;
  const bool none = o.reduction == Reduction::kNone;

  OutVector loss(b, none ? p.rows : 1, none ? spec.loss_stride : 1, 4);
  OutVector lse(b, p.rows, spec.lse_stride, 4);
  OutVector correct(b, 1, 1, 8), entropy(b, 1, 1, 4);
  fusedce::ForwardOutputs out;
  out.loss = loss.view(DType::kFloat32);
  if (spec.lse) out.lse = lse.view(DType::kFloat32);
  if (o.return_metrics) {
    out.num_correct = correct.view(DType::kInt64);
    out.entropy_sum = entropy.view(DType::kFloat32);
  }

  Outputs result;
  DeviceBuffer grad_loss;
  fusedce::VectorView grad_loss_view;
  if (!spec.grad_loss.empty()) {
    grad_loss = upload_floats(b, spec.grad_loss, spec.grad_loss_stride);
    grad_loss_view = fusedce::vector(grad_loss.data(), DType::kFloat32,
                                     static_cast<int64_t>(spec.grad_loss.size()), spec.grad_loss_stride);
  }
  OutMatrix dlogits(b, p.dtype, spec.gradient && !spec.inplace ? p.rows : 0, p.vocab, spec.dlogits_pad,
                    spec.dlogits_offset);
  fusedce::MatrixView dlogits_view = spec.inplace ? in.logits_view : dlogits.view();
  if (spec.inplace) o.inplace_backward = true;

  fusedce::Workspace ws;
  const fusedce::Job job = spec.gradient ? fusedce::Job::kForwardBackward : fusedce::Job::kForward;
  DeviceBuffer ws_buf = make_workspace(b, job, p, o, &ws);
  fusedce::Device device = b.device();
  if (device.type == fusedce::DeviceType::kCPU) device.num_threads = spec.num_threads;
  if (spec.gradient) {
    result.status = fusedce::cross_entropy_forward_backward(device, in.logits_view, in.target_view, o, out,
                                                            grad_loss_view, dlogits_view, ws);
  } else {
    result.status = fusedce::cross_entropy_forward(device, in.logits_view, in.target_view, o, out, ws);
  }
  b.synchronize();
  if (!result.status.ok()) return result;

  result.loss = loss.fetch<float>("loss");
  if (spec.lse) result.lse = lse.fetch<float>("lse");
  if (o.return_metrics) {
    result.num_correct = correct.fetch<int64_t>("num_correct")[0];
    result.entropy_sum = entropy.fetch<float>("entropy_sum")[0];
  }
  if (spec.gradient && spec.inplace) {
    expect_logits_buffer_intact(p, in.logits, false);
    result.grad = grad_from_logits(p, in.logits.to_host());
  } else {
    expect_logits_buffer_intact(p, in.logits, true);
    if (spec.gradient) result.grad = dlogits.fetch();
  }
  return result;
}

Outputs run_backward(Backend& b, const Problem& p, const fusedce::Options& options, const std::vector<float>& lse,
                     const std::vector<float>& grad_loss, int64_t dlogits_pad, bool inplace, int64_t lse_stride,
                     int64_t grad_loss_stride) {
  Inputs in(b, p, options);
  DeviceBuffer lse_buf = upload_floats(b, lse, lse_stride);
  DeviceBuffer g_buf = upload_floats(b, grad_loss, grad_loss_stride);
  OutMatrix dlogits(b, p.dtype, inplace ? 0 : p.rows, p.vocab, dlogits_pad, 1);
  fusedce::Workspace ws;
  DeviceBuffer ws_buf = make_workspace(b, fusedce::Job::kBackward, p, in.options, &ws);
  Outputs result;
  result.status = fusedce::cross_entropy_backward(
      b.device(), in.logits_view, in.target_view,
      fusedce::vector(lse_buf.data(), DType::kFloat32, static_cast<int64_t>(lse.size()), lse_stride),
      fusedce::vector(g_buf.data(), DType::kFloat32, static_cast<int64_t>(grad_loss.size()), grad_loss_stride),
      in.options,
      inplace ? in.logits_view : dlogits.view(), ws);
  b.synchronize();
  if (!result.status.ok()) return result;
  if (inplace) {
    expect_logits_buffer_intact(p, in.logits, false);
    result.grad = grad_from_logits(p, in.logits.to_host());
  } else {
    expect_logits_buffer_intact(p, in.logits, true);
    result.grad = dlogits.fetch();
  }
  return result;
}

fusedce::Status run_rescale(Backend& b, GradMatrix* grad, const std::vector<float>& grad_loss,
                            int64_t grad_loss_stride) {
  DeviceBuffer d = DeviceBuffer::from_host(b, grad->bytes.data(), grad->bytes.size());
  DeviceBuffer g = upload_floats(b, grad_loss, grad_loss_stride);
  const fusedce::MatrixView view =
      fusedce::matrix(d.at(grad->offset * elem_size(grad->dtype)), grad->dtype, grad->rows, grad->vocab, grad->stride);
  fusedce::Options none;
  fusedce::Workspace ws;
  const size_t bytes = fusedce::cross_entropy_workspace_size(fusedce::Job::kRescale, b.device(), grad->rows,
                                                             grad->vocab, none);
  DeviceBuffer ws_buf(b, bytes);
  ws = fusedce::Workspace{bytes > 0 ? ws_buf.data() : nullptr, bytes};
  const fusedce::Status s = fusedce::cross_entropy_rescale_grad(
      b.device(), fusedce::vector(g.data(), DType::kFloat32, static_cast<int64_t>(grad_loss.size()), grad_loss_stride),
      view, ws);
  b.synchronize();
  if (s.ok()) grad->bytes = d.to_host();
  return s;
}

// ---- judging ---------------------------------------------------------------------------------

void expect_forward_matches(const Outputs& out, const Problem& p, const Reference& ref, const RunSpec& spec) {
  ASSERT_TRUE(out.status.ok()) << out.status.message();
  const Tolerance tol = tolerance(p.dtype, Quantity::kLoss);
  const fusedce::Options& o = spec.options;
  if (o.reduction == Reduction::kNone) {
    ASSERT_EQ(static_cast<int64_t>(out.loss.size()), p.rows);
    Mismatches m("per-row loss");
    for (int64_t i = 0; i < p.rows; ++i) {
      if (ref.row(i).ignored) {
        if (out.loss[i] != 0.0f) m.add("ignored row " + std::to_string(i) + " has loss " + fmt(out.loss[i]));
        continue;
      }
      m.check(out.loss[i], ref.row(i).loss, ref.row(i).loss_scale, tol, i);
    }
    m.report();
  } else {
    ASSERT_EQ(out.loss.size(), 1u);
    double bound = 0.0;
    EXPECT_TRUE(within(out.loss[0], ref.reduced_loss(), ref.reduced_loss_scale(), tol, &bound))
        << fusedce::reduction_name(o.reduction) << " loss: got " << fmt(out.loss[0]) << ", reference "
        << fmt(ref.reduced_loss()) << " (allowed error " << fmt(bound) << ")";
  }
  if (spec.lse) {
    ASSERT_EQ(static_cast<int64_t>(out.lse.size()), p.rows);
    Mismatches m("lse");
    for (int64_t i = 0; i < p.rows; ++i) {
      if (ref.row(i).ignored) {
        if (out.lse[i] != 0.0f) m.add("ignored row " + std::to_string(i) + " has lse " + fmt(out.lse[i]));
        continue;
      }
      m.check(out.lse[i], ref.row(i).lse, std::fabs(ref.row(i).lse) + 1.0, tol, i);
    }
    m.report();
  }
  if (o.return_metrics) {
    EXPECT_EQ(out.num_correct, ref.num_correct()) << "num_correct";
    double bound = 0.0;
    EXPECT_TRUE(within(out.entropy_sum, ref.entropy_sum(), ref.entropy_scale(), tol, &bound))
        << "entropy_sum: got " << fmt(out.entropy_sum) << ", reference " << fmt(ref.entropy_sum())
        << " (allowed error " << fmt(bound) << ")";
  }
}

void expect_grad_matches(const GradMatrix& grad, const Problem& p, const Reference& ref,
                         const std::vector<float>& grad_loss) {
  ASSERT_EQ(grad.rows, p.rows);
  ASSERT_EQ(grad.vocab, p.vocab);
  const Tolerance tol = tolerance(p.dtype, Quantity::kGradient);
  Mismatches m("dlogits");
  std::vector<double> want, got(p.vocab);
  for (int64_t i = 0; i < p.rows; ++i) {
    grad.load_row(i, got.data());
    if (ref.row(i).ignored) {
      for (int64_t j = 0; j < p.vocab; ++j) {
        if (got[j] != 0.0) {
          m.add("ignored row " + std::to_string(i) + " col " + std::to_string(j) + " has gradient " + fmt(got[j]));
        }
      }
      continue;
    }
    double scale = 0.0;
    ref.grad_row(i, ref.upstream(i, grad_loss), &want, &scale);
    for (int64_t j = 0; j < p.vocab; ++j) m.check(got[j], want[j], scale, tol, i, j);
  }
  m.report();
}

const char* dtype_tag(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    default: return "other";
  }
}

std::vector<DType> float_dtypes() { return {DType::kFloat32, DType::kBFloat16, DType::kFloat16}; }

}  // namespace fusedce_test
