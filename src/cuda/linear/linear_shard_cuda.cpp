// The CUDA backend of the vocabulary-parallel linear steps (vocab_parallel.h): the linear
// cross-entropy over this rank's rows of the head, never storing more than one chunk of logits.
//   step 1, per chunk of positions: logits chunk (rows, V_local) = hidden_chunk . weight^T
//     (+ bias), cuBLASLt, in the input dtype; the shard statistics kernel folds it into the rows'
//     statistics (written in place in the (N + 1, 9) output: each chunk's extra row is the next
//     chunk's first, and the last chunk's is row N, the shard's class-weight sum).
//   step 3, per vocabulary slice (the whole shard; with low_memory, slices whose float32
//     grad_weight accumulator stays within kSliceAccBytes) and chunk of positions: the logits
//     again, the shard backward kernel turns them into dlogits in place from the merged lse (a
//     sum's or mean's upstream gradient left to the products' float32 alpha, as in
//     linear_cuda.cpp: linear.h's ProductScaleParams), then
//     grad_hidden (float32, this rank's part) += dlogits . weight_slice, grad_weight_slice (+)=
//     dlogits^T . hidden_chunk (float32 accumulation, rounded once), grad_bias likewise.
// Positions are the rows, unless the call shifts or skips: then the whole-vocabulary path's
// prepare kernel first writes every row's effective target (the causal shift) and the positions
// (with skip_ignored, the rows whose effective target is not ignored). skip_ignored reads their
// count on the host, the one wait of the call, and each chunk gathers its positions' hidden rows
// and targets into dense blocks: step 1 scatters the chunk's statistics rows back to their rows
// (the rows of ignored targets stay zeros, which the merge never reads); step 3 gathers the
// rows' lse, target weight and upstream gradient as well, and adds the chunk's grad_hidden rows
// into theirs (cleared first: an ignored row's gradient is 0). On a stream that is capturing a
// CUDA graph nothing may wait, so every row is a position there: the same results, all rows'
// products. Otherwise no host synchronisation.
// chunk_budget_bytes bounds the logit buffer (input dtype) as in linear_cuda.cpp, with the same
// default; low_memory keeps the buffer and the accumulators under 512 MiB.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common/call.h"
#include "common/constants.h"
#include "cuda/host_util.h"
#include "cuda/linear/gemm.h"
#include "cuda/linear/head_ops.h"
#include "cuda/linear/linear.h"

namespace fusedce {
namespace cuda {
namespace {

int64_t round_up(int64_t n, int64_t q) { return (n + q - 1) / q * q; }

/// low_memory: the logit buffer and the largest float32 grad_weight slice accumulator.
constexpr size_t kLowMemoryBudget = size_t(256) << 20;
constexpr size_t kSliceAccBytes = size_t(128) << 20;

/// What the prepare kernel leaves for the host and the chunks.
struct PrepareScalars {
  int64_t count;    // positions
  int64_t bad_row;  // not read here: the front end checks the targets of a shard
  float denom;      // not read here: the merge forms the mean's denominator
};

struct ShardPlan {
  int64_t N, H, V;
  DType dtype;
  int64_t slice;      // vocabulary columns per slice (step 3; V for step 1)
  int64_t ld;         // row stride of a logits chunk: the slice rounded up to 16 bytes
  int64_t rows;       // positions per chunk
  bool gw_acc;        // grad_weight through a float32 slice accumulator (16-bit, several chunks)
  bool prepare;       // shift or skip_ignored: effective targets and positions (prepare kernel)
  bool gather;        // skip_ignored: room for a chunk's rows gathered into dense blocks
  size_t gemm_ws, logits, ones, gw, gb;
  size_t scale;  // step 3: ProductScaleParams' out (4 floats)
  size_t eff, idx, scalars;                     // prepare: (N,) int64 each, PrepareScalars
  size_t hid, tgt, stats, lse, row_weight, grad, gh;  // gather: one chunk's dense blocks
  size_t total;
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
  const bool want_gh = backward && c.grads.grad_hidden.data != nullptr;
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
  p.scale = backward ? take(4 * sizeof(float)) : 0;
  p.prepare = c.linear.shift_seq_len > 0 || c.linear.skip_ignored;
  p.gather = c.linear.skip_ignored;
  if (p.prepare) {
    p.eff = take(size_t(p.N) * 8);
    p.idx = take(size_t(p.N) * 8);
    p.scalars = take(sizeof(PrepareScalars));
  }
  if (p.gather) {
    const size_t rows = size_t(p.rows);
    p.hid = take(rows * size_t(p.H) * el);
    p.tgt = take(rows * 8);
    if (!backward) {
      p.stats = take((rows + 1) * kShardStatsWidth * 4);
    } else {
      p.lse = take(rows * 4);
      p.row_weight = take(rows * 4);
      p.grad = c.options.reduction == Reduction::kNone ? take(rows * 4) : 0;
      p.gh = want_gh ? take(rows * size_t(p.H) * 4) : 0;
    }
  }
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
    float* out = static_cast<float*>(c_.stats.data);
    if (p_.N > 0) FUSEDCE_TRY(prepare());
    if (compact_) {
      const cudaError_t e = cudaMemsetAsync(out, 0, size_t(p_.N + 1) * kShardStatsWidth * 4, stream_);
      if (e != cudaSuccess) return device_error(e, "clearing the statistics of the skipped rows");
    }
    float* dense = reinterpret_cast<float*>(ws_ + p_.stats);
    for (int64_t p0 = 0; p0 == 0 || p0 < positions_; p0 += p_.rows) {
      const int64_t nc = std::min(p_.rows, positions_ - p0);
      Chunk ch;
      FUSEDCE_TRY(chunk_inputs(p0, nc, &ch));
      if (nc > 0) FUSEDCE_TRY(logits(ch.hidden, nc, 0, p_.V, true));
      // Rows [p0, p0 + nc] of the output (row p0 + nc is the next chunk's first, or row N); with
      // compaction, of the dense block, whose rows then go to their rows and whose extra row is
      // the class-weight sum of row N.
      float* dst = compact_ ? dense : out + p0 * kShardStatsWidth;
      FUSEDCE_TRY(cross_entropy_shard_stats(c_.device, chunk(nc, p_.V), ch.target, c_.shard, c_.options,
                                            matrix(dst, DType::kFloat32, nc + 1, kShardStatsWidth)));
      if (compact_) {
        launch_row_scatter(RowScatterParams{idx(), p0, nc, dense, kShardStatsWidth, out, kShardStatsWidth, false},
                           stream_);
        FUSEDCE_TRY(last_error("scattering a chunk's statistics"));
        const cudaError_t e = cudaMemcpyAsync(out + p_.N * kShardStatsWidth, dense + nc * kShardStatsWidth,
                                              kShardStatsWidth * 4, cudaMemcpyDeviceToDevice, stream_);
        if (e != cudaSuccess) return device_error(e, "copying the class-weight sum");
      }
      if (positions_ == 0) break;
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
    FUSEDCE_TRY(prepare());
    launch_product_scale(ProductScaleParams{static_cast<const float*>(c_.grad_loss.data),
                                            static_cast<int>(c_.options.reduction),
                                            static_cast<const float*>(c_.batch.data), scale()},
                         stream_);
    FUSEDCE_TRY(last_error("the product-scale kernel"));
    if (compact_ && g.grad_hidden.data) {
      const cudaError_t e = cudaMemset2DAsync(g.grad_hidden.data, size_t(g.grad_hidden.row_stride) * 4, 0,
                                              size_t(p_.H) * 4, size_t(p_.N), stream_);
      if (e != cudaSuccess) return device_error(e, "clearing grad_hidden");
    }
    if (positions_ == 0) return clear_grads();
    for (int64_t v0 = 0; v0 < p_.V; v0 += p_.slice) {
      const int64_t vs = std::min(p_.slice, p_.V - v0);
      for (int64_t p0 = 0; p0 < positions_; p0 += p_.rows) {
        const int64_t nc = std::min(p_.rows, positions_ - p0);
        Chunk ch;
        FUSEDCE_TRY(chunk_inputs(p0, nc, &ch));
        FUSEDCE_TRY(logits(ch.hidden, nc, v0, vs, true));
        const MatrixView L = chunk(nc, vs);
        ShardSpec sub = c_.shard;
        sub.vocab_start += v0;
        Options o = c_.options;
        // A sum's or mean's dlogits carry the product-scale kernel's row factor alone: a sum over
        // one upstream gradient, that factor (row_inputs).
        if (o.reduction != Reduction::kNone) o.reduction = Reduction::kSum;
        if (!o.class_weight.empty()) {
          o.class_weight.data = static_cast<float*>(o.class_weight.data) + v0 * o.class_weight.stride;
          o.class_weight.size = vs;
        }
        RowInputs in;
        FUSEDCE_TRY(row_inputs(p0, nc, &in));
        FUSEDCE_TRY(cross_entropy_shard_backward(c_.device, L, ch.target, sub, o, in.lse, in.row_weight, c_.batch,
                                                 in.grad_loss, L));
        const GemmOperand dl{ws_ + p_.logits, p_.dtype, vs, nc, p_.ld};  // dlogits^T: vs x nc
        const GemmOperand wslice = weight_op(v0, vs);
        if (g.grad_hidden.data) {
          // grad_hidden^T (H x nc) (+)= weight_slice (H x vs) . dlogits^T (vs x nc), float32; with
          // compaction into the dense block, whose rows are then added to their rows.
          GemmCall h = grad_base();
          h.a = wslice;
          h.b = dl;
          h.d_dtype = DType::kFloat32;
          h.m = p_.H;
          h.n = nc;
          if (compact_) {
            h.d = ws_ + p_.gh;
            h.ld_d = p_.H;
            h.beta = 0.0f;
          } else {
            h.d = static_cast<float*>(g.grad_hidden.data) + p0 * g.grad_hidden.row_stride;
            h.ld_d = g.grad_hidden.row_stride;
            h.beta = v0 == 0 ? 0.0f : 1.0f;
          }
          FUSEDCE_TRY(gemm(h));
          if (compact_) {
            launch_row_scatter(RowScatterParams{idx(), p0, nc, reinterpret_cast<const float*>(ws_ + p_.gh), p_.H,
                                                static_cast<float*>(g.grad_hidden.data), g.grad_hidden.row_stride,
                                                true},
                               stream_);
            FUSEDCE_TRY(last_error("adding a chunk's grad_hidden rows"));
          }
        }
        if (g.grad_weight.data) {
          // grad_weight_slice^T (H x vs) (+)= hidden (H x nc) . dlogits (nc x vs)
          GemmCall w = grad_base();
          w.a = ch.hidden;
          w.b = dl;
          w.transpose_b = true;
          w.m = p_.H;
          w.n = vs;
          w.beta = p0 == 0 ? 0.0f : 1.0f;
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
          GemmCall b = grad_base();
          b.a = dl;
          b.b = GemmOperand{ws_ + p_.ones, p_.dtype, nc, 1, nc};
          b.d = reinterpret_cast<float*>(ws_ + p_.gb) + v0;
          b.d_dtype = DType::kFloat32;
          b.m = vs;
          b.n = 1;
          b.ld_d = vs;
          b.beta = p0 == 0 ? 0.0f : 1.0f;
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
  /// A chunk of positions as the products and the shard kernels take it.
  struct Chunk {
    GemmOperand hidden;  // H x nc
    VectorView target;   // (nc,) global targets
  };
  /// A chunk's merged row statistics and upstream gradient, as the shard backward takes them.
  struct RowInputs {
    VectorView lse, row_weight, grad_loss;
  };

  int64_t* eff() const { return reinterpret_cast<int64_t*>(ws_ + p_.eff); }
  float* scale() const { return reinterpret_cast<float*>(ws_ + p_.scale); }
  int64_t* idx() const { return reinterpret_cast<int64_t*>(ws_ + p_.idx); }
  PrepareScalars* scalars() const { return reinterpret_cast<PrepareScalars*>(ws_ + p_.scalars); }

  /// The positions: every row, unless the call shifts or skips (see the top of the file). Sets
  /// positions_ and compact_.
  Status prepare() {
    positions_ = p_.N;
    compact_ = false;
    if (!p_.prepare) return Status::Ok();
    bool compact = p_.gather;
    if (compact) {
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      const cudaError_t e = cudaStreamIsCapturing(stream_, &capture);
      if (e != cudaSuccess) return device_error(e, "asking whether the stream is capturing a CUDA graph");
      compact = capture == cudaStreamCaptureStatusNone;
    }
    // No class weights: they are a local slice, which the kernel would index by global targets
    // (the merge weighs the rows).
    LinearPrepareParams q = prepare_params(c_.target, p_.N, c_.linear.shift_seq_len, c_.options.ignore_index,
                                           c_.shard.vocab_total, compact);
    q.eff_target = eff();
    q.idx = idx();
    q.count = &scalars()->count;
    q.denom = &scalars()->denom;
    q.bad_row = &scalars()->bad_row;
    q.weight_sum = nullptr;
    launch_linear_prepare(q, stream_);
    FUSEDCE_TRY(last_error("the prepare kernel"));
    if (!compact) return Status::Ok();
    int64_t count = 0;
    cudaError_t e = cudaMemcpyAsync(&count, &scalars()->count, sizeof(count), cudaMemcpyDeviceToHost, stream_);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream_);
    if (e != cudaSuccess) return device_error(e, "reading the count of rows to compute");
    positions_ = count;
    compact_ = true;
    return Status::Ok();
  }

  /// Positions [p0, p0 + nc): their hidden rows and targets, gathered into the dense blocks when
  /// compacting.
  Status chunk_inputs(int64_t p0, int64_t nc, Chunk* ch) {
    if (!compact_) {
      ch->hidden = hidden_op(p0, nc);
      ch->target = target_at(p0, nc);
      return Status::Ok();
    }
    LinearGatherParams q{};
    q.eff_target = eff();
    q.idx = idx();
    q.p0 = p0;
    q.n = nc;
    q.hidden = c_.hidden.data;
    q.hidden_stride = c_.hidden.row_stride;
    q.H = p_.H;
    q.dtype = p_.dtype;
    q.target_out = reinterpret_cast<int64_t*>(ws_ + p_.tgt);
    q.hidden_out = ws_ + p_.hid;
    q.ignore_index = c_.options.ignore_index;
    launch_linear_gather(q, stream_);
    FUSEDCE_TRY(last_error("gathering a chunk's rows"));
    ch->hidden = GemmOperand{ws_ + p_.hid, p_.dtype, p_.H, nc, p_.H};
    ch->target = vector(ws_ + p_.tgt, DType::kInt64, nc);
    return Status::Ok();
  }

  /// Positions [p0, p0 + nc): their lse, target weight and upstream gradient (reduction none:
  /// the rows'; else the product-scale kernel's row factor, as a sum's (1,) gradient).
  Status row_inputs(int64_t p0, int64_t nc, RowInputs* in) {
    const bool per_row = c_.options.reduction == Reduction::kNone;
    const VectorView row_factor = vector(scale() + 3, DType::kFloat32, 1);
    if (!compact_) {
      in->lse = slice_of(c_.lse_in, p0, nc);
      in->row_weight = slice_of(c_.row_weight, p0, nc);
      in->grad_loss = per_row ? slice_of(c_.grad_loss, p0, nc) : row_factor;
      return Status::Ok();
    }
    ShardGatherParams q{};
    q.idx = idx();
    q.p0 = p0;
    q.n = nc;
    q.lse = static_cast<const float*>(c_.lse_in.data);
    q.lse_stride = c_.lse_in.stride;
    q.lse_out = reinterpret_cast<float*>(ws_ + p_.lse);
    q.row_weight = static_cast<const float*>(c_.row_weight.data);
    q.row_weight_stride = c_.row_weight.stride;
    q.row_weight_out = reinterpret_cast<float*>(ws_ + p_.row_weight);
    if (per_row) {
      q.grad_loss = static_cast<const float*>(c_.grad_loss.data);
      q.grad_stride = c_.grad_loss.stride;
      q.grad_out = reinterpret_cast<float*>(ws_ + p_.grad);
    }
    launch_shard_gather(q, stream_);
    FUSEDCE_TRY(last_error("gathering a chunk's row statistics"));
    in->lse = vector(q.lse_out, DType::kFloat32, nc);
    in->row_weight = vector(q.row_weight_out, DType::kFloat32, nc);
    in->grad_loss = per_row ? vector(q.grad_out, DType::kFloat32, nc) : row_factor;
    return Status::Ok();
  }

  GemmCall base() const { return gemm_on(ws_ + p_.gemm_ws, stream_, c_.device.index); }
  /// A gradient product: scaled by the upstream gradient the dlogits do not carry.
  GemmCall grad_base() const {
    GemmCall g = base();
    g.scale = scale();
    return g;
  }
  GemmOperand weight_op(int64_t v0, int64_t vs) const { return rows_operand(c_.weight, v0, vs); }  // H x vs
  GemmOperand hidden_op(int64_t r0, int64_t nc) const { return rows_operand(c_.hidden, r0, nc); }  // H x nc
  MatrixView chunk(int64_t nc, int64_t vs) const { return matrix(ws_ + p_.logits, p_.dtype, nc, vs, p_.ld); }
  /// The targets of rows [r0, r0 + nc): the effective ones when the prepare kernel ran.
  VectorView target_at(int64_t r0, int64_t nc) const {
    if (p_.prepare) return vector(eff() + r0, DType::kInt64, nc);
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

  /// Logits of the chunk's nc rows of `hidden` over the local columns [v0, v0 + vs), into the buffer.
  Status logits(const GemmOperand& hidden, int64_t nc, int64_t v0, int64_t vs, bool with_bias) {
    GemmCall g = base();
    g.a = weight_op(v0, vs);
    g.transpose_a = true;
    g.b = hidden;
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

  /// No positions: zero gradients (grad_hidden is cleared by the caller where it has rows).
  Status clear_grads() {
    return clear_head_grads(c_.grads, p_.V, p_.H, p_.dtype, reinterpret_cast<float*>(ws_ + p_.gb), stream_);
  }

  const detail::LinearCall& c_;
  const ShardPlan& p_;
  char* ws_;
  cudaStream_t stream_;
  int64_t positions_ = 0;  // rows that enter the products (prepare)
  bool compact_ = false;   // positions are the kept rows, gathered per chunk
};

}  // namespace

size_t linear_shard_workspace_size(const detail::LinearCall& call) { return plan_shard(call).total; }

Status run_linear_shard(const detail::LinearCall& call) {
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
