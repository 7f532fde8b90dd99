// The kernels behind the vocabulary-parallel torch ops (schemas in registry.h): wrap tensors
// into the core's views, check what the core cannot see, call the three steps of
// fusedce/vocab_parallel.h. No arithmetic on tensor data and no communication happens here: the
// Python front end (python/fusedce/distributed.py) all-gathers the statistics between step 1 and
// step 2 with torch.distributed.
//
// Each op is a template over a device context `Ctx`, as in ops.h.
#pragma once

#include <fusedce/vocab_parallel.h>

#include <tuple>

#include "linear_ops.h"
#include "ops.h"

namespace fusedce_torch {

inline fusedce::ShardSpec shard_of(int64_t vocab_start, int64_t vocab_total) {
  return fusedce::ShardSpec{vocab_start, vocab_total};
}

// Step 1: the shard's per-row statistics, float32 (N + 1, kShardStatsWidth).
template <class Ctx>
Tensor ce_shard_stats(const Tensor& logits, const Tensor& target, const OptTensor& class_weight,
                      int64_t vocab_start, int64_t vocab_total, fusedce::Options o, bool return_metrics) {
  Ctx ctx(logits, "logits");
  const fusedce::MatrixView x = matrix_of(logits, "logits");
  check_inputs(logits, target);
  o = with_class_weight(o, class_weight, "class_weight", logits, "logits");
  o.return_metrics = return_metrics;
  Tensor stats = at::empty({logits.size(0) + 1, fusedce::kShardStatsWidth},
                           logits.options().dtype(at::kFloat));
  check_status(fusedce::cross_entropy_shard_stats(
                   ctx.device(), x, vector_of(target, "target"), shard_of(vocab_start, vocab_total), o,
                   fusedce::matrix(stats.data_ptr(), fusedce::DType::kFloat32, stats.size(0),
                                   fusedce::kShardStatsWidth)),
               "ce_shard_stats");
  return stats;
}

// Step 2: every rank's statistics, gathered in rank order ((world * (N + 1), kShardStatsWidth)),
// merged into the loss, lse and metrics of the full vocabulary, plus row_weight (N,) and batch
// (2,) for step 3. `class_weight` is the local slice of the class weights (it only says that the loss
// is weighted: the weights themselves travel in the statistics). `merge` is the core's merge of
// the logits form or of the linear form, called as (device, gathered, world, target, shard,
// options, out, row_weight, batch); `op` names it in errors.
template <class Ctx, class Merge>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> shard_merge(
    const Tensor& gathered, const Tensor& target, const OptTensor& class_weight, int64_t vocab_start,
    int64_t vocab_total, fusedce::Options o, bool return_metrics, const char* op, Merge&& merge) {
  Ctx ctx(gathered, "gathered");
  check_same_device(target, "target", gathered, "gathered");
  TORCH_CHECK_VALUE(gathered.dim() == 2 && gathered.size(1) == fusedce::kShardStatsWidth &&
                        gathered.scalar_type() == at::kFloat && gathered.is_contiguous(),
                    "fusedce: gathered must be a contiguous float32 (world * (N + 1), ",
                    fusedce::kShardStatsWidth, ") tensor, got ", gathered.scalar_type(), " of shape ",
                    gathered.sizes());
  TORCH_CHECK_VALUE(target.dim() == 1, "fusedce: target must be 1-D, got shape ", target.sizes());
  const int64_t n = target.size(0);
  TORCH_CHECK_VALUE(gathered.size(0) >= n + 1 && gathered.size(0) % (n + 1) == 0, "fusedce: gathered has ",
                    gathered.size(0), " rows, which is not world * (N + 1) for the target's N = ", n);
  o = with_class_weight(o, class_weight, "class_weight", gathered, "gathered");
  const LossOutputs outputs(gathered, n, o.reduction, return_metrics);
  const fusedce::ForwardOutputs out = outputs.views(return_metrics, &o);
  const auto f32 = gathered.options().dtype(at::kFloat);
  Tensor row_weight = at::empty({n}, f32);
  Tensor batch = at::empty({2}, f32);
  check_status(merge(ctx.device(),
                     fusedce::matrix(gathered.data_ptr(), fusedce::DType::kFloat32, gathered.size(0),
                                     fusedce::kShardStatsWidth),
                     gathered.size(0) / (n + 1), vector_of(target, "target"), shard_of(vocab_start, vocab_total), o,
                     out, vector_of(row_weight, "row_weight"), vector_of(batch, "batch")),
               op);
  return {outputs.loss, outputs.lse, outputs.num_correct, outputs.entropy_sum, row_weight, batch};
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ce_shard_merge(
    const Tensor& gathered, const Tensor& target, const OptTensor& class_weight, int64_t vocab_start,
    int64_t vocab_total, fusedce::Options o, bool return_metrics) {
  return shard_merge<Ctx>(gathered, target, class_weight, vocab_start, vocab_total, o, return_metrics,
                          "ce_shard_merge", fusedce::cross_entropy_shard_merge);
}

// Step 3: this rank's dlogits from the merged lse, row_weight and batch, for the upstream
// gradient grad_loss (float32; 0-D or (1,) for 'sum' / 'mean', (N,) for 'none').
template <class Ctx>
Tensor ce_shard_bwd(const Tensor& logits, const Tensor& target, const OptTensor& class_weight,
                    const Tensor& lse, const Tensor& row_weight, const Tensor& batch,
                    const Tensor& grad_loss, int64_t vocab_start, int64_t vocab_total, fusedce::Options o) {
  Ctx ctx(logits, "logits");
  const fusedce::MatrixView x = matrix_of(logits, "logits");
  check_inputs(logits, target);
  o = with_class_weight(o, class_weight, "class_weight", logits, "logits");
  check_same_device(lse, "lse", logits);
  check_same_device(row_weight, "row_weight", logits);
  check_same_device(batch, "batch", logits);
  check_same_device(grad_loss, "grad_loss", logits);
  Tensor dlogits = at::empty(logits.sizes(), logits.options());
  check_status(fusedce::cross_entropy_shard_backward(
                   ctx.device(), x, vector_of(target, "target"), shard_of(vocab_start, vocab_total), o,
                   vector_of(lse, "lse"), vector_of(row_weight, "row_weight"), vector_of(batch, "batch"),
                   vector_of(grad_loss, "grad_loss"), matrix_of(dlogits, "dlogits")),
               "ce_shard_bwd");
  return dlogits;
}

// ---- the linear form: its three steps over this rank's rows of the head ---------------------
// target: the global targets, unshifted; the linear options as lce_fwd takes them.

// Step 1 of the linear form: the statistics of hidden @ weight.T (+ bias) over this rank's
// V_local rows of the head, as ce_shard_stats gives them for those logits (which are never
// stored beyond one chunk).
template <class Ctx>
Tensor lce_shard_stats(const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& target,
                       const OptTensor& class_weight, int64_t vocab_start, int64_t vocab_total, fusedce::Options o,
                       int64_t shift_seq_len, int64_t chunk_budget_bytes, bool low_memory, bool skip_ignored,
                       bool return_metrics) {
  Ctx ctx(hidden, "hidden");
  check_hidden_2d(hidden);
  const fusedce::MatrixView h = linear_matrix_of(hidden, "hidden", "(N, H)");
  check_linear_inputs(hidden, weight, bias, target);
  const fusedce::MatrixView w = linear_matrix_of(weight, "weight", "(V_local, H)");
  o = with_class_weight(o, class_weight, "class_weight", hidden, "hidden");
  o.return_metrics = return_metrics;
  const fusedce::LinearOptions lo = linear_only_options(shift_seq_len, chunk_budget_bytes, low_memory, skip_ignored);
  Tensor stats = at::empty({hidden.size(0) + 1, fusedce::kShardStatsWidth}, hidden.options().dtype(at::kFloat));
  const size_t bytes = fusedce::linear_cross_entropy_shard_workspace_size(1, ctx.device(), h.rows, h.cols, w.rows,
                                                                          h.dtype, o, lo, {});
  const Tensor ws = at::empty({static_cast<int64_t>(bytes)}, hidden.options().dtype(at::kByte));
  const Tensor bias_c = contiguous_bias(bias);
  check_status(fusedce::linear_cross_entropy_shard_stats(
                   ctx.device(), h, w, bias_c.defined() ? vector_of(bias_c, "bias") : fusedce::VectorView{},
                   vector_of(target, "target"), shard_of(vocab_start, vocab_total), o, lo,
                   fusedce::matrix(stats.data_ptr(), fusedce::DType::kFloat32, stats.size(0), fusedce::kShardStatsWidth),
                   workspace_of(ws)),
               "lce_shard_stats");
  return stats;
}

// Step 2 of the linear form: ce_shard_merge over the effective (shifted) targets.
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lce_shard_merge(
    const Tensor& gathered, const Tensor& target, const OptTensor& class_weight, int64_t vocab_start,
    int64_t vocab_total, fusedce::Options o, int64_t shift_seq_len, int64_t chunk_budget_bytes, bool low_memory,
    bool skip_ignored, bool return_metrics) {
  const fusedce::LinearOptions lo = linear_only_options(shift_seq_len, chunk_budget_bytes, low_memory, skip_ignored);
  return shard_merge<Ctx>(
      gathered, target, class_weight, vocab_start, vocab_total, o, return_metrics, "lce_shard_merge",
      [&lo](const fusedce::Device& device, const fusedce::MatrixView& g, int64_t world, const fusedce::VectorView& t,
            const fusedce::ShardSpec& shard, const fusedce::Options& options, const fusedce::ForwardOutputs& out,
            const fusedce::VectorView& row_weight, const fusedce::VectorView& batch) {
        return fusedce::linear_cross_entropy_shard_merge(device, g, world, t, shard, options, lo, out, row_weight,
                                                         batch);
      });
}

// Step 3 of the linear form: this rank's part of grad_hidden (float32 (N, H): the sum over ranks
// is the gradient), and its slices of grad_weight (V_local, H) and grad_bias (V_local,) in the
// weight's dtype, from ce_shard_merge's lse, row_weight and batch and the upstream grad_loss.
// Gradients not asked for come back as empty (0,) tensors.
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> lce_shard_bwd(
    const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& target,
    const OptTensor& class_weight, const Tensor& lse, const Tensor& row_weight, const Tensor& batch,
    const Tensor& grad_loss, int64_t vocab_start, int64_t vocab_total, fusedce::Options o, int64_t shift_seq_len,
    int64_t chunk_budget_bytes, bool low_memory, bool skip_ignored, bool need_grad_hidden, bool need_grad_weight,
    bool need_grad_bias) {
  Ctx ctx(hidden, "hidden");
  check_hidden_2d(hidden);
  const fusedce::MatrixView h = linear_matrix_of(hidden, "hidden", "(N, H)");
  check_linear_inputs(hidden, weight, bias, target);
  const fusedce::MatrixView w = linear_matrix_of(weight, "weight", "(V_local, H)");
  TORCH_CHECK_VALUE(!need_grad_bias || bias.has_value(), "fusedce: need_grad_bias is set but bias is not given");
  o = with_class_weight(o, class_weight, "class_weight", hidden, "hidden");
  check_same_device(lse, "lse", hidden, "hidden");
  check_same_device(row_weight, "row_weight", hidden, "hidden");
  check_same_device(batch, "batch", hidden, "hidden");
  check_same_device(grad_loss, "grad_loss", hidden, "hidden");
  const fusedce::LinearOptions lo = linear_only_options(shift_seq_len, chunk_budget_bytes, low_memory, skip_ignored);
  auto none = [&] { return at::empty({0}, hidden.options()); };
  Tensor grad_hidden = need_grad_hidden ? at::empty(hidden.sizes(), hidden.options().dtype(at::kFloat)) : none();
  Tensor grad_weight = need_grad_weight ? at::empty(weight.sizes(), weight.options()) : none();
  Tensor grad_bias = need_grad_bias ? at::empty(bias->sizes(), bias->options()) : none();
  fusedce::LinearGrads grads;
  if (need_grad_hidden) grads.grad_hidden = matrix_of(grad_hidden, "grad_hidden");
  if (need_grad_weight) grads.grad_weight = matrix_of(grad_weight, "grad_weight");
  if (need_grad_bias) grads.grad_bias = vector_of(grad_bias, "grad_bias");
  const size_t bytes = fusedce::linear_cross_entropy_shard_workspace_size(3, ctx.device(), h.rows, h.cols, w.rows,
                                                                          h.dtype, o, lo, grads);
  const Tensor ws = at::empty({static_cast<int64_t>(bytes)}, hidden.options().dtype(at::kByte));
  const Tensor bias_c = contiguous_bias(bias);
  check_status(fusedce::linear_cross_entropy_shard_backward(
                   ctx.device(), h, w, bias_c.defined() ? vector_of(bias_c, "bias") : fusedce::VectorView{},
                   vector_of(target, "target"), shard_of(vocab_start, vocab_total), o, lo, vector_of(lse, "lse"),
                   vector_of(row_weight, "row_weight"), vector_of(batch, "batch"), vector_of(grad_loss, "grad_loss"),
                   grads, workspace_of(ws)),
               "lce_shard_bwd");
  return {grad_hidden, grad_weight, grad_bias};
}

}  // namespace fusedce_torch
