// The CUDA backend of the per-token log-probabilities (fusedce/logprobs.h): the logits form
// runs the kernels of logprobs_kernels.cu on the caller's logits; the linear form forms the
// logits chunk by chunk with cuBLASLt (cuda/gemm.h) into one buffer and runs the same kernels on
// each chunk, never storing more than that chunk:
//   step 1, per token chunk: logits chunk (rows, V_local) = hidden_chunk . weight^T (+ bias) in
//     the input dtype; the statistics kernel folds it into rows [r0, r0 + rows] of the output
//     (each chunk's extra row is the next chunk's first, the last one's is the spare row N);
//   step 3, per chunk: the logits again, turned into dlogits in place by the backward kernel,
//     then grad_hidden (float32) (+)= dlogits . weight, grad_weight (+)= dlogits^T . hidden and
//     grad_bias (+)= dlogits^T . ones, float32 accumulation.
// FLOPs: 2NHV for step 1, 6NHV for step 3 (the logits again, and the two gradient products): the
// linear loss's shape. chunk_budget_bytes bounds the logit buffer, with the linear loss's
// default rule; the room of the float32 grad_weight accumulator a 16-bit weight needs over token
// chunks goes to the logits instead where that avoids it (plan_of). No host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/logprob_call.h"
#include "cuda/host_util.h"
#include "cuda/linear/gemm.h"
#include "cuda/linear/cutlass_products.h"
#include "cuda/linear/head_ops.h"
#include "cuda/linear/linear.h"
#include "cuda/logprobs/logprobs_kernels.h"
#include "cuda/logprobs/lp_fused_products.h"

namespace fusedce {
namespace cuda {
namespace {

int64_t round_up(int64_t n, int64_t q) { return (n + q - 1) / q * q; }

#define FUSEDCE_TRY(expr)    \
  do {                       \
    Status s_ = (expr);      \
    if (!s_.ok()) return s_; \
  } while (0)

LpRows rows_of(const detail::LogprobCall& c) {
  LpRows r{};
  r.target = c.target.data;
  r.target_stride = c.target.stride;
  r.target_i64 = c.target.dtype == DType::kInt64;
  r.ignore_index = c.options.ignore_index;
  r.rows = c.rows();
  r.vocab_start = c.shard.vocab_start;
  r.vocab_total = c.shard.vocab_total;
  r.inv_t = 1.0f / c.options.temperature;
  r.dist = c.options.distribution_stats;
  return r;
}

/// How step 1 or step 3 walks the (N, V) logits, never holding more than one chunk of them:
///  - one chunk of every row where the logits fit the room (the budget, plus in step 3 the
///    float32 grad_weight accumulator's bytes a 16-bit weight over several token chunks would
///    take): every product at full size, nothing accumulated across chunks;
///  - else step 3 with grad_weight walks vocabulary chunks (all rows, `cols` columns each) in that
///    same room: each chunk's grad_weight rows are one product over all tokens, written once in
///    the weight's dtype, and only the (N, H) float32 grad_hidden sums across chunks, where token
///    chunks would read and write a (V, H) float32 accumulator once per chunk;
///  - else token chunks (`rows` rows each) of the budget, balanced so the last is not a sliver;
///    grad_weight over several of them sums in the float32 accumulator, rounded once. Vocabulary
///    chunks narrower than kLeastCols fall back to this.
struct Plan {
  int64_t N, H, V;
  DType dtype;
  int64_t ld;    // row stride of the logits buffer: its columns rounded up to 16 bytes
  int64_t rows;  // token rows per chunk
  int64_t cols;  // vocabulary columns per chunk (< V: vocabulary chunks; rows is then N)
  bool gw_acc;   // grad_weight through a float32 accumulator (16-bit, several token chunks)
  size_t gemm_ws, logits, ones, gw, gb, total;
};

// Whole product tiles along the chunked dimension keep the products at full speed.
constexpr int64_t kTile = 128;
constexpr int64_t kLeastCols = 2 * kTile;

/// n items in chunks of at most `most`, as few chunks as that allows and as even as whole tiles
/// allow (whole tiles only where they still fit `most`).
int64_t balanced_chunk(int64_t n, int64_t most) {
  most = std::max<int64_t>(1, std::min(most, std::max<int64_t>(n, 1)));
  const int64_t count = (n + most - 1) / most;
  const int64_t even = (n + count - 1) / std::max<int64_t>(count, 1);
  const int64_t tiled = round_up(even, kTile);
  return count > 1 && tiled <= most ? tiled : std::max<int64_t>(even, 1);
}

Plan plan_of(const detail::LogprobCall& c) {
  Plan p{};
  p.N = c.hidden.rows;
  p.H = c.hidden.cols;
  p.V = c.weight.rows;
  p.dtype = c.hidden.dtype;
  const size_t el = elem_size(p.dtype);
  const bool backward = c.step == 3;
  const bool want_gw = backward && c.grads.grad_weight.data != nullptr;
  const bool want_gb = backward && c.grads.grad_bias.data != nullptr;
  const size_t budget = c.chunk_budget_bytes > 0 ? c.chunk_budget_bytes : default_chunk_budget(p.V, p.H);
  const size_t acc_bytes = want_gw && p.dtype != DType::kFloat32 ? size_t(p.V) * size_t(p.H) * 4 : 0;
  const size_t room = budget + acc_bytes;
  const int64_t ld_v = round_up(p.V, static_cast<int64_t>(16 / el));
  const int64_t n_rows = std::max<int64_t>(p.N, 1);
  const int64_t most_cols = want_gw ? static_cast<int64_t>(room / (size_t(n_rows) * el)) / kTile * kTile : 0;
  p.cols = p.V;
  p.ld = ld_v;
  if (size_t(n_rows) * size_t(ld_v) * el <= room) {
    p.rows = n_rows;
  } else if (want_gw && most_cols >= kLeastCols) {
    p.rows = n_rows;
    p.cols = balanced_chunk(p.V, most_cols);
    p.ld = round_up(p.cols, static_cast<int64_t>(16 / el));
  } else {
    p.rows = balanced_chunk(p.N, static_cast<int64_t>(budget / (size_t(ld_v) * el)));
  }
  p.gw_acc = want_gw && p.dtype != DType::kFloat32 && p.rows < p.N;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at += align_up(std::max<size_t>(bytes, 1));
    return here;
  };
  p.gemm_ws = take(kGemmWorkspaceBytes);
  p.logits = take(size_t(p.rows) * size_t(p.ld) * el);
  p.ones = want_gb ? take(size_t(p.rows) * el) : 0;
  p.gw = p.gw_acc ? take(size_t(p.V) * size_t(p.H) * 4) : 0;
  p.gb = want_gb ? take(size_t(p.V) * 4) : 0;
  p.total = at;
  return p;
}

class LinearRun {
 public:
  LinearRun(const detail::LogprobCall& c, const Plan& p, char* ws)
      : c_(c),
        p_(p),
        ws_(ws),
        stream_(static_cast<cudaStream_t>(c.device.stream)),
        fused_(p.dtype == DType::kBFloat16 && c.bias.data == nullptr && cutlass_products_available(c.device.index)) {}

  Status stats() {
    // The fused product keeps no logits, only its (tile, row) partials in the logits buffer:
    // its token chunks are as many rows as their partials fit there (every row, at the shapes
    // that matter), so its products run at full size. If it cannot run (kUnsupported at the
    // first chunk, nothing launched) the walk starts again in the plan's chunks.
    if (fused_ && p_.N > 0) {
      const size_t per_row = lp_fused_partial_bytes(1, p_.V, c_.options.distribution_stats);
      const int64_t fit = static_cast<int64_t>(size_t(p_.rows) * size_t(p_.ld) * elem_size(p_.dtype) / per_row);
      const int64_t step = std::max(p_.rows, balanced_chunk(p_.N, fit));
      bool unsupported = false;
      FUSEDCE_TRY(stats_by(step, &unsupported));
      if (!unsupported) return Status::Ok();
    }
    bool unused = false;
    return stats_by(p_.rows, &unused);
  }

  /// Step 1 in token chunks of `step` rows: the fused product where it runs, else the logits
  /// (step <= the plan's rows then) and the row kernel. `unsupported`: the first chunk found the
  /// fused product unable to run with step > the plan's rows, and nothing was launched.
  Status stats_by(int64_t step, bool* unsupported) {
    float* out = static_cast<float*>(c_.stats.data);
    for (int64_t r0 = 0; r0 == 0 || r0 < p_.N; r0 += step) {
      const int64_t nc = std::min(step, p_.N - r0);
      bool done = false;
      if (nc > 0) FUSEDCE_TRY(fused_stats(r0, nc, out + r0 * kLogprobStatsWidth, done));
      if (!done) {
        if (nc > p_.rows) {  // only the fused product takes chunks past the buffer's rows
          *unsupported = true;
          return Status::Ok();
        }
        if (nc > 0) FUSEDCE_TRY(logits(r0, nc, 0, p_.V));
        launch_lp_stats(rows_at(r0, nc), chunk(nc, p_.V), out + r0 * kLogprobStatsWidth, stream_);
        FUSEDCE_TRY(last_error("the log-probability statistics kernel"));
      }
      if (p_.N == 0) break;
    }
    return Status::Ok();
  }

  Status backward() {
    const LinearGrads& g = c_.grads;
    if (g.grad_bias.data) {
      launch_fill_ones(ws_ + p_.ones, p_.rows, p_.dtype, stream_);
      FUSEDCE_TRY(last_error("filling the ones vector"));
    }
    if (p_.N == 0) return clear_grads();
    // One of the two loops has one pass (plan_of): token chunks of every column, or vocabulary
    // chunks of every row.
    for (int64_t r0 = 0; r0 < p_.N; r0 += p_.rows) {
      for (int64_t v0 = 0; v0 < p_.V; v0 += p_.cols) {
        FUSEDCE_TRY(backward_chunk(r0, std::min(p_.rows, p_.N - r0), v0, std::min(p_.cols, p_.V - v0)));
      }
    }
    if (p_.gw_acc) {
      launch_convert(ConvertParams{reinterpret_cast<const float*>(ws_ + p_.gw), g.grad_weight.data, p_.V, p_.H,
                                   g.grad_weight.row_stride, p_.dtype},
                     stream_);
      FUSEDCE_TRY(last_error("rounding grad_weight"));
    }
    if (g.grad_bias.data) {
      launch_convert(ConvertParams{reinterpret_cast<const float*>(ws_ + p_.gb), g.grad_bias.data, p_.V, 1,
                                   g.grad_bias.stride, p_.dtype},
                     stream_);
      FUSEDCE_TRY(last_error("rounding grad_bias"));
    }
    return Status::Ok();
  }

  /// Step 3 over logits rows [r0, r0 + nc) x columns [v0, v0 + vc): each gradient takes this
  /// chunk's part, summed over the chunks that share its elements (beta 1 after the first).
  Status backward_chunk(int64_t r0, int64_t nc, int64_t v0, int64_t vc) {
    const LinearGrads& g = c_.grads;
    bool done = false;
    FUSEDCE_TRY(fused_dlogits(r0, nc, v0, vc, done));
    if (!done) {
      FUSEDCE_TRY(logits(r0, nc, v0, vc));
      const MatrixView L = chunk(nc, vc);
      LpRows rows = rows_at(r0, nc);
      rows.vocab_start += v0;
      launch_lp_backward(rows, L, L, slice_of(c_.out.lse, r0, nc), slice_of(c_.out.logprob, r0, nc),
                         slice_of(c_.out.entropy, r0, nc), slice_of(c_.grad_logprob, r0, nc),
                         slice_of(c_.grad_entropy, r0, nc), stream_);
      FUSEDCE_TRY(last_error("the log-probability backward kernel"));
    }
    const GemmOperand dl{ws_ + p_.logits, p_.dtype, vc, nc, p_.ld};  // dlogits^T: vc x nc
    if (g.grad_hidden.data) {
      // grad_hidden^T (H x nc) (+)= weight columns (H x vc) . dlogits^T (vc x nc), float32
      GemmCall h = base();
      h.a = weight_op(v0, vc);
      h.b = dl;
      h.d = static_cast<float*>(g.grad_hidden.data) + r0 * g.grad_hidden.row_stride;
      h.d_dtype = DType::kFloat32;
      h.m = p_.H;
      h.n = nc;
      h.ld_d = g.grad_hidden.row_stride;
      h.beta = v0 == 0 ? 0.0f : 1.0f;
      FUSEDCE_TRY(gemm(h));
    }
    if (g.grad_weight.data) {
      // grad_weight rows [v0, v0 + vc), transposed (H x vc) (+)= hidden (H x nc) . dlogits (nc x vc)
      GemmCall w = base();
      w.a = hidden_op(r0, nc);
      w.b = dl;
      w.transpose_b = true;
      w.m = p_.H;
      w.n = vc;
      w.beta = r0 == 0 ? 0.0f : 1.0f;
      if (p_.gw_acc) {
        w.d = ws_ + p_.gw + size_t(v0) * size_t(p_.H) * 4;
        w.d_dtype = DType::kFloat32;
        w.ld_d = p_.H;
      } else {
        w.d = static_cast<char*>(g.grad_weight.data) + size_t(v0) * g.grad_weight.row_stride * elem_size(p_.dtype);
        w.d_dtype = p_.dtype;
        w.ld_d = g.grad_weight.row_stride;
      }
      FUSEDCE_TRY(gemm(w));
    }
    if (g.grad_bias.data) {
      // grad_bias [v0, v0 + vc) (+)= dlogits^T (vc x nc) . ones (nc x 1), float32
      GemmCall b = base();
      b.a = dl;
      b.b = GemmOperand{ws_ + p_.ones, p_.dtype, nc, 1, nc};
      b.d = ws_ + p_.gb + size_t(v0) * 4;
      b.d_dtype = DType::kFloat32;
      b.m = vc;
      b.n = 1;
      b.ld_d = vc;
      b.beta = r0 == 0 ? 0.0f : 1.0f;
      FUSEDCE_TRY(gemm(b));
    }
    return Status::Ok();
  }

 private:
  GemmCall base() const { return gemm_on(ws_ + p_.gemm_ws, stream_, c_.device.index); }
  GemmOperand weight_op(int64_t v0, int64_t vc) const { return rows_operand(c_.weight, v0, vc); }  // H x vc
  GemmOperand hidden_op(int64_t r0, int64_t nc) const { return rows_operand(c_.hidden, r0, nc); }  // H x nc
  MatrixView chunk(int64_t nc, int64_t vc) const { return matrix(ws_ + p_.logits, p_.dtype, nc, vc, p_.ld); }
  LpRows rows_at(int64_t r0, int64_t nc) const {
    LpRows r = rows_of(c_);
    r.target = static_cast<const char*>(r.target) + size_t(r0) * r.target_stride * (r.target_i64 ? 8 : 4);
    r.rows = nc;
    return r;
  }
  static VectorView slice_of(const VectorView& v, int64_t r0, int64_t n) {
    if (v.data == nullptr) return v;
    VectorView s = v;
    s.data = static_cast<float*>(v.data) + r0 * v.stride;
    s.size = n;
    return s;
  }

  /// Logits of rows [r0, r0 + nc) x columns [v0, v0 + vc) into the buffer.
  Status logits(int64_t r0, int64_t nc, int64_t v0, int64_t vc) {
    GemmCall g = base();
    g.a = weight_op(v0, vc);
    g.transpose_a = true;
    g.b = hidden_op(r0, nc);
    g.d = ws_ + p_.logits;
    g.d_dtype = p_.dtype;
    g.m = vc;
    g.n = nc;
    g.ld_d = p_.ld;
    if (c_.bias.data) {
      g.bias = static_cast<const char*>(c_.bias.data) + size_t(v0) * elem_size(p_.dtype);
      g.bias_dtype = p_.dtype;
    }
    return gemm(g);
  }

  /// The product of rows [r0, r0 + nc) and vocabulary columns [v0, v0 + vc) for the fused
  /// kernels (lp_fused_products.h).
  LpFusedProduct fused_product(int64_t r0, int64_t nc, int64_t v0, int64_t vc) const {
    const size_t el = elem_size(p_.dtype);
    LpFusedProduct f{};
    f.rows = nc;
    f.cols = vc;
    f.H = p_.H;
    f.hidden = static_cast<const char*>(c_.hidden.data) + size_t(r0) * size_t(c_.hidden.row_stride) * el;
    f.ld_hidden = ld_of(c_.hidden);
    f.weight = static_cast<const char*>(c_.weight.data) + size_t(v0) * size_t(c_.weight.row_stride) * el;
    f.ld_weight = ld_of(c_.weight);
    f.r = rows_at(r0, nc);
    f.r.vocab_start += v0;
    f.stream = stream_;
    f.device = c_.device.index;
    return f;
  }

  /// Step 1 of a token chunk by the fused product and the tile fold, where it runs: `done`.
  /// kUnsupported (an operand TMA cannot address) turns the fused products off for the call.
  Status fused_stats(int64_t r0, int64_t nc, float* out, bool& done) {
    done = false;
    // the partials live in the logits buffer: fewer bytes but at the smallest V with the
    // distribution columns
    const size_t room = size_t(p_.rows) * size_t(p_.ld) * elem_size(p_.dtype);
    if (!fused_ || lp_fused_partial_bytes(nc, p_.V, c_.options.distribution_stats) > room) return Status::Ok();
    float4* partials = reinterpret_cast<float4*>(ws_ + p_.logits);
    const Status s = run_lp_stats_product(fused_product(r0, nc, 0, p_.V), partials);
    if (s.code() == StatusCode::kUnsupported) {
      fused_ = false;
      return Status::Ok();
    }
    FUSEDCE_TRY(s);
    launch_lp_fold_tiles(rows_at(r0, nc), partials, lp_fused_tiles(p_.V), kLpFusedTile, p_.V, out, stream_);
    FUSEDCE_TRY(last_error("the log-probability tile fold"));
    done = true;
    return Status::Ok();
  }

  /// Step 3's dlogits of a chunk by the fused product, into the logits buffer, where it runs:
  /// `done` (as fused_stats).
  Status fused_dlogits(int64_t r0, int64_t nc, int64_t v0, int64_t vc, bool& done) {
    done = false;
    if (!fused_ || nc == 0 || vc == 0) return Status::Ok();
    const VectorView lse = slice_of(c_.out.lse, r0, nc), lp = slice_of(c_.out.logprob, r0, nc);
    const VectorView ent = slice_of(c_.out.entropy, r0, nc), g_lp = slice_of(c_.grad_logprob, r0, nc);
    const VectorView g_h = slice_of(c_.grad_entropy, r0, nc);
    LpFusedGrad g{};
    g.lse = static_cast<const float*>(lse.data);
    g.logprob = static_cast<const float*>(lp.data);
    g.g_lp = static_cast<const float*>(g_lp.data);
    g.lse_stride = lse.stride;
    g.logprob_stride = lp.stride;
    g.g_lp_stride = g_lp.stride;
    if (g_h.data != nullptr) {
      g.entropy = static_cast<const float*>(ent.data);
      g.entropy_stride = ent.stride;
      g.g_h = static_cast<const float*>(g_h.data);
      g.g_h_stride = g_h.stride;
    }
    g.dlogits = ws_ + p_.logits;
    g.ld_dlogits = p_.ld;
    LpFusedProduct f = fused_product(r0, nc, v0, vc);
    f.r.dist = false;  // the gradient needs no distribution statistics
    const Status s = run_lp_dlogits_product(f, g);
    if (s.code() == StatusCode::kUnsupported) {
      fused_ = false;
      return Status::Ok();
    }
    FUSEDCE_TRY(s);
    done = true;
    return Status::Ok();
  }

  /// No rows: zero gradients.
  Status clear_grads() {
    return clear_head_grads(c_.grads, p_.V, p_.H, p_.dtype, reinterpret_cast<float*>(ws_ + p_.gb), stream_);
  }

  const detail::LogprobCall& c_;
  const Plan& p_;
  char* ws_;
  cudaStream_t stream_;
  // The fused products (lp_fused_products.h) where they run: Hopper, bf16, no bias; the first
  // kUnsupported turns them off for the rest of the call.
  bool fused_;
};

Status run_linear(const detail::LogprobCall& call) {
  if (call.bias.data != nullptr && call.bias.size > 1 && call.bias.stride != 1) {
    return Status(StatusCode::kInvalidArgument, "bias: the CUDA backend needs stride 1, got " + std::to_string(call.bias.stride));
  }
  const Plan plan = plan_of(call);
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  auto run = [&](char* ws) { return call.step == 1 ? LinearRun(call, plan, ws).stats() : LinearRun(call, plan, ws).backward(); };
  return with_call_workspace(call.workspace, plan.total, "linear_logprobs_workspace_size", stream, run);
}

}  // namespace

size_t logprobs_workspace_size(const detail::LogprobCall& call) { return call.linear ? plan_of(call).total : 0; }

Status run_logprobs(const detail::LogprobCall& call) {
  DeviceGuard guard(call.device.index);
  (void)cudaGetLastError();  // an earlier, unrelated error must not be reported as ours
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  const LpRows r = rows_of(call);
  if (call.step == 2) {
    launch_lp_merge(r, static_cast<const float*>(call.stats.data), call.world, call.out.logprob, call.out.entropy,
                    call.out.lse, stream);
    return last_error("the log-probability merge kernel");
  }
  if (call.step == 4) {
    launch_lp_distribution_stats(r, static_cast<const float*>(call.stats.data), call.world,
                                 call.dist.log_sum_sq_probs, call.dist.mean_logit, call.dist.is_top1, stream);
    return last_error("the distribution statistics kernel");
  }
  if (call.linear) return run_linear(call);
  if (call.step == 1) {
    launch_lp_stats(r, call.logits, static_cast<float*>(call.stats.data), stream);
    return last_error("the log-probability statistics kernel");
  }
  launch_lp_backward(r, call.logits, call.dlogits, call.out.lse, call.out.logprob, call.out.entropy, call.grad_logprob,
                     call.grad_entropy, stream);
  return last_error("the log-probability backward kernel");
}

}  // namespace cuda
}  // namespace fusedce
