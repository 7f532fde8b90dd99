// The CPU backend of fused linear cross-entropy: chunks of rows, never (N, V) at once.
//
// Rows whose target is ignored are dropped first. The rest go in chunks of rows whose float32
// logits fit the chunk budget; per chunk:
//   1. logits  Z (rows x V) = hidden_chunk . weight^T (+ bias): the products spread over the
//      pool by vocabulary blocks;
//   2. the row kernels of cross-entropy over logits (kernels_impl.h) read each row of Z once for
//      the forward statistics and turn it into dlogits in place in the same visit;
//   3. with gradients: grad_weight (+)= Z^T . hidden_chunk and grad_bias += column sums of Z, by
//      vocabulary blocks; grad_hidden = Z . weight, by blocks of hidden columns.
// FLOPs: 2NHV forward, 6NHV with every gradient, as PyTorch's unfused matmuls. The products
// are gemm() (OpenBLAS or the core's tile products); blocks are fixed by the shapes, and chunks
// add into grad_weight in row order, so results do not depend on the thread count.
// Extra memory: the chunk's logits (the budget), its hidden rows and grad_hidden in float32, and
// for 16-bit inputs a float32 copy of the weight and a float32 grad_weight accumulator. The
// vocabulary-parallel steps, and a low_memory call with a 16-bit weight, take the tiled path
// (linear_cpu_tiled.cpp) instead, which needs neither.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "common/call.h"
#include "common/constants.h"
#include "cpu/elements.h"
#include "cpu/forward_outputs.h"
#include "cpu/fresh_pages.h"
#include "cpu/gemm.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace fusedce {
namespace cpu {
namespace {

constexpr int64_t kVocabBlock = 256;   // vocabulary rows per product task
constexpr int64_t kRowBlock = 64;      // chunk rows per grad_hidden task
constexpr size_t kDefaultBudget = size_t(128) << 20;    // float32 logits of one chunk
// At most this many rows per chunk: grad_weight is then summed in two levels (within a chunk by
// the product, chunk after chunk into the output), which keeps its float32 error at or below
// PyTorch's single product over all rows (measured at 2048 x 256 x 8000 against float64:
// relative error 3.2e-7 with 256-row chunks, 2.5e-7 with 128, 3.9e-7 with one chunk of 2048;
// PyTorch 3.6e-7).
constexpr int64_t kMaxChunkRows = 256;
constexpr size_t kLowMemoryBudget = size_t(256) << 20;  // low_memory's cap on the same

/// A float32 matrix the products can read: the caller's, or a converted copy.
struct F32Matrix {
  const float* data = nullptr;
  int64_t ld = 0;
  std::vector<float> copy;
};

F32Matrix as_float32(const MatrixView& m, int threads) {
  F32Matrix f;
  if (m.dtype == DType::kFloat32) {
    f.data = static_cast<const float*>(m.data);
    f.ld = m.row_stride;
    return f;
  }
  f.copy.resize(m.rows * m.cols);
  parallel_for(m.rows, kVocabBlock, threads, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      for (int64_t h = 0; h < m.cols; ++h) f.copy[r * m.cols + h] = load_elem(m.data, m.dtype, r * m.row_stride + h);
    }
  });
  f.data = f.copy.data();
  f.ld = m.cols;
  return f;
}

/// Where grad_weight is accumulated: the caller's float32 output itself, or a float32 buffer
/// rounded into the 16-bit output once at the end.
struct GradWeightSink {
  float* data = nullptr;
  int64_t ld = 0;
  ScratchFloats acc;  // written by the first chunk, added to by the others
};

/// The call after dropping ignored rows: what every chunk needs.
struct Problem {
  const detail::LinearCall* call;
  int64_t H, V;
  std::vector<int64_t> rows;     // valid rows (target not ignored), in order
  std::vector<int64_t> targets;  // their targets
  std::vector<float> up;         // their upstream gradient (grad_loss), 1 when absent
  std::vector<float> weight;     // class weights, contiguous, or empty
  std::vector<float> bias;       // float32 bias, or empty
  double denominator = 0.0;
  RowArgs row;                   // the row kernels' arguments shared by every chunk
};

Status prepare(const detail::LinearCall& call, Problem* p) {
  const Options& o = call.options;
  const int64_t N = call.hidden.rows, V = call.weight.rows;
  p->call = &call;
  p->H = call.hidden.cols;
  p->V = V;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = detail::linear_target(call, i);
    if (t == o.ignore_index) continue;
    if (t < 0 || t >= V) {
      return Status(StatusCode::kTargetOutOfRange, "target[" + std::to_string(call.linear.shift_seq_len > 0 ? i + 1 : i) +
                                                       "] = " + std::to_string(t) + " is out of range [0, " +
                                                       std::to_string(V) + ") and is not ignore_index (" +
                                                       std::to_string(o.ignore_index) + ")");
    }
    p->rows.push_back(i);
    p->targets.push_back(t);
  }
  double weight_sum = static_cast<double>(V);
  if (!o.class_weight.empty()) {
    p->weight.resize(V);
    weight_sum = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      p->weight[j] = static_cast<const float*>(o.class_weight.data)[j * o.class_weight.stride];
      weight_sum += p->weight[j];
    }
  }
  for (int64_t t : p->targets) p->denominator += p->weight.empty() ? 1.0 : p->weight[t];
  if (!call.bias.empty()) {
    p->bias.resize(V);
    for (int64_t j = 0; j < V; ++j) p->bias[j] = load_elem(call.bias.data, call.bias.dtype, j * call.bias.stride);
  }
  const VectorView& gl = call.grad_loss;
  p->up.assign(p->rows.size(), 1.0f);
  if (!gl.empty()) {
    for (size_t i = 0; i < p->rows.size(); ++i) {
      p->up[i] = static_cast<const float*>(gl.data)[(o.reduction == Reduction::kNone ? p->rows[i] : 0) * gl.stride];
    }
  }

  RowArgs& a = p->row;
  a = RowArgs{};
  a.dtype = DType::kFloat32;
  a.vocab = V;
  a.logits_stride = V;
  a.target_dtype = DType::kInt64;
  a.target_stride = 1;
  a.ignore_index = o.ignore_index;
  a.class_weight = p->weight.empty() ? nullptr : p->weight.data();
  a.c = detail::make_loss_constants(o, V, static_cast<float>(weight_sum));
  a.softcap = o.softcap > 0.0f;
  a.smoothing = o.label_smoothing != 0.0f;
  a.metrics = o.return_metrics;
  a.forward = true;
  a.gradient = call.job == Job::kForwardBackward;
  a.grad_stride = 1;
  a.grad_scalar = false;
  a.g_chain = o.reduction == Reduction::kMean ? static_cast<float>(1.0 / p->denominator) : 1.0f;
  a.dlogits_stride = V;
  return Status::Ok();
}

/// Rows per chunk: as many as the budget's float32 logits hold (at most kMaxChunkRows), at
/// least one.
int64_t chunk_rows(const detail::LinearCall& call, int64_t V, int64_t M) {
  size_t budget = call.linear.chunk_budget_bytes ? call.linear.chunk_budget_bytes : kDefaultBudget;
  if (call.linear.low_memory) budget = std::min(budget, kLowMemoryBudget);
  const int64_t rows = static_cast<int64_t>(budget / (size_t(V) * sizeof(float)));
  return std::max<int64_t>(1, std::min({rows, M, kMaxChunkRows}));
}

}  // namespace

Status run_linear_tiled(const detail::LinearCall& call);  // linear_cpu_tiled.cpp

Status run_linear(const detail::LinearCall& call) {
  if (call.shard_step != 0 || (call.linear.low_memory && call.weight.dtype != DType::kFloat32)) {
    return run_linear_tiled(call);
  }
  const Options& o = call.options;
  const int64_t N = call.hidden.rows, H = call.hidden.cols, V = call.weight.rows;
  const int threads = call.device.num_threads;
  Problem p;
  Status s = prepare(call, &p);
  if (!s.ok()) return s;
  const GemmOps gemm_ops = gemm();
  const bool backward = call.job == Job::kForwardBackward;
  const LinearGrads& g = call.grads;
  const bool want_gw = backward && !g.grad_weight.empty(), want_gb = backward && !g.grad_bias.empty();
  const bool want_gh = backward && !g.grad_hidden.empty();

  const int64_t M = static_cast<int64_t>(p.rows.size());
  const int64_t rows_per_chunk = chunk_rows(call, V, M);
  const int64_t hidden_block = grad_hidden_block(H);
  const int64_t vblocks = (V + kVocabBlock - 1) / kVocabBlock, hblocks = (H + hidden_block - 1) / hidden_block;
  const F32Matrix W = as_float32(call.weight, threads);
  GradWeightSink gw;
  if (want_gw) {
    if (g.grad_weight.dtype == DType::kFloat32) {
      gw.data = static_cast<float*>(g.grad_weight.data);
      gw.ld = g.grad_weight.row_stride;
    } else {
      gw.acc = ScratchFloats(M > 0 ? V * H : 0);
      gw.data = gw.acc.data();
      gw.ld = H;
    }
    if (M > 0) fault_in_fresh(gw.data, V, H, gw.ld, threads);
  }
  std::vector<float> gb(want_gb ? V : 0, 0.0f);
  std::vector<float> lse(M), loss_row(M), entropy(o.return_metrics ? M : 0);
  std::vector<uint8_t> correct(o.return_metrics ? M : 0);
  ScratchFloats z(M > 0 ? rows_per_chunk * V : 0);
  std::vector<float> hc(rows_per_chunk * H), ghc(want_gh ? rows_per_chunk * H : 0);

  for (int64_t i0 = 0; i0 < M; i0 += rows_per_chunk) {
    const int64_t mc = std::min(rows_per_chunk, M - i0);
    for (int64_t r = 0; r < mc; ++r) {
      const int64_t base = p.rows[i0 + r] * call.hidden.row_stride;
      for (int64_t h = 0; h < H; ++h) hc[r * H + h] = load_elem(call.hidden.data, call.hidden.dtype, base + h);
    }
    // 1. logits (+ bias)
    parallel_for(vblocks, 1, threads, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t v0 = blk * kVocabBlock, vb = std::min(kVocabBlock, V - v0);
        gemm_ops.nt(mc, vb, H, hc.data(), H, W.data + v0 * W.ld, W.ld, z.data() + v0, V);
        if (!p.bias.empty()) {
          for (int64_t r = 0; r < mc; ++r) {
            float* zr = z.data() + r * V + v0;
            for (int64_t v = 0; v < vb; ++v) zr[v] += p.bias[v0 + v];
          }
        }
      }
    });
    // 2. the cross-entropy rows: statistics, and dlogits in place of the logits
    RowArgs a = p.row;
    a.logits = reinterpret_cast<const char*>(z.data());
    a.dlogits = reinterpret_cast<char*>(z.data());
    a.target = p.targets.data() + i0;
    a.grad_loss = p.up.data() + i0;
    a.row_loss = loss_row.data() + i0;
    a.row_lse = lse.data() + i0;
    a.row_entropy = o.return_metrics ? entropy.data() + i0 : nullptr;
    a.row_correct = o.return_metrics ? correct.data() + i0 : nullptr;
    run_rows(a, mc, threads);
    if (!backward) continue;
    // 3. grad_weight and grad_bias by vocabulary blocks (chunks add in row order), grad_hidden
    // by hidden blocks.
    if (want_gw || want_gb) {
      parallel_for(vblocks, 1, threads, [&](int64_t b, int64_t e) {
        for (int64_t blk = b; blk < e; ++blk) {
          const int64_t v0 = blk * kVocabBlock, vb = std::min(kVocabBlock, V - v0);
          if (want_gw) gemm_ops.tn(vb, H, mc, z.data() + v0, V, hc.data(), H, gw.data + v0 * gw.ld, gw.ld, i0 > 0);
          if (want_gb) {
            for (int64_t r = 0; r < mc; ++r) {
              const float* zr = z.data() + r * V + v0;
              for (int64_t v = 0; v < vb; ++v) gb[v0 + v] += zr[v];
            }
          }
        }
      });
    }
    if (want_gh) {
      // Tasks of kRowBlock rows x hidden_block columns (grad_hidden_block), so that a narrow
      // hidden size still fills the pool; each output element is one product's sum over V,
      // whatever the split.
      const int64_t rblocks = (mc + kRowBlock - 1) / kRowBlock;
      parallel_for(rblocks * hblocks, 1, threads, [&](int64_t b, int64_t e) {
        for (int64_t blk = b; blk < e; ++blk) {
          const int64_t r0 = (blk / hblocks) * kRowBlock, rb = std::min(kRowBlock, mc - r0);
          const int64_t h0 = (blk % hblocks) * hidden_block, hb = std::min(hidden_block, H - h0);
          gemm_ops.nn(rb, hb, V, z.data() + r0 * V, V, W.data + h0, W.ld, ghc.data() + r0 * H + h0, H, false);
        }
      });
      const MatrixView& gh = g.grad_hidden;
      for (int64_t r = 0; r < mc; ++r) {
        const int64_t base = p.rows[i0 + r] * gh.row_stride;
        for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, base + h, ghc[r * H + h]);
      }
    }
  }

  // ---- forward outputs
  write_forward_outputs(call.out, o, p.denominator, N, ComputedRows{p.rows, loss_row, lse, correct, entropy});
  if (!backward) return Status::Ok();

  // ---- what the chunks did not write: the rows of ignored targets, an empty batch's
  // grad_weight, a 16-bit grad_weight's rounding, grad_bias.
  if (want_gh) {
    const MatrixView& gh = g.grad_hidden;
    int64_t next = 0;
    for (int64_t i = 0; i < N; ++i) {
      if (next < M && p.rows[next] == i) {
        ++next;
        continue;
      }
      for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, i * gh.row_stride + h, 0.0f);
    }
  }
  if (want_gw && (M == 0 || gw.acc.data() != nullptr)) {
    const MatrixView& w = g.grad_weight;
    parallel_for(V, kVocabBlock, threads, [&](int64_t b, int64_t e) {
      for (int64_t v = b; v < e; ++v) {
        for (int64_t h = 0; h < H; ++h) store_elem(w.data, w.dtype, v * w.row_stride + h, M == 0 ? 0.0f : gw.data[v * gw.ld + h]);
      }
    });
  }
  if (want_gb) {
    for (int64_t v = 0; v < V; ++v) store_elem(g.grad_bias.data, g.grad_bias.dtype, v * g.grad_bias.stride, gb[v]);
  }
  return Status::Ok();
}

}  // namespace cpu
}  // namespace fusedce
