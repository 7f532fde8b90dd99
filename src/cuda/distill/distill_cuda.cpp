// The CUDA backend of the fused linear distillation (fusedce/distill.h). The rows go in token
// chunks; per chunk the products run through cuBLASLt (cuda/linear/gemm.h) into one workspace
// and the row kernels of distill_kernels.cu run on what they wrote:
//   forward, per chunk: the student's logits (rows, V) = hidden_chunk . weight^T (+ bias) and,
//     full form, the teacher's from its own head, each in its input dtype with float32
//     accumulation; the row kernel writes the per-row outputs, the statistics and each row's
//     loss; after the last chunk one block reduces the rows' losses in row order.
//   backward, per chunk: the student's logits again (and the teacher's, unless hard_weight is 1),
//     turned into dlogits in place by the row kernel; then grad_hidden (float32) = dlogits .
//     weight, grad_weight (+)= dlogits^T . hidden in the weight's dtype (each chunk's product
//     adds the sum so far in float32 and rounds once: a 16-bit weight's gradient is rounded once
//     a chunk, as many times as there are chunks) and grad_bias (+)= dlogits^T . ones (float32,
//     rounded once).
//   forward and backward together (upstream gradient 1, reduction mean or sum), per chunk: the
//     logits once, the forward's row kernel, then the backward's on the same buffers (it reads
//     the rows' statistics the forward kernel just wrote) and the gradient products: the
//     backward's two logits products saved. The mean's count of rows is formed first.
// Every row goes through the products (no compaction, which would need the count on the host);
// an ignored row's dlogits are zeros. The workspace (the caller's, or stream-ordered scratch)
// holds the chunk of each head's logits and, for the top-k backward, (K floats twice + Kp sort
// keys) per chunk row; chunk_budget_bytes bounds those bytes (0: default_distill_budget, which
// keeps the extra memory beyond the gradients within the larger of 512 MiB and one copy of the
// student's weight, plus the cuBLASLt workspace and the per-row vectors: a float32 grad_weight
// accumulator over the chunks would add twice that).
// FLOPs: 2 N V (H + H_t) forward (the top-k form: 2 N V H), 2 N V (H + H_t) + 4 N V H backward.
// No host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>

#include "common/distill_call.h"
#include "common/distill_math.h"
#include "cuda/distill/distill_kernels.h"
#include "cuda/host_util.h"
#include "cuda/linear/gemm.h"
#include "cuda/linear/head_ops.h"
#include "cuda/linear/linear.h"

namespace fusedce {
namespace cuda {
namespace {

#define FUSEDCE_TRY(expr)    \
  do {                       \
    Status s_ = (expr);      \
    if (!s_.ok()) return s_; \
  } while (0)

int64_t round_up(int64_t n, int64_t q) { return (n + q - 1) / q * q; }

/// Least default bytes of logit chunks (with the cuBLASLt workspace and the per-row vectors,
/// at most 64 MiB beside them, 512 MiB in all).
constexpr size_t kLeastDistillBudget = size_t(448) << 20;

/// The default logit-chunk bytes: the larger of kLeastDistillBudget and one copy of the
/// student's (V, H) weight in its dtype. The whole copy, not less the overhead: two heads of the
/// same vocabulary in 16 bits then fit H / 2 rows a chunk (2048 at H 4096), whole tiles of the
/// products, where a budget a little smaller leaves chunks of 13 tiles whose grad_hidden product
/// (R x H outputs summed over V) fills its last wave of tiles poorly.
size_t default_distill_budget(int64_t V, int64_t H, DType dtype) {
  return std::max(kLeastDistillBudget, size_t(V) * size_t(H) * elem_size(dtype));
}

/// The call's layout in the workspace and its token chunks; fixed by the arguments alone.
struct Plan {
  int64_t N, H, H_t, V, K, Kp;
  DType dtype, t_dtype;
  bool topk, backward, teacher_logits;  // backward: the backward's buffers (the backward, or both)
  int64_t ld, ld_t;  // row strides of the logit chunks: V rounded up to 16 bytes
  int64_t rows;      // token rows per chunk
  size_t gemm_ws, logits, t_logits, ones, gb, row_loss, count, entry_y, entry_g, keys, unit, total;
};

Plan plan_of(const detail::DistillCall& c) {
  Plan p{};
  p.N = c.hidden.rows;
  p.H = c.hidden.cols;
  p.V = c.weight.rows;
  p.dtype = c.hidden.dtype;
  p.topk = c.teacher.topk();
  p.backward = c.backward || c.fused;
  const bool forward = !c.backward;  // the forward, alone or with the backward
  p.K = p.topk ? c.teacher.topk_ids.cols : 0;
  p.Kp = 1;
  while (p.Kp < p.K) p.Kp <<= 1;
  p.H_t = p.topk ? 0 : c.teacher.hidden.cols;
  p.t_dtype = p.topk ? p.dtype : c.teacher.hidden.dtype;
  // the backward needs the teacher's logits only where the divergence has a weight
  p.teacher_logits = !p.topk && (forward || c.options.hard_weight < 1.0f);
  const size_t el = elem_size(p.dtype), el_t = elem_size(p.t_dtype);
  p.ld = round_up(p.V, static_cast<int64_t>(16 / el));
  p.ld_t = round_up(p.V, static_cast<int64_t>(16 / el_t));
  const bool topk_scratch = p.topk && p.backward;
  const size_t row_bytes = size_t(p.ld) * el + (p.teacher_logits ? size_t(p.ld_t) * el_t : 0) +
                           (topk_scratch ? size_t(p.K) * 8 + size_t(p.Kp) * 8 : 0);
  const size_t budget = c.chunk_budget_bytes > 0 ? c.chunk_budget_bytes : default_distill_budget(p.V, p.H, p.dtype);
  const int64_t cap = std::max<int64_t>(1, static_cast<int64_t>(budget / row_bytes));
  // as few chunks as fit, of even size in whole 128-row tiles for the products where the cap
  // allows (no thin remainder)
  p.rows = cap >= 256 ? balanced_rows(std::max<int64_t>(p.N, 1), cap / 128 * 128)
                      : std::min<int64_t>(cap, std::max<int64_t>(p.N, 1));
  const bool want_gb = p.backward && c.grads.grad_bias.data != nullptr;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(std::max<size_t>(bytes, 1));
    return here;
  };
  p.gemm_ws = take(kGemmWorkspaceBytes);
  p.logits = take(size_t(p.rows) * size_t(p.ld) * el);
  p.t_logits = p.teacher_logits ? take(size_t(p.rows) * size_t(p.ld_t) * el_t) : 0;
  p.ones = want_gb ? take(size_t(p.rows) * el) : 0;
  p.gb = want_gb ? take(size_t(p.V) * 4) : 0;
  p.row_loss = forward ? take(size_t(std::max<int64_t>(p.N, 1)) * 4) : 0;
  p.count = take(sizeof(int64_t));
  p.entry_y = topk_scratch ? take(size_t(p.rows) * size_t(p.K) * 4) : 0;
  p.entry_g = topk_scratch ? take(size_t(p.rows) * size_t(p.K) * 4) : 0;
  p.keys = topk_scratch ? take(size_t(p.rows) * size_t(p.Kp) * 8) : 0;
  p.unit = c.fused ? take(sizeof(float)) : 0;  // the upstream gradient 1 of the fused call
  p.total = at;
  return p;
}

DistillRows rows_of(const detail::DistillCall& c) {
  const DistillOptions& o = c.options;
  DistillRows r{};
  r.labels = c.labels.data;
  r.label_stride = c.labels.stride;
  r.labels_i64 = c.labels.dtype == DType::kInt64;
  r.ignore_index = o.ignore_index;
  r.V = c.weight.rows;
  r.v0 = c.vocab_start();
  r.v_total = c.vocab_total();
  r.kind = static_cast<int>(detail::divergence_kind(o.beta));
  r.beta = o.beta;
  r.one_mb = 1.0f - o.beta;
  r.log_1mb = std::log(1.0f - o.beta);
  r.log_b = std::log(o.beta);
  r.inv_t = 1.0f / o.temperature;
  r.hard_weight = o.hard_weight;
  r.s_scale = o.student.logit_scale;
  r.s_softcap = o.student.softcap;
  r.t_scale = o.teacher.logit_scale;
  r.t_softcap = o.teacher.softcap;
  r.topk_norm = static_cast<int>(o.topk_norm);
  return r;
}

/// The forward's row-kernel outputs of the call (row losses into `row_loss` unless reduction
/// none writes them to the loss itself); the logits pointers are the caller's.
DistillForwardParams outputs_of(const detail::DistillCall& c, float* row_loss, int64_t stats_width) {
  const DistillOutputs& o = c.out;
  const bool none = c.options.reduction == Reduction::kNone;
  DistillForwardParams f{};
  f.r = rows_of(c);
  f.stats = static_cast<float*>(o.stats.data);
  f.stats_width = stats_width;
  f.row_loss = none ? static_cast<float*>(o.loss.data) : row_loss;
  f.row_loss_stride = none ? o.loss.stride : 1;
  f.divergence = static_cast<float*>(o.divergence.data);
  f.divergence_stride = o.divergence.stride;
  f.hard = static_cast<float*>(o.hard.data);
  f.hard_stride = o.hard.stride;
  f.entropy = static_cast<float*>(o.entropy.data);
  f.entropy_stride = o.entropy.stride;
  return f;
}

/// The reduced loss of a forward from its rows' losses (reduction mean or sum: one block, in
/// row order); `count` receives the rows counted.
Status finish_loss(const detail::DistillCall& c, int64_t N, const float* row_loss, int64_t* count,
                   cudaStream_t stream) {
  if (c.options.reduction == Reduction::kNone) return Status::Ok();
  DistillFinishParams fin{};
  fin.r = rows_of(c);
  fin.N = N;
  fin.row_loss = row_loss;
  fin.reduction = static_cast<int>(c.options.reduction);
  fin.loss = static_cast<float*>(c.out.loss.data);
  fin.count = count;
  launch_distill_finish(fin, stream);
  return last_error("the distillation reduction kernel");
}

class Run {
 public:
  Run(const detail::DistillCall& c, const Plan& p, char* ws)
      : c_(c), p_(p), ws_(ws), stream_(static_cast<cudaStream_t>(c.device.stream)) {}

  Status forward() {
    DistillForwardParams f = forward_params();
    FUSEDCE_TRY(over_chunks([&](int64_t r0, int64_t nc) { return forward_rows(&f, r0, nc); }));
    return finish_forward();
  }

  Status backward() {
    FUSEDCE_TRY(prepare_backward());
    if (p_.N == 0) return clear_grads();
    DistillBackwardParams b = backward_params(static_cast<const float*>(c_.stats.data),
                                              static_cast<const float*>(c_.grad_loss.data), c_.grad_loss.stride);
    FUSEDCE_TRY(over_chunks([&](int64_t r0, int64_t nc) { return backward_rows(&b, r0, nc); }));
    return finish_backward();
  }

  /// Step 1 of the vocabulary-parallel form: the rows' states over the shard, chunk by chunk.
  Status shard_stats() {
    const MatrixView& out = c_.shard_stats;
    FUSEDCE_TRY(clear(out.data, size_t(p_.N + 1) * kDistillShardStatsWidth * 4, "clearing the shard's statistics"));
    DistillShardStatsParams st = chunk_params(DistillShardStatsParams{});
    st.out = static_cast<float*>(out.data);
    return chunk_kernel(&st, launch_distill_shard_stats, "the shard statistics kernel");
  }

  /// Step 3: the rows' parts over the shard against step 2's global log-sum-exps.
  Status shard_parts() {
    const int64_t width = distill_shard_parts_width(p_.K);
    FUSEDCE_TRY(clear(c_.parts.data, size_t(p_.N) * size_t(width) * 4, "clearing the shard's parts"));
    DistillShardPartsParams pp = chunk_params(DistillShardPartsParams{});
    pp.row_stats = static_cast<const float*>(c_.row_stats.data);
    pp.parts = static_cast<float*>(c_.parts.data);
    pp.width = width;
    return chunk_kernel(&pp, launch_distill_shard_parts, "the shard parts kernel");
  }

  /// The forward and the backward for an upstream gradient of 1, each chunk's logits formed once.
  Status forward_backward() {
    FUSEDCE_TRY(prepare_backward());
    launch_fill_ones(ws_ + p_.unit, 1, DType::kFloat32, stream_);
    FUSEDCE_TRY(last_error("writing the upstream gradient"));
    DistillForwardParams f = forward_params();
    DistillBackwardParams b = backward_params(static_cast<const float*>(c_.out.stats.data), at<float>(p_.unit), 0);
    FUSEDCE_TRY(over_chunks([&](int64_t r0, int64_t nc) {
      FUSEDCE_TRY(forward_rows(&f, r0, nc));  // writes the rows' statistics the backward reads
      return backward_rows(&b, r0, nc);
    }));
    FUSEDCE_TRY(finish_forward());
    return p_.N == 0 ? clear_grads() : finish_backward();
  }

 private:
  /// A chunk kernel's parameters: the rows, the logits chunks and the teacher of this call.
  template <class P>
  P chunk_params(P p) const {
    p.r = rows_of(c_);
    p.logits = ws_ + p_.logits;
    p.ld = p_.ld;
    p.dtype = p_.dtype;
    p.t = teacher_rows();
    return p;
  }

  /// launch(*p) over every chunk's rows, after the chunk's logits are formed.
  template <class P>
  Status chunk_kernel(P* p, void (*launch)(const P&, cudaStream_t), const char* what) {
    return over_chunks([&](int64_t r0, int64_t nc) {
      p->r.r0 = r0;
      p->r.rows = nc;
      launch(*p, stream_);
      return last_error(what);
    });
  }

  /// body(r0, nc) over the token chunks [r0, r0 + nc), each after its logits are formed.
  template <class Body>
  Status over_chunks(Body&& body) {
    for (int64_t r0 = 0; r0 < p_.N; r0 += p_.rows) {
      const int64_t nc = std::min(p_.rows, p_.N - r0);
      FUSEDCE_TRY(logits(r0, nc));
      FUSEDCE_TRY(body(r0, nc));
    }
    return Status::Ok();
  }

  template <typename T>
  T* at(size_t offset) const {
    return reinterpret_cast<T*>(ws_ + offset);
  }

  DistillForwardParams forward_params() const {
    DistillForwardParams f = outputs_of(c_, at<float>(p_.row_loss), kDistillStatsWidth);
    f.ld = p_.ld;
    f.dtype = p_.dtype;
    f.t = teacher_rows();
    return f;
  }

  /// The forward's row kernel over the chunk rows [r0, r0 + nc), whose logits are formed.
  Status forward_rows(DistillForwardParams* f, int64_t r0, int64_t nc) {
    f->logits = ws_ + p_.logits;
    f->r.r0 = r0;
    f->r.rows = nc;
    launch_distill_forward(*f, stream_);
    return last_error("the distillation forward kernel");
  }

  /// After the last chunk: the rows' losses reduced in row order (reduction mean or sum).
  Status finish_forward() { return finish_loss(c_, p_.N, at<float>(p_.row_loss), at<int64_t>(p_.count), stream_); }

  /// Before any row's gradient: the mean's count of rows (on the device) and grad_bias's ones.
  Status prepare_backward() {
    if (c_.options.reduction == Reduction::kMean) {
      DistillFinishParams fin{};
      fin.r = rows_of(c_);
      fin.N = p_.N;
      fin.count = at<int64_t>(p_.count);
      launch_distill_finish(fin, stream_);
      FUSEDCE_TRY(last_error("counting the rows"));
    }
    if (c_.grads.grad_bias.data) {
      launch_fill_ones(ws_ + p_.ones, p_.rows, p_.dtype, stream_);
      FUSEDCE_TRY(last_error("filling the ones vector"));
    }
    return Status::Ok();
  }

  DistillBackwardParams backward_params(const float* stats, const float* grad_loss, int64_t grad_stride) const {
    DistillBackwardParams b{};
    b.r = rows_of(c_);
    b.ld = p_.ld;
    b.dtype = p_.dtype;
    b.t = teacher_rows();
    b.stats = stats;
    // a shard's top-k backward reads step 4's statistics, the gathered q after the row's own
    b.stats_width = c_.shard_step == detail::ShardStep::kBackward && p_.topk ? distill_shard_stats_width(p_.K)
                                                                              : kDistillStatsWidth;
    b.grad_loss = grad_loss;
    b.grad_stride = grad_stride;
    b.reduction = static_cast<int>(c_.options.reduction);
    b.count = at<int64_t>(p_.count);
    b.entry_y = p_.entry_y ? at<float>(p_.entry_y) : nullptr;
    b.entry_g = p_.entry_g ? at<float>(p_.entry_g) : nullptr;
    b.keys = p_.keys ? at<uint64_t>(p_.keys) : nullptr;
    b.Kp = p_.Kp;
    return b;
  }

  /// The backward's row kernel over the chunk rows [r0, r0 + nc) (dlogits in place of the
  /// student's logits), then the chunk's gradient products.
  Status backward_rows(DistillBackwardParams* b, int64_t r0, int64_t nc) {
    b->logits = ws_ + p_.logits;
    b->r.r0 = r0;
    b->r.rows = nc;
    launch_distill_backward(*b, stream_);
    FUSEDCE_TRY(last_error("the distillation backward kernel"));
    return gradient_products(r0, nc);
  }

  /// After the last chunk: grad_bias rounded from its float32 sum.
  Status finish_backward() {
    const LinearGrads& g = c_.grads;
    if (g.grad_bias.data) {
      launch_convert(ConvertParams{at<float>(p_.gb), g.grad_bias.data, p_.V, 1, g.grad_bias.stride, p_.dtype}, stream_);
      FUSEDCE_TRY(last_error("rounding grad_bias"));
    }
    return Status::Ok();
  }

  GemmCall base() const { return gemm_on(ws_ + p_.gemm_ws, stream_, c_.device.index); }

  DistillTeacherRows teacher_rows() const {
    DistillTeacherRows t{};
    const DistillTeacher& d = c_.teacher;
    if (p_.topk) {
      t.ids = static_cast<const int64_t*>(d.topk_ids.data);
      t.ids_stride = ld_of(d.topk_ids);
      t.logprobs = static_cast<const float*>(d.topk_logprobs.data);
      t.lp_stride = ld_of(d.topk_logprobs);
      t.K = p_.K;
      t.dtype = p_.dtype;
      return t;
    }
    t.logits = p_.teacher_logits ? ws_ + p_.t_logits : nullptr;
    t.ld = p_.ld_t;
    t.dtype = p_.t_dtype;
    return t;
  }

  /// One head's logits of rows [r0, r0 + nc) into `out` (ld columns apart), with its bias.
  Status head_logits(const MatrixView& hidden, const MatrixView& weight, const VectorView& bias, int64_t r0,
                     int64_t nc, void* out, int64_t ld) {
    GemmCall g = base();
    g.a = rows_operand(weight, 0, weight.rows);
    g.transpose_a = true;
    g.b = rows_operand(hidden, r0, nc);
    g.d = out;
    g.d_dtype = hidden.dtype;
    g.m = p_.V;
    g.n = nc;
    g.ld_d = ld;
    g.role = GemmRole::kLogits;
    if (bias.data) {
      g.bias = bias.data;
      g.bias_dtype = hidden.dtype;
    }
    return gemm(g);
  }

  Status logits(int64_t r0, int64_t nc) {
    FUSEDCE_TRY(head_logits(c_.hidden, c_.weight, c_.bias, r0, nc, ws_ + p_.logits, p_.ld));
    if (!p_.teacher_logits) return Status::Ok();
    const DistillTeacher& t = c_.teacher;
    return head_logits(t.hidden, t.weight, t.bias, r0, nc, ws_ + p_.t_logits, p_.ld_t);
  }

  /// grad_hidden rows, grad_weight and grad_bias from the chunk's dlogits.
  Status gradient_products(int64_t r0, int64_t nc) {
    const LinearGrads& g = c_.grads;
    const GemmOperand dl{ws_ + p_.logits, p_.dtype, p_.V, nc, p_.ld};  // dlogits^T: V x nc
    if (g.grad_hidden.data) {
      // grad_hidden^T (H x nc) = weight^T (H x V) . dlogits^T (V x nc), float32
      GemmCall h = base();
      h.a = rows_operand(c_.weight, 0, p_.V);
      h.b = dl;
      h.d = static_cast<float*>(g.grad_hidden.data) + r0 * g.grad_hidden.row_stride;
      h.d_dtype = DType::kFloat32;
      h.m = p_.H;
      h.n = nc;
      h.ld_d = ld_of(g.grad_hidden);
      h.role = GemmRole::kGradHidden;
      FUSEDCE_TRY(gemm(h));
    }
    if (g.grad_weight.data) {
      // grad_weight^T (H x V) (+)= hidden^T (H x nc) . dlogits (nc x V), in the weight's dtype
      GemmCall w = base();
      w.a = rows_operand(c_.hidden, r0, nc);
      w.b = dl;
      w.transpose_b = true;
      w.m = p_.H;
      w.n = p_.V;
      w.beta = r0 == 0 ? 0.0f : 1.0f;
      w.role = GemmRole::kGradWeight;
      w.d = g.grad_weight.data;
      w.d_dtype = p_.dtype;
      w.ld_d = ld_of(g.grad_weight);
      FUSEDCE_TRY(gemm(w));
    }
    if (g.grad_bias.data) {
      // grad_bias (V x 1) (+)= dlogits^T (V x nc) . ones (nc x 1), float32
      GemmCall b = base();
      b.a = dl;
      b.b = GemmOperand{ws_ + p_.ones, p_.dtype, nc, 1, nc};
      b.d = ws_ + p_.gb;
      b.d_dtype = DType::kFloat32;
      b.m = p_.V;
      b.n = 1;
      b.ld_d = p_.V;
      b.beta = r0 == 0 ? 0.0f : 1.0f;
      FUSEDCE_TRY(gemm(b));
    }
    return Status::Ok();
  }

  /// No rows: zero gradients (grad_hidden has no rows).
  Status clear_grads() { return clear_head_grads(c_.grads, p_.V, p_.H, p_.dtype, at<float>(p_.gb), stream_); }

  Status clear(void* data, size_t bytes, const char* what) {
    const cudaError_t e = bytes ? cudaMemsetAsync(data, 0, bytes, stream_) : cudaSuccess;
    return e == cudaSuccess ? Status::Ok() : device_error(e, what);
  }

  const detail::DistillCall& c_;
  const Plan& p_;
  char* ws_;
  cudaStream_t stream_;
};

/// The CUDA backend reads each bias with unit stride.
Status check_bias_stride(const char* name, const VectorView& b) {
  if (b.data == nullptr || b.size <= 1 || b.stride == 1) return Status::Ok();
  return Status(StatusCode::kInvalidArgument,
                std::string(name) + ": the CUDA backend needs stride 1, got " + std::to_string(b.stride));
}

Status check_head_biases(const detail::DistillCall& call) {
  FUSEDCE_TRY(check_bias_stride("bias", call.bias));
  if (!call.teacher.topk()) FUSEDCE_TRY(check_bias_stride("teacher_bias", call.teacher.bias));
  return Status::Ok();
}

/// Step 2 of the vocabulary-parallel form.
Status shard_merge(const detail::DistillCall& c, cudaStream_t stream) {
  DistillShardMergeParams m{};
  m.r = rows_of(c);
  m.N = c.row_stats.rows;
  m.world = c.world;
  m.gathered = static_cast<const float*>(c.shard_stats.data);
  m.row_stats = static_cast<float*>(c.row_stats.data);
  m.hard = static_cast<float*>(c.hard.data);
  m.hard_stride = c.hard.stride;
  launch_distill_shard_merge(m, stream);
  return last_error("the shard merge kernel");
}

/// Step 4 (both forms): the forward's outputs from the gathered parts, then the reduced loss.
Status shard_reduce(const detail::DistillCall& c, cudaStream_t stream) {
  const int64_t N = c.row_stats.rows, K = c.topk_k();
  const size_t row_loss_bytes = align_up(size_t(std::max<int64_t>(N, 1)) * 4);
  return with_workspace(row_loss_bytes + sizeof(int64_t), stream, [&](char* ws) {
    DistillShardReduceParams q{};
    q.f = outputs_of(c, reinterpret_cast<float*>(ws), K > 0 ? distill_shard_stats_width(K) : kDistillStatsWidth);
    q.N = N;
    q.world = c.world;
    q.K = K;
    q.gathered = static_cast<const float*>(c.parts.data);
    q.width = distill_shard_parts_width(K);
    q.teacher_logprobs = static_cast<const float*>(c.teacher.topk_logprobs.data);
    q.lp_stride = ld_of(c.teacher.topk_logprobs);
    q.row_stats = static_cast<const float*>(c.row_stats.data);
    q.hard = static_cast<const float*>(c.hard.data);
    q.hard_stride = c.hard.stride;
    launch_distill_shard_reduce(q, stream);
    FUSEDCE_TRY(last_error("the shard reduction kernel"));
    return finish_loss(c, N, reinterpret_cast<float*>(ws), reinterpret_cast<int64_t*>(ws + row_loss_bytes), stream);
  });
}

}  // namespace

size_t distill_workspace_size(const detail::DistillCall& call) { return plan_of(call).total; }

Status run_distill(const detail::DistillCall& call) {
  FUSEDCE_TRY(check_head_biases(call));
  DeviceGuard guard(call.device.index);
  (void)cudaGetLastError();  // an earlier, unrelated error must not be reported as ours
  const Plan plan = plan_of(call);
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  return with_call_workspace(call.workspace, plan.total, "linear_distill_workspace_size", stream, [&](char* ws) {
    Run run(call, plan, ws);
    return call.fused ? run.forward_backward() : call.backward ? run.backward() : run.forward();
  });
}

Status run_distill_shard(const detail::DistillCall& call) {
  DeviceGuard guard(call.device.index);
  (void)cudaGetLastError();  // an earlier, unrelated error must not be reported as ours
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  switch (call.shard_step) {
    case detail::ShardStep::kMerge:
      return shard_merge(call, stream);
    case detail::ShardStep::kReduce:
    case detail::ShardStep::kReduceTopk:
      return shard_reduce(call, stream);
    default:
      break;
  }
  FUSEDCE_TRY(check_head_biases(call));
  const Plan plan = plan_of(call);
  return with_call_workspace(call.workspace, plan.total, "linear_distill_workspace_size", stream, [&](char* ws) {
    Run run(call, plan, ws);
    switch (call.shard_step) {
      case detail::ShardStep::kStats:
        return run.shard_stats();
      case detail::ShardStep::kParts:
        return run.shard_parts();
      case detail::ShardStep::kBackward:
        return run.backward();
      default:
        return Status(StatusCode::kInvalidArgument, "shard_step must be one of the vocabulary-parallel steps");
    }
  });
}

}  // namespace cuda
}  // namespace fusedce
