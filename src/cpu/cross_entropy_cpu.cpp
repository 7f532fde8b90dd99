// The CPU backend's host side: picks the row kernels of the CPU's instruction set (for every
// caller of kernels.h), checks target values, prepares the row kernels' arguments, spreads rows
// over threads, and reduces per-row results over the batch in a fixed order (in double), so the
// result is the same whatever the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "common/call.h"
#include "common/constants.h"
#include "cpu/fresh_pages.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace fusedce {
namespace cpu {
namespace {

bool cpu_has_avx2() {
#if defined(FUSEDCE_HAVE_AVX2_KERNELS)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

// AVX-512 (F, BW, DQ, VL) on top of AVX2's set: the 16-lane build of the same row kernels.
bool cpu_has_avx512() {
#if defined(FUSEDCE_HAVE_AVX2_KERNELS)
  static const bool has = cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
#else
  return false;
#endif
}

RowKernels pick_row_kernels() {
#if defined(FUSEDCE_HAVE_AVX2_KERNELS)
  if (cpu_has_avx512()) return avx512::row_kernels();
  if (cpu_has_avx2()) return avx2::row_kernels();
#endif
  return generic::row_kernels();
}

template <typename Args>
void run_row_kernel(RowFn<Args> fn, const Args& args, int64_t n, int max_threads) {
  parallel_for(n, row_grain(args.vocab), max_threads, [&](int64_t b, int64_t e) { fn(args, b, e); });
}

template <typename T>
T& at(const VectorView& v, int64_t i) {
  return static_cast<T*>(v.data)[i * v.stride];
}

Status run_rescale(const detail::CeCall& call) {
  const MatrixView& d = call.dlogits;
  RescaleArgs a;
  a.dlogits = static_cast<char*>(d.data);
  a.dtype = d.dtype;
  a.vocab = d.cols;
  a.stride = d.row_stride;
  a.grad_loss = static_cast<const float*>(call.grad_loss.data);
  a.grad_stride = call.grad_loss.stride;
  a.grad_scalar = call.grad_loss.size == 1 && d.rows != 1;
  run_row_kernel(best_row_kernels().rescale, a, d.rows, call.device.num_threads);
  return Status::Ok();
}

}  // namespace

const RowKernels& best_row_kernels() {
  static const RowKernels k = pick_row_kernels();
  return k;
}

int64_t row_grain(int64_t vocab) { return std::max<int64_t>(1, (int64_t(1) << 16) / std::max<int64_t>(vocab, 1)); }

void run_rows(const RowArgs& args, int64_t n, int max_threads) {
  run_row_kernel(best_row_kernels().ce, args, n, max_threads);
}

void run_lp_stats_rows(const LpRowArgs& args, int64_t n, int max_threads) {
  run_row_kernel(best_row_kernels().lp_stats, args, n, max_threads);
}

void run_lp_grad_rows(const LpRowArgs& args, int64_t n, int max_threads) {
  run_row_kernel(best_row_kernels().lp_grad, args, n, max_threads);
}

Status run(const detail::CeCall& call) {
  if (call.job == Job::kRescale) return run_rescale(call);

  const MatrixView& L = call.logits;
  const Options& o = call.options;
  const int64_t N = L.rows, V = L.cols;
  Status s = detail::check_targets_host(call.target, V, o.ignore_index);
  if (!s.ok()) return s;

  // Class weights, contiguous, and the batch-level sums that need only targets and weights.
  std::vector<float> weight;
  double weight_sum = static_cast<double>(V);
  if (!o.class_weight.empty()) {
    weight.resize(V);
    weight_sum = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      weight[j] = at<const float>(o.class_weight, j);
      weight_sum += weight[j];
    }
  }
  double denominator = 0.0;  // mean: non-ignored rows, or the sum of their target weights
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = load_target(call.target.data, call.target.dtype, call.target.stride, i);
    if (t != o.ignore_index) denominator += weight.empty() ? 1.0 : weight[t];
  }

  const bool forward = call.job != Job::kBackward;
  const bool gradient = call.job != Job::kForward;
  std::vector<float> row_loss(forward ? N : 0), row_lse(forward ? N : 0);
  std::vector<float> row_entropy(forward && o.return_metrics ? N : 0);
  std::vector<uint8_t> row_correct(forward && o.return_metrics ? N : 0);

  RowArgs a{};
  a.logits = static_cast<const char*>(L.data);
  a.dtype = L.dtype;
  a.vocab = V;
  a.logits_stride = L.row_stride;
  a.target = call.target.data;
  a.target_dtype = call.target.dtype;
  a.target_stride = call.target.stride;
  a.ignore_index = o.ignore_index;
  a.class_weight = weight.empty() ? nullptr : weight.data();
  a.c = detail::make_loss_constants(o, V, static_cast<float>(weight_sum));
  a.softcap = o.softcap > 0.0f;
  a.smoothing = o.label_smoothing != 0.0f;
  a.metrics = forward && o.return_metrics;
  a.forward = forward;
  a.gradient = gradient;
  a.lse_in = static_cast<const float*>(call.lse_in.data);
  a.lse_in_stride = call.lse_in.stride;
  a.grad_loss = static_cast<const float*>(call.grad_loss.data);
  a.grad_stride = call.grad_loss.stride;
  a.grad_scalar = o.reduction != Reduction::kNone;
  a.g_chain = o.reduction == Reduction::kMean ? static_cast<float>(1.0 / denominator) : 1.0f;
  a.dlogits = static_cast<char*>(call.dlogits.data);
  a.dlogits_stride = call.dlogits.row_stride;
  if (gradient && N > 0 && call.dlogits.data != L.data) {
    prefer_huge_pages(call.dlogits.data, size_t((N - 1) * call.dlogits.row_stride + V) * dtype_size(call.dlogits.dtype));
  }
  a.row_loss = row_loss.data();
  a.row_lse = row_lse.data();
  a.row_entropy = row_entropy.data();
  a.row_correct = row_correct.data();

  run_rows(a, N, call.device.num_threads);

  if (!forward) return Status::Ok();
  const ForwardOutputs& out = call.out;
  if (o.reduction == Reduction::kNone) {
    for (int64_t i = 0; i < N; ++i) at<float>(out.loss, i) = row_loss[i];
  } else {
    double total = 0.0;
    for (int64_t i = 0; i < N; ++i) total += row_loss[i];
    at<float>(out.loss, 0) =
        static_cast<float>(o.reduction == Reduction::kMean ? total / denominator : total);
  }
  if (!out.lse.empty()) {
    for (int64_t i = 0; i < N; ++i) at<float>(out.lse, i) = row_lse[i];
  }
  if (o.return_metrics) {
    int64_t correct = 0;
    double entropy = 0.0;
    for (int64_t i = 0; i < N; ++i) {
      correct += row_correct[i];
      entropy += row_entropy[i];
    }
    at<int64_t>(out.num_correct, 0) = correct;
    at<float>(out.entropy_sum, 0) = static_cast<float>(entropy);
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace fusedce
