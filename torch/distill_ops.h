// The kernels behind the distillation torch ops (fusedce/distill.h): wrap tensors into the core's
// views, check what the core cannot see (devices, dimensions), call the forward or the backward.
// No arithmetic on tensor data here; the autograd lives in python/fusedce/distillation.py and
// the fake kernels in python/fusedce/distill_ops.py.
//
//   ld_fwd(hidden (N, H), weight (V, H), bias (V,)?, teacher_hidden (N, H_t), teacher_weight
//          (V, H_t), teacher_bias (V,)?, labels (N,)?, FUSEDCE_DISTILL_ARGS)
//       -> loss ((N,) for none, 0-D otherwise), divergence, hard, entropy (float32 (N,)),
//          stats (float32 (N, 4): what ld_bwd reads)
//   ld_bwd(the same inputs, stats, grad_loss, FUSEDCE_DISTILL_ARGS, need_grad_hidden,
//          need_grad_weight, need_grad_bias) -> grad_hidden (float32), grad_weight, grad_bias
//          (the student's dtype); empty (0,) when not asked for
//   ld_fwd_bwd(ld_fwd's inputs, need_grad_hidden, need_grad_weight, need_grad_bias) -> ld_fwd's
//          outputs, then ld_bwd's for an upstream gradient of 1 (reduction mean or sum), each
//          chunk's logits formed once for both
//   ldk_fwd / ldk_bwd / ldk_fwd_bwd: the same with the teacher as teacher_ids (N, K) int64 and
//          teacher_logprobs (N, K) float32 in place of its head.
// The vocabulary-parallel steps (distill.h; weights and biases this rank's rows, labels global;
// python/fusedce/distillation.py gathers between them):
//   ld_shard_stats(ld_fwd's inputs, vocab_start, vocab_total, FUSEDCE_DISTILL_ARGS)
//       -> stats (N + 1, 9) float32 (step 1)
//   ld_shard_parts(ld_fwd's inputs, gathered (every rank's stats in rank order), vocab_start,
//          vocab_total, FUSEDCE_DISTILL_ARGS) -> row_stats (N, 4), hard (N,), parts (N, 6)
//          (steps 2 and 3)
//   ld_shard_reduce(gathered (every rank's parts in rank order), row_stats, hard, labels,
//          FUSEDCE_DISTILL_ARGS) -> ld_fwd's outputs (step 4)
//   ld_shard_bwd(ld_bwd's inputs, vocab_start, vocab_total, FUSEDCE_DISTILL_ARGS, ...) -> ld_bwd's
//          outputs over this rank's rows, grad_hidden this rank's float32 part (step 5)
//   ldk_shard_stats / ldk_shard_parts / ldk_shard_bwd: the same with teacher_ids (N, K) (global
//          ids) and teacher_logprobs (N, K) in place of the teacher's head; parts (N, 6 + K);
//   ldk_shard_reduce(gathered, row_stats, hard, teacher_logprobs, labels, FUSEDCE_DISTILL_ARGS)
//          -> ld_fwd's outputs, stats (N, 4 + K): what ldk_shard_bwd reads
// Each op is a template over a device context `Ctx`, as in ops.h; registry.h lists them.
#pragma once

#include <fusedce/distill.h>

#include <tuple>

#include "linear_ops.h"
#include "ops.h"

// The options' schema text, in DistillOptions' order (python/fusedce/_distill_options.py holds
// the same names and a test compares them), then the chunk budget.
#define FUSEDCE_DISTILL_ARGS                                                                              \
  "float beta, float temperature, float hard_weight, int ignore_index, str reduction, "                   \
  "float student_logit_scale, float student_softcap, float teacher_logit_scale, float teacher_softcap, " \
  "str topk_norm, int chunk_budget_bytes"

// The ops' results after their arguments: the forward's, and the backward's flags and gradients.
#define FUSEDCE_DISTILL_OUT " -> (Tensor loss, Tensor divergence, Tensor hard, Tensor entropy, Tensor stats)"
#define FUSEDCE_DISTILL_GRADS                                                                \
  ", bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) -> (Tensor grad_hidden, " \
  "Tensor grad_weight, Tensor grad_bias)"
#define FUSEDCE_DISTILL_FWD_BWD_OUT                                                                       \
  ", bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) -> (Tensor loss, Tensor divergence, " \
  "Tensor hard, Tensor entropy, Tensor stats, Tensor grad_hidden, Tensor grad_weight, Tensor grad_bias)"

// The same arguments as a kernel takes them, and passed on.
#define FUSEDCE_DISTILL_PARAMS                                                                                   \
  double beta, double temperature, double hard_weight, int64_t ignore_index, c10::string_view reduction,         \
      double student_logit_scale, double student_softcap, double teacher_logit_scale, double teacher_softcap, \
      c10::string_view topk_norm, int64_t chunk_budget_bytes
#define FUSEDCE_DISTILL_PASS                                                                                    \
  beta, temperature, hard_weight, ignore_index, reduction, student_logit_scale, student_softcap, teacher_logit_scale, \
      teacher_softcap, topk_norm, chunk_budget_bytes

namespace fusedce_torch {

inline fusedce::TopkNorm topk_norm_of(c10::string_view n) {
  if (n == "none") return fusedce::TopkNorm::kNone;
  if (n == "renorm") return fusedce::TopkNorm::kRenorm;
  if (n == "tail") return fusedce::TopkNorm::kTail;
  TORCH_CHECK_VALUE(false, "fusedce: topk_norm must be 'none', 'renorm' or 'tail', got '", n, "'");
  return fusedce::TopkNorm::kNone;  // unreachable
}

inline fusedce::DistillOptions distill_options_of(FUSEDCE_DISTILL_PARAMS) {
  TORCH_CHECK_VALUE(chunk_budget_bytes >= 0, "fusedce: chunk_budget_bytes must be >= 0 (0 = default), got ",
                    chunk_budget_bytes);
  fusedce::DistillOptions o;
  o.beta = static_cast<float>(beta);
  o.temperature = static_cast<float>(temperature);
  o.hard_weight = static_cast<float>(hard_weight);
  o.ignore_index = ignore_index;
  o.reduction = reduction_of(reduction);
  o.student = fusedce::HeadTransform{static_cast<float>(student_logit_scale), static_cast<float>(student_softcap)};
  o.teacher = fusedce::HeadTransform{static_cast<float>(teacher_logit_scale), static_cast<float>(teacher_softcap)};
  o.topk_norm = topk_norm_of(topk_norm);
  return o;
}

// A (N, K) top-k matrix with unit stride along K, of dtype `want`.
inline fusedce::MatrixView topk_matrix_of(const Tensor& t, const char* name, at::ScalarType want,
                                          const Tensor& hidden) {
  check_same_device(t, name, hidden, "hidden");
  TORCH_CHECK_VALUE(t.dim() == 2 && t.scalar_type() == want && (t.size(1) <= 1 || t.stride(1) == 1), "fusedce: ",
                    name, " must be a 2-D (N, K) ", want, " tensor with unit stride along K, got ", t.scalar_type(),
                    " of shape ", t.sizes(), " and strides ", t.strides());
  const int64_t rows = t.size(0), cols = t.size(1);
  return fusedce::matrix(t.numel() > 0 ? const_cast<void*>(t.const_data_ptr()) : nullptr, dtype_of(t, name), rows,
                         cols, rows > 1 ? t.stride(0) : cols);
}

// The student's head and the labels (checked against hidden), as the core takes them.
struct StudentViews {
  fusedce::MatrixView hidden, weight;
  fusedce::VectorView bias, labels;
  Tensor bias_c;  // keeps a contiguous copy alive
};

inline StudentViews student_views(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                  const OptTensor& labels) {
  check_hidden_2d(hidden);
  StudentViews s;
  s.hidden = linear_matrix_of(hidden, "hidden", "(N, H)");
  check_same_device(weight, "weight", hidden, "hidden");
  check_on_hidden_device(bias, "bias", hidden);
  s.weight = linear_matrix_of(weight, "weight", "(V, H)");
  if (bias.has_value()) {
    TORCH_CHECK_VALUE(bias->dim() == 1, "fusedce: bias must be 1-D (V,), got shape ", bias->sizes());
    s.bias_c = bias->contiguous();
    s.bias = vector_of(s.bias_c, "bias");
  }
  if (labels.has_value()) {
    check_same_device(*labels, "labels", hidden, "hidden");
    TORCH_CHECK_VALUE(labels->scalar_type() == at::kLong || labels->scalar_type() == at::kInt,
                      "fusedce: labels must be int64 or int32 class indices, got ", labels->scalar_type());
    TORCH_CHECK_VALUE(labels->dim() == 1 && labels->size(0) == hidden.size(0),
                      "fusedce: labels must be 1-D with one entry per row of hidden (", hidden.size(0),
                      "), got shape ", labels->sizes());
    s.labels = vector_of(*labels, "labels");
  }
  return s;
}

// The teacher's head, as the core takes it.
inline fusedce::DistillTeacher teacher_head(const Tensor& hidden, const Tensor& teacher_hidden,
                                            const Tensor& teacher_weight, const OptTensor& teacher_bias,
                                            Tensor* bias_c) {
  check_same_device(teacher_hidden, "teacher_hidden", hidden, "hidden");
  check_same_device(teacher_weight, "teacher_weight", hidden, "hidden");
  check_on_hidden_device(teacher_bias, "teacher_bias", hidden);
  fusedce::DistillTeacher t;
  t.hidden = linear_matrix_of(teacher_hidden, "teacher_hidden", "(N, H_t)");
  t.weight = linear_matrix_of(teacher_weight, "teacher_weight", "(V, H_t)");
  if (teacher_bias.has_value()) {
    TORCH_CHECK_VALUE(teacher_bias->dim() == 1, "fusedce: teacher_bias must be 1-D (V,), got shape ",
                      teacher_bias->sizes());
    *bias_c = teacher_bias->contiguous();
    t.bias = vector_of(*bias_c, "teacher_bias");
  }
  return t;
}

inline fusedce::DistillTeacher teacher_topk(const Tensor& hidden, const Tensor& teacher_ids,
                                            const Tensor& teacher_logprobs) {
  fusedce::DistillTeacher t;
  t.topk_ids = topk_matrix_of(teacher_ids, "teacher_ids", at::kLong, hidden);
  t.topk_logprobs = topk_matrix_of(teacher_logprobs, "teacher_logprobs", at::kFloat, hidden);
  return t;
}

inline fusedce::MatrixView distill_stats_view(const Tensor& stats) {
  return fusedce::matrix(stats.numel() > 0 ? stats.data_ptr() : nullptr, fusedce::DType::kFloat32, stats.size(0),
                         stats.size(1));
}

/// A forward's outputs for n rows (loss, divergence, hard, entropy and the backward's float32
/// (n, stats_width) statistics) and the core's views of them; `hard` is zeros and unviewed
/// without a hard loss.
struct ForwardTensors {
  Tensor loss, divergence, hard, entropy, stats;
  fusedce::DistillOutputs views;
};

inline ForwardTensors forward_tensors(const Tensor& like, int64_t n, const fusedce::DistillOptions& o,
                                      int64_t stats_width) {
  const auto f32 = like.options().dtype(at::kFloat);
  ForwardTensors t;
  t.loss = o.reduction == fusedce::Reduction::kNone ? at::empty({n}, f32) : at::empty({}, f32);
  t.divergence = at::empty({n}, f32);
  t.hard = at::zeros({n}, f32);
  t.entropy = at::empty({n}, f32);
  t.stats = at::empty({n, stats_width}, f32);
  t.views.loss = vector_of(t.loss, "loss");
  t.views.divergence = vector_of(t.divergence, "divergence");
  if (o.hard_weight > 0.0f) t.views.hard = vector_of(t.hard, "hard");
  t.views.entropy = vector_of(t.entropy, "entropy");
  t.views.stats = distill_stats_view(t.stats);
  return t;
}

/// The workspace of a call (torch's allocator: the caching allocator on CUDA, so the chunk
/// buffers count in torch's memory statistics and come from its pool), held by *holder; empty
/// where the call needs none (the CPU).
template <class Ctx>
fusedce::Workspace distill_workspace(fusedce::DistillJob job, Ctx& ctx, const Tensor& hidden,
                                     const StudentViews& s, const fusedce::DistillTeacher& teacher,
                                     const fusedce::DistillOptions& o, int64_t chunk_budget_bytes,
                                     const fusedce::LinearGrads& grads, Tensor* holder) {
  const size_t bytes = fusedce::linear_distill_workspace_size(job, ctx.device(), s.hidden, s.weight, teacher, o,
                                                              static_cast<size_t>(chunk_budget_bytes), grads);
  if (bytes == 0) return {};
  *holder = at::empty({static_cast<int64_t>(bytes)}, hidden.options().dtype(at::kByte));
  return workspace_of(*holder);
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> distill_forward(const Tensor& hidden, const Tensor& weight,
                                                                   const OptTensor& bias,
                                                                   const fusedce::DistillTeacher& teacher,
                                                                   const OptTensor& labels, FUSEDCE_DISTILL_PARAMS,
                                                                   const char* op) {
  Ctx ctx(hidden, "hidden");
  const StudentViews s = student_views(hidden, weight, bias, labels);
  const fusedce::DistillOptions o = distill_options_of(FUSEDCE_DISTILL_PASS);
  const ForwardTensors f = forward_tensors(hidden, hidden.size(0), o, fusedce::kDistillStatsWidth);
  Tensor ws;
  const fusedce::Workspace w =
      distill_workspace(fusedce::DistillJob::kForward, ctx, hidden, s, teacher, o, chunk_budget_bytes, {}, &ws);
  check_status(fusedce::linear_distill_forward(ctx.device(), s.hidden, s.weight, s.bias, teacher, s.labels, o,
                                               static_cast<size_t>(chunk_budget_bytes), f.views, w),
               op);
  return {f.loss, f.divergence, f.hard, f.entropy, f.stats};
}

/// The gradients a backward forms, each an empty (0,) tensor where not asked for.
struct GradTensors {
  Tensor grad_hidden, grad_weight, grad_bias;
  fusedce::LinearGrads views;
};

inline GradTensors grad_tensors(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) {
  TORCH_CHECK_VALUE(!need_grad_bias || bias.has_value(), "fusedce: need_grad_bias is set but bias is not given");
  auto none = [&] { return at::empty({0}, hidden.options()); };
  GradTensors g;
  g.grad_hidden = need_grad_hidden ? at::empty(hidden.sizes(), hidden.options().dtype(at::kFloat)) : none();
  g.grad_weight = need_grad_weight ? at::empty(weight.sizes(), weight.options()) : none();
  g.grad_bias = need_grad_bias ? at::empty(bias->sizes(), bias->options()) : none();
  if (need_grad_hidden) g.views.grad_hidden = matrix_of(g.grad_hidden, "grad_hidden");
  if (need_grad_weight) g.views.grad_weight = matrix_of(g.grad_weight, "grad_weight");
  if (need_grad_bias) g.views.grad_bias = vector_of(g.grad_bias, "grad_bias");
  return g;
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> distill_backward(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                                    const fusedce::DistillTeacher& teacher, const OptTensor& labels,
                                                    const Tensor& stats, const Tensor& grad_loss,
                                                    FUSEDCE_DISTILL_PARAMS, bool need_grad_hidden,
                                                    bool need_grad_weight, bool need_grad_bias, const char* op) {
  Ctx ctx(hidden, "hidden");
  const StudentViews s = student_views(hidden, weight, bias, labels);
  const fusedce::DistillOptions o = distill_options_of(FUSEDCE_DISTILL_PASS);
  check_same_device(stats, "stats", hidden, "hidden");
  check_same_device(grad_loss, "grad_loss", hidden, "hidden");
  TORCH_CHECK_VALUE(stats.dim() == 2 && stats.size(1) == fusedce::kDistillStatsWidth &&
                        stats.scalar_type() == at::kFloat && stats.is_contiguous(),
                    "fusedce: stats must be a contiguous float32 (N, ", fusedce::kDistillStatsWidth,
                    ") tensor, got ", stats.scalar_type(), " of shape ", stats.sizes());
  const GradTensors g = grad_tensors(hidden, weight, bias, need_grad_hidden, need_grad_weight, need_grad_bias);
  Tensor ws;
  const fusedce::Workspace w = distill_workspace(fusedce::DistillJob::kBackward, ctx, hidden, s, teacher, o,
                                                 chunk_budget_bytes, g.views, &ws);
  check_status(fusedce::linear_distill_backward(ctx.device(), s.hidden, s.weight, s.bias, teacher, s.labels, o,
                                                static_cast<size_t>(chunk_budget_bytes), distill_stats_view(stats),
                                                vector_of(grad_loss, "grad_loss"), g.views, w),
               op);
  return {g.grad_hidden, g.grad_weight, g.grad_bias};
}

// The forward and the gradients of the reduced loss for an upstream gradient of 1 (reduction
// mean or sum), in one core call: the forward's outputs, then the gradients asked for.
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> distill_forward_backward(
    const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const fusedce::DistillTeacher& teacher,
    const OptTensor& labels, FUSEDCE_DISTILL_PARAMS, bool need_grad_hidden, bool need_grad_weight,
    bool need_grad_bias, const char* op) {
  Ctx ctx(hidden, "hidden");
  const StudentViews s = student_views(hidden, weight, bias, labels);
  const fusedce::DistillOptions o = distill_options_of(FUSEDCE_DISTILL_PASS);
  const ForwardTensors f = forward_tensors(hidden, hidden.size(0), o, fusedce::kDistillStatsWidth);
  const GradTensors g = grad_tensors(hidden, weight, bias, need_grad_hidden, need_grad_weight, need_grad_bias);
  Tensor ws;
  const fusedce::Workspace w = distill_workspace(fusedce::DistillJob::kForwardBackward, ctx, hidden, s, teacher, o,
                                                 chunk_budget_bytes, g.views, &ws);
  check_status(fusedce::linear_distill_forward_backward(ctx.device(), s.hidden, s.weight, s.bias, teacher, s.labels,
                                                        o, static_cast<size_t>(chunk_budget_bytes), f.views, g.views,
                                                        w),
               op);
  return {f.loss, f.divergence, f.hard, f.entropy, f.stats, g.grad_hidden, g.grad_weight, g.grad_bias};
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ld_fwd_bwd(
    const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& teacher_hidden,
    const Tensor& teacher_weight, const OptTensor& teacher_bias, const OptTensor& labels, FUSEDCE_DISTILL_PARAMS,
    bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) {
  Tensor tb;
  const fusedce::DistillTeacher t = teacher_head(hidden, teacher_hidden, teacher_weight, teacher_bias, &tb);
  return distill_forward_backward<Ctx>(hidden, weight, bias, t, labels, FUSEDCE_DISTILL_PASS, need_grad_hidden,
                                       need_grad_weight, need_grad_bias, "ld_fwd_bwd");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ldk_fwd_bwd(
    const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& teacher_ids,
    const Tensor& teacher_logprobs, const OptTensor& labels, FUSEDCE_DISTILL_PARAMS, bool need_grad_hidden,
    bool need_grad_weight, bool need_grad_bias) {
  const fusedce::DistillTeacher t = teacher_topk(hidden, teacher_ids, teacher_logprobs);
  return distill_forward_backward<Ctx>(hidden, weight, bias, t, labels, FUSEDCE_DISTILL_PASS, need_grad_hidden,
                                       need_grad_weight, need_grad_bias, "ldk_fwd_bwd");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> ld_fwd(const Tensor& hidden, const Tensor& weight,
                                                          const OptTensor& bias, const Tensor& teacher_hidden,
                                                          const Tensor& teacher_weight, const OptTensor& teacher_bias,
                                                          const OptTensor& labels, FUSEDCE_DISTILL_PARAMS) {
  Tensor tb;
  const fusedce::DistillTeacher t = teacher_head(hidden, teacher_hidden, teacher_weight, teacher_bias, &tb);
  return distill_forward<Ctx>(hidden, weight, bias, t, labels, FUSEDCE_DISTILL_PASS, "ld_fwd");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> ld_bwd(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                          const Tensor& teacher_hidden, const Tensor& teacher_weight,
                                          const OptTensor& teacher_bias, const OptTensor& labels, const Tensor& stats,
                                          const Tensor& grad_loss, FUSEDCE_DISTILL_PARAMS, bool need_grad_hidden,
                                          bool need_grad_weight, bool need_grad_bias) {
  Tensor tb;
  const fusedce::DistillTeacher t = teacher_head(hidden, teacher_hidden, teacher_weight, teacher_bias, &tb);
  return distill_backward<Ctx>(hidden, weight, bias, t, labels, stats, grad_loss, FUSEDCE_DISTILL_PASS,
                               need_grad_hidden, need_grad_weight, need_grad_bias, "ld_bwd");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> ldk_fwd(const Tensor& hidden, const Tensor& weight,
                                                           const OptTensor& bias, const Tensor& teacher_ids,
                                                           const Tensor& teacher_logprobs, const OptTensor& labels,
                                                           FUSEDCE_DISTILL_PARAMS) {
  const fusedce::DistillTeacher t = teacher_topk(hidden, teacher_ids, teacher_logprobs);
  return distill_forward<Ctx>(hidden, weight, bias, t, labels, FUSEDCE_DISTILL_PASS, "ldk_fwd");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> ldk_bwd(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                           const Tensor& teacher_ids, const Tensor& teacher_logprobs,
                                           const OptTensor& labels, const Tensor& stats, const Tensor& grad_loss,
                                           FUSEDCE_DISTILL_PARAMS, bool need_grad_hidden, bool need_grad_weight,
                                           bool need_grad_bias) {
  const fusedce::DistillTeacher t = teacher_topk(hidden, teacher_ids, teacher_logprobs);
  return distill_backward<Ctx>(hidden, weight, bias, t, labels, stats, grad_loss, FUSEDCE_DISTILL_PASS,
                               need_grad_hidden, need_grad_weight, need_grad_bias, "ldk_bwd");
}

// ---- the vocabulary-parallel steps ---------------------------------------------------------

inline fusedce::MatrixView float_block_view(const Tensor& t, const char* name, int64_t cols, const Tensor& hidden) {
  check_same_device(t, name, hidden, "hidden");
  TORCH_CHECK_VALUE(t.dim() == 2 && t.size(1) == cols && t.scalar_type() == at::kFloat && t.is_contiguous(),
                    "fusedce: ", name, " must be a contiguous float32 (rows, ", cols, ") tensor, got ",
                    t.scalar_type(), " of shape ", t.sizes());
  return fusedce::matrix(t.numel() > 0 ? const_cast<void*>(t.const_data_ptr()) : nullptr, fusedce::DType::kFloat32,
                         t.size(0), cols);
}

// The ranks in a gathered block of `rows` rows of `per_rank` rows each.
inline int64_t world_of(const Tensor& gathered, int64_t per_rank, const char* name) {
  if (per_rank == 0) return 1;
  TORCH_CHECK_VALUE(gathered.size(0) >= per_rank && gathered.size(0) % per_rank == 0, "fusedce: ", name, " has ",
                    gathered.size(0), " rows, which is not a whole number of ranks of ", per_rank, " rows");
  return gathered.size(0) / per_rank;
}

// The steps over a teacher `t`: a head (k 0) or k >= 1 top-k entries; `op` names the op.
template <class Ctx>
Tensor shard_stats_of(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                      const fusedce::DistillTeacher& t, const OptTensor& labels, int64_t vocab_start,
                      int64_t vocab_total, const fusedce::DistillOptions& o, int64_t chunk_budget_bytes, const char* op) {
  Ctx ctx(hidden, "hidden");
  const StudentViews s = student_views(hidden, weight, bias, labels);
  Tensor stats = at::empty({hidden.size(0) + 1, fusedce::kDistillShardStatsWidth}, hidden.options().dtype(at::kFloat));
  Tensor ws;
  const fusedce::Workspace w =
      distill_workspace(fusedce::DistillJob::kShardStats, ctx, hidden, s, t, o, chunk_budget_bytes, {}, &ws);
  check_status(fusedce::linear_distill_shard_stats(
                   ctx.device(), s.hidden, s.weight, s.bias, t, s.labels, fusedce::ShardSpec{vocab_start, vocab_total},
                   o, static_cast<size_t>(chunk_budget_bytes),
                   float_block_view(stats, "stats", fusedce::kDistillShardStatsWidth, hidden), w),
               op);
  return stats;
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> shard_parts_of(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                                  const fusedce::DistillTeacher& t, int64_t k, const OptTensor& labels,
                                                  const Tensor& gathered, int64_t vocab_start, int64_t vocab_total,
                                                  const fusedce::DistillOptions& o, int64_t chunk_budget_bytes,
                                                  const char* op) {
  Ctx ctx(hidden, "hidden");
  const StudentViews s = student_views(hidden, weight, bias, labels);
  const int64_t n = hidden.size(0), width = fusedce::distill_shard_parts_width(k);
  const fusedce::MatrixView g = float_block_view(gathered, "gathered", fusedce::kDistillShardStatsWidth, hidden);
  const auto f32 = hidden.options().dtype(at::kFloat);
  Tensor row_stats = at::empty({n, fusedce::kDistillStatsWidth}, f32), hard = at::empty({n}, f32),
         parts = at::empty({n, width}, f32);
  const fusedce::MatrixView rs = float_block_view(row_stats, "row_stats", fusedce::kDistillStatsWidth, hidden);
  check_status(fusedce::linear_distill_shard_merge(ctx.device(), g, world_of(gathered, n + 1, "gathered"), s.labels,
                                                   o, rs, vector_of(hard, "hard")),
               op);
  Tensor ws;
  const fusedce::Workspace w =
      distill_workspace(fusedce::DistillJob::kShardParts, ctx, hidden, s, t, o, chunk_budget_bytes, {}, &ws);
  check_status(fusedce::linear_distill_shard_parts(ctx.device(), s.hidden, s.weight, s.bias, t, s.labels,
                                                   fusedce::ShardSpec{vocab_start, vocab_total}, o,
                                                   static_cast<size_t>(chunk_budget_bytes), rs,
                                                   float_block_view(parts, "parts", width, hidden), w),
               op);
  return {row_stats, hard, parts};
}

// Step 4; teacher_logprobs: the top-k form's (N, K), or none for a teacher head.
template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> shard_reduce_of(const Tensor& gathered, const Tensor& row_stats,
                                                                   const Tensor& hard, const OptTensor& teacher_logprobs,
                                                                   const OptTensor& labels,
                                                                   const fusedce::DistillOptions& o, const char* op) {
  Ctx ctx(row_stats, "row_stats");
  const int64_t n = row_stats.size(0);
  fusedce::MatrixView tlp;
  if (teacher_logprobs.has_value()) tlp = topk_matrix_of(*teacher_logprobs, "teacher_logprobs", at::kFloat, row_stats);
  const int64_t k = teacher_logprobs.has_value() ? teacher_logprobs->size(1) : 0;
  const fusedce::MatrixView g =
      float_block_view(gathered, "gathered", fusedce::distill_shard_parts_width(k), row_stats);
  const fusedce::MatrixView rs = float_block_view(row_stats, "row_stats", fusedce::kDistillStatsWidth, row_stats);
  check_same_device(hard, "hard", row_stats, "row_stats");
  TORCH_CHECK_VALUE(hard.dim() == 1 && hard.size(0) == n && hard.scalar_type() == at::kFloat,
                    "fusedce: hard must be float32 (N,) with N = ", n, ", got ", hard.scalar_type(), " of shape ",
                    hard.sizes());
  fusedce::VectorView lv;
  if (labels.has_value()) {
    check_same_device(*labels, "labels", row_stats, "row_stats");
    TORCH_CHECK_VALUE(labels->dim() == 1 && labels->size(0) == n, "fusedce: labels must be 1-D with ", n,
                      " entries, got shape ", labels->sizes());
    lv = vector_of(*labels, "labels");
  }
  const int64_t sw = k > 0 ? fusedce::distill_shard_stats_width(k) : fusedce::kDistillStatsWidth;
  const ForwardTensors f = forward_tensors(row_stats, n, o, sw);
  const int64_t world = world_of(gathered, n, "gathered");
  check_status(k > 0 ? fusedce::linear_distill_topk_shard_reduce(ctx.device(), g, world, tlp, lv, o, rs,
                                                                 vector_of(hard, "hard"), f.views)
                     : fusedce::linear_distill_shard_reduce(ctx.device(), g, world, lv, o, rs, vector_of(hard, "hard"),
                                                            f.views),
               op);
  return {f.loss, f.divergence, f.hard, f.entropy, f.stats};
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> shard_bwd_of(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                                const fusedce::DistillTeacher& t, int64_t k, const OptTensor& labels,
                                                const Tensor& stats, const Tensor& grad_loss, int64_t vocab_start,
                                                int64_t vocab_total, const fusedce::DistillOptions& o,
                                                int64_t chunk_budget_bytes, bool need_grad_hidden,
                                                bool need_grad_weight, bool need_grad_bias, const char* op) {
  Ctx ctx(hidden, "hidden");
  const StudentViews s = student_views(hidden, weight, bias, labels);
  check_same_device(grad_loss, "grad_loss", hidden, "hidden");
  const int64_t sw = k > 0 ? fusedce::distill_shard_stats_width(k) : fusedce::kDistillStatsWidth;
  const fusedce::MatrixView st = float_block_view(stats, "stats", sw, hidden);
  const GradTensors g = grad_tensors(hidden, weight, bias, need_grad_hidden, need_grad_weight, need_grad_bias);
  Tensor ws;
  const fusedce::Workspace w =
      distill_workspace(fusedce::DistillJob::kShardBackward, ctx, hidden, s, t, o, chunk_budget_bytes, g.views, &ws);
  check_status(fusedce::linear_distill_shard_backward(
                   ctx.device(), s.hidden, s.weight, s.bias, t, s.labels, fusedce::ShardSpec{vocab_start, vocab_total},
                   o, static_cast<size_t>(chunk_budget_bytes), st, vector_of(grad_loss, "grad_loss"), g.views, w),
               op);
  return {g.grad_hidden, g.grad_weight, g.grad_bias};
}

// ld_shard_*: a teacher head.
template <class Ctx>
Tensor ld_shard_stats(const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& teacher_hidden,
                      const Tensor& teacher_weight, const OptTensor& teacher_bias, const OptTensor& labels,
                      int64_t vocab_start, int64_t vocab_total, FUSEDCE_DISTILL_PARAMS) {
  Tensor tb;
  const fusedce::DistillTeacher t = teacher_head(hidden, teacher_hidden, teacher_weight, teacher_bias, &tb);
  return shard_stats_of<Ctx>(hidden, weight, bias, t, labels, vocab_start, vocab_total,
                             distill_options_of(FUSEDCE_DISTILL_PASS), chunk_budget_bytes, "ld_shard_stats");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> ld_shard_parts(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                                  const Tensor& teacher_hidden, const Tensor& teacher_weight,
                                                  const OptTensor& teacher_bias, const OptTensor& labels,
                                                  const Tensor& gathered, int64_t vocab_start, int64_t vocab_total,
                                                  FUSEDCE_DISTILL_PARAMS) {
  Tensor tb;
  const fusedce::DistillTeacher t = teacher_head(hidden, teacher_hidden, teacher_weight, teacher_bias, &tb);
  return shard_parts_of<Ctx>(hidden, weight, bias, t, 0, labels, gathered, vocab_start, vocab_total,
                             distill_options_of(FUSEDCE_DISTILL_PASS), chunk_budget_bytes, "ld_shard_parts");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> ld_shard_reduce(const Tensor& gathered, const Tensor& row_stats,
                                                                   const Tensor& hard, const OptTensor& labels,
                                                                   FUSEDCE_DISTILL_PARAMS) {
  return shard_reduce_of<Ctx>(gathered, row_stats, hard, c10::nullopt, labels,
                              distill_options_of(FUSEDCE_DISTILL_PASS), "ld_shard_reduce");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> ld_shard_bwd(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                                const Tensor& teacher_hidden, const Tensor& teacher_weight,
                                                const OptTensor& teacher_bias, const OptTensor& labels,
                                                const Tensor& stats, const Tensor& grad_loss, int64_t vocab_start,
                                                int64_t vocab_total, FUSEDCE_DISTILL_PARAMS, bool need_grad_hidden,
                                                bool need_grad_weight, bool need_grad_bias) {
  Tensor tb;
  const fusedce::DistillTeacher t = teacher_head(hidden, teacher_hidden, teacher_weight, teacher_bias, &tb);
  return shard_bwd_of<Ctx>(hidden, weight, bias, t, 0, labels, stats, grad_loss, vocab_start, vocab_total,
                           distill_options_of(FUSEDCE_DISTILL_PASS), chunk_budget_bytes, need_grad_hidden,
                           need_grad_weight, need_grad_bias, "ld_shard_bwd");
}

// ldk_shard_*: the teacher's top-k, ids global.
template <class Ctx>
Tensor ldk_shard_stats(const Tensor& hidden, const Tensor& weight, const OptTensor& bias, const Tensor& teacher_ids,
                       const Tensor& teacher_logprobs, const OptTensor& labels, int64_t vocab_start,
                       int64_t vocab_total, FUSEDCE_DISTILL_PARAMS) {
  const fusedce::DistillTeacher t = teacher_topk(hidden, teacher_ids, teacher_logprobs);
  return shard_stats_of<Ctx>(hidden, weight, bias, t, labels, vocab_start, vocab_total,
                             distill_options_of(FUSEDCE_DISTILL_PASS), chunk_budget_bytes, "ldk_shard_stats");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> ldk_shard_parts(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                                   const Tensor& teacher_ids, const Tensor& teacher_logprobs,
                                                   const OptTensor& labels, const Tensor& gathered,
                                                   int64_t vocab_start, int64_t vocab_total, FUSEDCE_DISTILL_PARAMS) {
  const fusedce::DistillTeacher t = teacher_topk(hidden, teacher_ids, teacher_logprobs);
  return shard_parts_of<Ctx>(hidden, weight, bias, t, teacher_ids.size(1), labels, gathered, vocab_start,
                             vocab_total, distill_options_of(FUSEDCE_DISTILL_PASS), chunk_budget_bytes,
                             "ldk_shard_parts");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> ldk_shard_reduce(const Tensor& gathered, const Tensor& row_stats,
                                                                    const Tensor& hard, const Tensor& teacher_logprobs,
                                                                    const OptTensor& labels, FUSEDCE_DISTILL_PARAMS) {
  return shard_reduce_of<Ctx>(gathered, row_stats, hard, teacher_logprobs, labels,
                              distill_options_of(FUSEDCE_DISTILL_PASS), "ldk_shard_reduce");
}

template <class Ctx>
std::tuple<Tensor, Tensor, Tensor> ldk_shard_bwd(const Tensor& hidden, const Tensor& weight, const OptTensor& bias,
                                                 const Tensor& teacher_ids, const Tensor& teacher_logprobs,
                                                 const OptTensor& labels, const Tensor& stats, const Tensor& grad_loss,
                                                 int64_t vocab_start, int64_t vocab_total, FUSEDCE_DISTILL_PARAMS,
                                                 bool need_grad_hidden, bool need_grad_weight, bool need_grad_bias) {
  const fusedce::DistillTeacher t = teacher_topk(hidden, teacher_ids, teacher_logprobs);
  return shard_bwd_of<Ctx>(hidden, weight, bias, t, teacher_ids.size(1), labels, stats, grad_loss, vocab_start,
                           vocab_total, distill_options_of(FUSEDCE_DISTILL_PASS), chunk_budget_bytes,
                           need_grad_hidden, need_grad_weight, need_grad_bias, "ldk_shard_bwd");
}

}  // namespace fusedce_torch
