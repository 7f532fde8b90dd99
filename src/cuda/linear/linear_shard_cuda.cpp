// The CUDA backend of the vocabulary-parallel linear steps (vocab_parallel.h): the linear
// cross-entropy over this rank's rows of the head, never storing more than one chunk of logits.
//   step 1, per token chunk: logits chunk (rows, V_local) = hidden_chunk . weight^T (+ bias),
//     cuBLASLt, in the input dtype; the shard statistics kernel folds it into the rows'
//     statistics (written in place in the (N + 1, 9) output: each chunk's extra row is the next
//     chunk's first, and the last chunk's is row N, the shard's class-weight sum).
//   step 3, per vocabulary slice (the whole shard; with low_memory, slices whose float32
//     grad_weight accumulator stays within kSliceAccBytes) and token chunk: the logits again,
//     the shard backward kernel turns them into dlogits in place from the merged lse, then
//     grad_hidden (float32, this rank's part) += dlogits . weight_slice, grad_weight_slice (+)=
//     dlogits^T . hidden_chunk (float32 accumulation, rounded once), grad_bias likewise.
// chunk_budget_bytes bounds the logit buffer (input dtype) as in linear_cuda.cpp, with the same
// default; low_memory keeps the buffer and the accumulators under 512 MiB. No host
// synchronisation. skip_ignored needs the count of the kept rows on the host and a compaction
// of the rows that this path does not have yet: it is refused, not ignored.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/call.h"
#include "common/constants.h"
#include "cuda/linear/gemm.h"
#include "cuda/host_util.h"
#include "cuda/linear/linear.h"

namespace fusedce {
namespace cuda {
namespace {

int64_t round_up(int64_t n, int64_t q) { return (n + q - 1) / q * q; }

/// low_memory: the logit buffer and the largest float32 grad_weight slice accumulator.
constexpr size_t kLowMemoryBudget = size_t(256) << 20;
constexpr size_t kSliceAccBytes = size_t(128) << 20;

struct ShardPlan {
  int64_t N, H, V;
  DType dtype;
  int64_t slice;      // vocabulary columns per slice (step 3; V for step 1)
  int64_t ld;         // row stride of a logits chunk: the slice rounded up to 16 bytes
  int64_t rows;       // token rows per chunk
  bool gw_acc;        // grad_weight through a float32 slice accumulator (16-bit, several chunks)
  size_t gemm_ws, logits, ones, gw, gb, total;
};

ShardPlan plan_shard(const detail::LinearCall& c) {
  ShardPlan p{};
  p.N = c.hidden.rows;
  p.H = c.hidden.cols;
  p.V = c.weight.rows;
  p.dtype = c.hidden.dtype;
  const size_t el = elem_size(p.dtype);
  const int64_t per16 = static_cast<int64_t>(16 / el);
  const bool backward = c.shard_step == 3;
  const bool want_gw = backward && c.grads.grad_weight.data != nullptr;
  const bool want_gb = backward && c.grads.grad_bias.data != nullptr;
  const bool low = c.linear.low_memory;
  size_t budget = c.linear.chunk_budget_bytes > 0 ? c.linear.chunk_budget_bytes
                  : low                           ? kLowMemoryBudget
                                                  : default_chunk_budget(p.V, p.H);
  p.slice = p.V;
  if (backward && low && want_gw) {
    p.slice = std::max<int64_t>(1, std::min<int64_t>(p.V, static_cast<int64_t>(kSliceAccBytes / (size_t(p.H) * 4))));
  }
  p.ld = round_up(p.slice, per16);
  p.rows = std::max<int64_t>(1, std::min<int64_t>(static_cast<int64_t>(budget / (size_t(p.ld) * el)), std::max<int64_t>(p.N, 1)));
  if (p.rows >= 256 && p.rows < p.N) p.rows = p.rows / 128 * 128;  // whole tiles for the products
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
  p.gw = p.gw_acc ? take(size_t(p.slice) * size_t(p.H) * 4) : 0;
  p.gb = want_gb ? take(size_t(p.V) * 4) : 0;
  p.total = at;
  return p;
}

#define FUSEDCE_TRY(expr)    \
  do {                       \
    Status s_ = (expr);      \
    if (!s_.ok()) return s_; \
  } while (0)

class ShardRun {
 public:
  ShardRun(const detail::LinearCall& c, const ShardPlan& p, char* ws)
      : c_(c), p_(p), ws_(ws), stream_(static_cast<cudaStream_t>(c.device.stream)) {}

  Status stats() {
    const int64_t step = p_.rows;
    float* out = static_cast<float*>(c_.stats.data);
    for (int64_t r0 = 0; r0 == 0 || r0 < p_.N; r0 += step) {
      const int64_t nc = std::min(step, p_.N - r0);
      if (nc > 0) FUSEDCE_TRY(logits(r0, nc, 0, p_.V, true));
      // Rows [r0, r0 + nc] of the output; row r0 + nc is the next chunk's first (or row N).
      FUSEDCE_TRY(cross_entropy_shard_stats(c_.device, chunk(nc, p_.V), target_at(r0, nc), c_.shard, c_.options,
                                            matrix(out + r0 * kShardStatsWidth, DType::kFloat32, nc + 1,
                                                   kShardStatsWidth)));
      if (p_.N == 0) break;
    }
    return Status::Ok();
  }

  Status backward() {
    const LinearGrads& g = c_.grads;
    const size_t el = elem_size(p_.dtype);
    if (g.grad_bias.data) {
      launch_fill_ones(ws_ + p_.ones, p_.rows, p_.dtype, stream_);
      FUSEDCE_TRY(last_error("filling the ones vector"));
    }
    if (p_.N == 0) return clear_grads();
    for (int64_t v0 = 0; v0 < p_.V; v0 += p_.slice) {
      const int64_t vs = std::min(p_.slice, p_.V - v0);
      for (int64_t r0 = 0; r0 < p_.N; r0 += p_.rows) {
        const int64_t nc = std::min(p_.rows, p_.N - r0);
        FUSEDCE_TRY(logits(r0, nc, v0, vs, true));
        const MatrixView L = chunk(nc, vs);
        ShardSpec sub = c_.shard;
        sub.vocab_start += v0;
        Options o = c_.options;
        if (!o.class_weight.empty()) {
          o.class_weight.data = static_cast<float*>(o.class_weight.data) + v0 * o.class_weight.stride;
          o.class_weight.size = vs;
        }
        const bool per_row = o.reduction == Reduction::kNone;
        FUSEDCE_TRY(cross_entropy_shard_backward(c_.device, L, target_at(r0, nc), sub, o, slice_of(c_.lse_in, r0, nc),
                                                 slice_of(c_.row_weight, r0, nc), c_.batch,
                                                 per_row ? slice_of(c_.grad_loss, r0, nc) : c_.grad_loss, L));
        const GemmOperand dl{ws_ + p_.logits, p_.dtype, vs, nc, p_.ld};  // dlogits^T: vs x nc
        const GemmOperand wslice = weight_op(v0, vs);
        const GemmOperand hid = hidden_op(r0, nc);
        if (g.grad_hidden.data) {
          // grad_hidden^T (H x nc) (+)= weight_slice (H x vs) . dlogits^T (vs x nc), float32
          GemmCall h = base();
          h.a = wslice;
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
          // grad_weight_slice^T (H x vs) (+)= hidden (H x nc) . dlogits (nc x vs)
          GemmCall w = base();
          w.a = hid;
          w.b = dl;
          w.transpose_b = true;
          w.m = p_.H;
          w.n = vs;
          w.beta = r0 == 0 ? 0.0f : 1.0f;
          if (p_.gw_acc) {
            w.d = ws_ + p_.gw;
            w.d_dtype = DType::kFloat32;
            w.ld_d = p_.H;
          } else {
            w.d = static_cast<char*>(g.grad_weight.data) + size_t(v0) * g.grad_weight.row_stride * el;
            w.d_dtype = p_.dtype;
            w.ld_d = g.grad_weight.row_stride;
          }
          FUSEDCE_TRY(gemm(w));
        }
        if (g.grad_bias.data) {
          // grad_bias_slice (vs x 1) (+)= dlogits^T (vs x nc) . ones (nc x 1), float32
          GemmCall b = base();
          b.a = dl;
          b.b = GemmOperand{ws_ + p_.ones, p_.dtype, nc, 1, nc};
          b.d = reinterpret_cast<float*>(ws_ + p_.gb) + v0;
          b.d_dtype = DType::kFloat32;
          b.m = vs;
          b.n = 1;
          b.ld_d = vs;
          b.beta = r0 == 0 ? 0.0f : 1.0f;
          FUSEDCE_TRY(gemm(b));
        }
      }
      if (p_.gw_acc) {
        char* dst = static_cast<char*>(g.grad_weight.data) + size_t(v0) * g.grad_weight.row_stride * el;
        launch_convert(ConvertParams{reinterpret_cast<const float*>(ws_ + p_.gw), dst, vs, p_.H,
                                     g.grad_weight.row_stride, p_.dtype},
                       stream_);
        FUSEDCE_TRY(last_error("rounding a grad_weight slice"));
      }
    }
    if (g.grad_bias.data) {
      launch_convert(ConvertParams{reinterpret_cast<const float*>(ws_ + p_.gb), g.grad_bias.data, p_.V, 1,
                                   g.grad_bias.stride, p_.dtype},
                     stream_);
      FUSEDCE_TRY(last_error("rounding grad_bias"));
    }
    return Status::Ok();
  }

 private:
  GemmCall base() const {
    GemmCall g{};
    g.workspace = ws_ + p_.gemm_ws;
    g.stream = stream_;
    g.device = c_.device.index;
    return g;
  }
  GemmOperand weight_op(int64_t v0, int64_t vs) const {
    const char* w = static_cast<const char*>(c_.weight.data) + size_t(v0) * c_.weight.row_stride * elem_size(p_.dtype);
    return GemmOperand{w, p_.dtype, p_.H, vs, c_.weight.row_stride};  // H x vs
  }
  GemmOperand hidden_op(int64_t r0, int64_t nc) const {
    const char* h = static_cast<const char*>(c_.hidden.data) + size_t(r0) * c_.hidden.row_stride * elem_size(p_.dtype);
    return GemmOperand{h, p_.dtype, p_.H, nc, c_.hidden.row_stride};  // H x nc
  }
  MatrixView chunk(int64_t nc, int64_t vs) const { return matrix(ws_ + p_.logits, p_.dtype, nc, vs, p_.ld); }
  VectorView target_at(int64_t r0, int64_t nc) const {
    VectorView t = c_.target;
    t.data = static_cast<char*>(t.data) + size_t(r0) * t.stride * (t.dtype == DType::kInt64 ? 8 : 4);
    t.size = nc;
    return t;
  }
  static VectorView slice_of(const VectorView& v, int64_t r0, int64_t n) {
    VectorView s = v;
    s.data = static_cast<float*>(v.data) + r0 * v.stride;
    s.size = n;
    return s;
  }

  /// Logits of rows [r0, r0 + nc) over the local columns [v0, v0 + vs), into the buffer.
  Status logits(int64_t r0, int64_t nc, int64_t v0, int64_t vs, bool with_bias) {
    GemmCall g = base();
    g.a = weight_op(v0, vs);
    g.transpose_a = true;
    g.b = hidden_op(r0, nc);
    g.d = ws_ + p_.logits;
    g.d_dtype = p_.dtype;
    g.m = vs;
    g.n = nc;
    g.ld_d = p_.ld;
    if (with_bias && c_.bias.data) {
      g.bias = static_cast<const char*>(c_.bias.data) + size_t(v0) * elem_size(p_.dtype);
      g.bias_dtype = p_.dtype;
    }
    return gemm(g);
  }

  /// No rows: zero gradients.
  Status clear_grads() {
    const LinearGrads& g = c_.grads;
    const size_t el = elem_size(p_.dtype);
    cudaError_t e = cudaSuccess;
    if (g.grad_weight.data) {
      e = cudaMemset2DAsync(g.grad_weight.data, size_t(g.grad_weight.row_stride) * el, 0, size_t(p_.H) * el,
                            size_t(p_.V), stream_);
    }
    if (e == cudaSuccess && g.grad_bias.data) {
      e = cudaMemsetAsync(ws_ + p_.gb, 0, size_t(p_.V) * 4, stream_);
      if (e == cudaSuccess) {
        launch_convert(ConvertParams{reinterpret_cast<const float*>(ws_ + p_.gb), g.grad_bias.data, p_.V, 1,
                                     g.grad_bias.stride, p_.dtype},
                       stream_);
      }
    }
    return e == cudaSuccess ? last_error("clearing the gradients") : device_error(e, "clearing the gradients");
  }

  const detail::LinearCall& c_;
  const ShardPlan& p_;
  char* ws_;
  cudaStream_t stream_;
};

}  // namespace

size_t linear_shard_workspace_size(const detail::LinearCall& call) { return plan_shard(call).total; }

Status run_linear_shard(const detail::LinearCall& call) {
  if (call.linear.skip_ignored) {
    return Status(StatusCode::kUnsupported,
                  "skip_ignored: the vocabulary-parallel CUDA path has no row compaction yet (pass skip_ignored=False)");
  }
  if (call.bias.data != nullptr && call.bias.size > 1 && call.bias.stride != 1) {
    return Status(StatusCode::kInvalidArgument, "bias: the CUDA backend needs stride 1, got " + std::to_string(call.bias.stride));
  }
  DeviceGuard guard(call.device.index);
  (void)cudaGetLastError();  // an earlier, unrelated error must not be reported as ours
  const ShardPlan plan = plan_shard(call);
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  auto run = [&](char* ws) { return call.shard_step == 1 ? ShardRun(call, plan, ws).stats() : ShardRun(call, plan, ws).backward(); };
  return with_call_workspace(call.workspace, plan.total, "linear_cross_entropy_shard_workspace_size", stream, run);
}

}  // namespace cuda
}  // namespace fusedce
