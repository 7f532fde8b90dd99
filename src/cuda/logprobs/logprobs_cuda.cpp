// The CUDA backend of the per-token log-probabilities (fusedce/logprobs.h): the logits form
// runs the kernels of logprobs_kernels.cu on the caller's logits; the linear form forms the
// logits chunk by chunk with cuBLASLt (cuda/gemm.h) into one buffer and runs the same kernels on
// each chunk, never storing more than that chunk:
//   step 1, per token chunk: logits chunk (rows, V_local) = hidden_chunk . weight^T (+ bias) in
//     the input dtype; the statistics kernel folds it into rows [r0, r0 + rows] of the output
//     (each chunk's extra row is the next chunk's first, the last one's is the spare row N);
//   step 3, per token chunk: the logits again, turned into dlogits in place by the backward
//     kernel, then grad_hidden (float32) = dlogits . weight, grad_weight (+)= dlogits^T . hidden
//     (through a float32 accumulator for a 16-bit weight over several chunks, rounded once) and
//     grad_bias (+)= dlogits^T . ones, float32 accumulation.
// FLOPs: 2NHV for step 1, 6NHV for step 3 (the logits again, and the two gradient products): the
// linear loss's shape. chunk_budget_bytes bounds the logit buffer, with the linear loss's
// default rule. No host synchronisation.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/logprob_call.h"
#include "cuda/linear/gemm.h"
#include "cuda/host_util.h"
#include "cuda/linear/linear.h"
#include "cuda/logprobs/logprobs_kernels.h"

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
  r.inv_t = 1.0f / c.options.temperature;
  return r;
}

struct Plan {
  int64_t N, H, V;
  DType dtype;
  int64_t ld;    // row stride of a logits chunk: V rounded up to 16 bytes
  int64_t rows;  // token rows per chunk
  bool gw_acc;   // grad_weight through a float32 accumulator (16-bit, several chunks)
  size_t gemm_ws, logits, ones, gw, gb, total;
};

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
  p.ld = round_up(p.V, static_cast<int64_t>(16 / el));
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
  p.gw = p.gw_acc ? take(size_t(p.V) * size_t(p.H) * 4) : 0;
  p.gb = want_gb ? take(size_t(p.V) * 4) : 0;
  p.total = at;
  return p;
}

class LinearRun {
 public:
  LinearRun(const detail::LogprobCall& c, const Plan& p, char* ws)
      : c_(c), p_(p), ws_(ws), stream_(static_cast<cudaStream_t>(c.device.stream)) {}

  Status stats() {
    float* out = static_cast<float*>(c_.stats.data);
    for (int64_t r0 = 0; r0 == 0 || r0 < p_.N; r0 += p_.rows) {
      const int64_t nc = std::min(p_.rows, p_.N - r0);
      if (nc > 0) FUSEDCE_TRY(logits(r0, nc));
      launch_lp_stats(rows_at(r0, nc), chunk(nc), out + r0 * kLogprobStatsWidth, stream_);
      FUSEDCE_TRY(last_error("the log-probability statistics kernel"));
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
    for (int64_t r0 = 0; r0 < p_.N; r0 += p_.rows) {
      const int64_t nc = std::min(p_.rows, p_.N - r0);
      FUSEDCE_TRY(logits(r0, nc));
      const MatrixView L = chunk(nc);
      launch_lp_backward(rows_at(r0, nc), L, L, slice_of(c_.out.lse, r0, nc), slice_of(c_.out.logprob, r0, nc),
                         slice_of(c_.out.entropy, r0, nc), slice_of(c_.grad_logprob, r0, nc),
                         slice_of(c_.grad_entropy, r0, nc), stream_);
      FUSEDCE_TRY(last_error("the log-probability backward kernel"));
      const GemmOperand dl{ws_ + p_.logits, p_.dtype, p_.V, nc, p_.ld};  // dlogits^T: V x nc
      if (g.grad_hidden.data) {
        // grad_hidden^T (H x nc) = weight (H x V) . dlogits^T (V x nc), float32
        GemmCall h = base();
        h.a = weight_op();
        h.b = dl;
        h.d = static_cast<float*>(g.grad_hidden.data) + r0 * g.grad_hidden.row_stride;
        h.d_dtype = DType::kFloat32;
        h.m = p_.H;
        h.n = nc;
        h.ld_d = g.grad_hidden.row_stride;
        FUSEDCE_TRY(gemm(h));
      }
      if (g.grad_weight.data) {
        // grad_weight^T (H x V) (+)= hidden (H x nc) . dlogits (nc x V)
        GemmCall w = base();
        w.a = hidden_op(r0, nc);
        w.b = dl;
        w.transpose_b = true;
        w.m = p_.H;
        w.n = p_.V;
        w.beta = r0 == 0 ? 0.0f : 1.0f;
        if (p_.gw_acc) {
          w.d = ws_ + p_.gw;
          w.d_dtype = DType::kFloat32;
          w.ld_d = p_.H;
        } else {
          w.d = g.grad_weight.data;
          w.d_dtype = p_.dtype;
          w.ld_d = g.grad_weight.row_stride;
        }
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

 private:
  GemmCall base() const {
    GemmCall g{};
    g.workspace = ws_ + p_.gemm_ws;
    g.stream = stream_;
    g.device = c_.device.index;
    return g;
  }
  GemmOperand weight_op() const { return GemmOperand{c_.weight.data, p_.dtype, p_.H, p_.V, c_.weight.row_stride}; }
  GemmOperand hidden_op(int64_t r0, int64_t nc) const {
    const char* h = static_cast<const char*>(c_.hidden.data) + size_t(r0) * c_.hidden.row_stride * elem_size(p_.dtype);
    return GemmOperand{h, p_.dtype, p_.H, nc, c_.hidden.row_stride};  // H x nc
  }
  MatrixView chunk(int64_t nc) const { return matrix(ws_ + p_.logits, p_.dtype, nc, p_.V, p_.ld); }
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

  /// Logits of rows [r0, r0 + nc) into the buffer.
  Status logits(int64_t r0, int64_t nc) {
    GemmCall g = base();
    g.a = weight_op();
    g.transpose_a = true;
    g.b = hidden_op(r0, nc);
    g.d = ws_ + p_.logits;
    g.d_dtype = p_.dtype;
    g.m = p_.V;
    g.n = nc;
    g.ld_d = p_.ld;
    if (c_.bias.data) {
      g.bias = c_.bias.data;
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

  const detail::LogprobCall& c_;
  const Plan& p_;
  char* ws_;
  cudaStream_t stream_;
};

Status run_linear(const detail::LogprobCall& call) {
  if (call.bias.data != nullptr && call.bias.size > 1 && call.bias.stride != 1) {
    return Status(StatusCode::kInvalidArgument, "bias: the CUDA backend needs stride 1, got " + std::to_string(call.bias.stride));
  }
  const Plan plan = plan_of(call);
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  auto run = [&](char* ws) { return call.step == 1 ? LinearRun(call, plan, ws).stats() : LinearRun(call, plan, ws).backward(); };
  char* ws = static_cast<char*>(call.workspace.data);
  if (ws == nullptr) {
    void* scratch = nullptr;
    cudaError_t e = cudaMallocAsync(&scratch, plan.total, stream);
    if (e != cudaSuccess) return device_error(e, "allocating scratch (cudaMallocAsync)");
    Status s = run(static_cast<char*>(scratch));
    e = cudaFreeAsync(scratch, stream);
    if (s.ok() && e != cudaSuccess) return device_error(e, "freeing scratch (cudaFreeAsync)");
    return s;
  }
  if (call.workspace.bytes < plan.total) {
    return Status(StatusCode::kWorkspaceTooSmall, "workspace has " + std::to_string(call.workspace.bytes) +
                                                      " bytes, this call needs " + std::to_string(plan.total) +
                                                      " (ask linear_logprobs_workspace_size)");
  }
  return run(ws);
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
