// The CPU linear path by float32 tiles, a few per thread: the vocabulary-parallel steps, and
// low_memory with a 16-bit weight (the chunked path of linear_cpu.cpp would need a float32 copy
// of that weight and a float32 grad_weight accumulator; this one needs neither).
//
// Rows whose target is ignored are dropped first; the rest go in chunks of kRows rows against
// vocabulary tiles of kCols rows of weight, both converted to float32 tiles that stay in cache.
// Phase 1 (parallel over row chunks) forms each logit tile and folds it into the rows' online
// log-sum-exp, smoothing sum, argmax and entropy terms. With gradients, phase 2 (parallel over
// vocabulary tiles) re-forms the tiles, turns them into dlogits tiles and accumulates grad_weight
// and grad_bias in float32 per tile; phase 3 (parallel over row chunks) re-forms them again for
// grad_hidden. Every sum runs in a fixed order, so results do not depend on the thread count.
// The vocabulary-parallel steps (LinearCall::shard_step) run the same phases over a shard of the
// weight: phase 1 writes the rows' shard statistics instead of the loss; the gradient phases
// take the merged lse, target weights and batch scalars from the caller.
// FLOPs: 2NHV for the forward, 10NHV with every gradient (tiles re-formed twice).
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/call.h"
#include "common/constants.h"
#include "cpu/elements.h"
#include "cpu/forward_outputs.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace fusedce {
namespace cpu {
namespace {

constexpr int64_t kRows = 16;   // rows per chunk
constexpr int64_t kCols = 128;  // vocabulary entries per tile

TileKernels tiles() { return best_tile_kernels(); }

/// Rows [r0, r0 + n) of a matrix as float32, row-major with H columns.
void load_rows(const MatrixView& m, const int64_t* rows, int64_t n, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t base = rows[r] * m.row_stride;
    for (int64_t h = 0; h < m.cols; ++h) out[r * m.cols + h] = load_elem(m.data, m.dtype, base + h);
  }
}

void load_range(const MatrixView& m, int64_t r0, int64_t n, float* out) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t base = (r0 + r) * m.row_stride;
    for (int64_t h = 0; h < m.cols; ++h) out[r * m.cols + h] = load_elem(m.data, m.dtype, base + h);
  }
}

/// The per-call problem after dropping ignored rows. For a vocabulary shard, V is the shard's
/// columns and targets are local (target - vocab_start: outside [0, V) when another shard holds
/// the target, which then never matches a column).
struct Problem {
  const detail::LinearCall* call;
  int64_t H, V;
  int64_t offset = 0;            // global index of the first column (vocabulary shard)
  std::vector<int64_t> rows;     // valid rows (target not ignored), in order
  std::vector<int64_t> targets;  // their targets, local to the columns
  std::vector<float> weight;     // class weights, contiguous, or empty
  detail::LossConstants c;
  bool softcap, smoothing, metrics;
  TileKernels k;
};

/// A logit tile for rows [i0, i0 + rc) of the valid rows and vocabulary [v0, v0 + vt): z values.
void form_z(const Problem& p, const float* hid, const float* wt, int64_t rc, int64_t v0, int64_t vt, float* z) {
  p.k.logits(hid, wt, rc, vt, p.H, z);
  const VectorView& bias = p.call->bias;
  for (int64_t r = 0; r < rc; ++r) {
    for (int64_t v = 0; v < vt; ++v) {
      float x = z[r * vt + v];
      if (!bias.empty()) x += load_elem(bias.data, bias.dtype, (v0 + v) * bias.stride);
      z[r * vt + v] = detail::transform_logit(x, p.c, p.softcap);
    }
  }
}

struct RowState {
  detail::LseAccum st = detail::lse_accum_empty();  // tiles fold in double: no compounding over V
  double smooth = 0.0;
  float z_target = NAN;
  float best = -INFINITY;
  int64_t argmax = 0;
  bool first = true;
};

void fold_tile(const Problem& p, const float* z, int64_t rc, int64_t v0, int64_t vt, const int64_t* tg,
               RowState* rs) {
  for (int64_t r = 0; r < rc; ++r) {
    RowState& s = rs[r];
    const float* zr = z + r * vt;
    float m = -INFINITY;
    for (int64_t v = 0; v < vt; ++v) m = zr[v] > m ? zr[v] : m;
    const float ref = detail::lse_ref(m);
    float sum = 0.0f, ez = 0.0f;
    for (int64_t v = 0; v < vt; ++v) {
      const float e = std::exp(zr[v] - ref);
      sum += e;
      if (p.metrics && e > 0.0f) ez += e * zr[v];
    }
    detail::lse_accum_add(s.st, detail::LseState{m, sum, ez});
    if (tg[r] >= v0 && tg[r] < v0 + vt) s.z_target = zr[tg[r] - v0];
    if (p.smoothing) {
      for (int64_t v = 0; v < vt; ++v) s.smooth += p.weight.empty() ? zr[v] : p.weight[v0 + v] * zr[v];
    }
    if (p.metrics) {
      for (int64_t v = 0; v < vt; ++v) {
        // torch.argmax: the first NaN, else the first maximum.
        const float x = zr[v];
        if (s.first || (!(x <= s.best) && s.best == s.best)) {
          s.best = x;
          s.argmax = v0 + v;
          s.first = false;
        }
      }
    }
  }
}

/// dlogits tile (w.r.t. the raw logit x) from z, in place.
void grad_tile(const Problem& p, float* z, int64_t rc, int64_t v0, int64_t vt, const int64_t* tg, const float* lse,
               const detail::RowGrad* rg) {
  for (int64_t r = 0; r < rc; ++r) {
    float* zr = z + r * vt;
    for (int64_t v = 0; v < vt; ++v) {
      const float w = p.weight.empty() ? 1.0f : p.weight[v0 + v];
      const float pj = std::exp(zr[v] - lse[r]);
      float d = rg[r].g_a * pj - rg[r].g_c * w;
      if (v0 + v == tg[r]) d -= rg[r].g_bt;
      zr[v] = d * detail::dz_dx(zr[v], p.c, p.softcap);
    }
  }
}

}  // namespace

TileKernels best_tile_kernels() {
#if defined(FUSEDCE_HAVE_AVX2_KERNELS)
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                          __builtin_cpu_supports("f16c");
  if (has) return avx2::tile_kernels();
#endif
  return generic::tile_kernels();
}

namespace {

float float_at(const VectorView& v, int64_t i) { return static_cast<const float*>(v.data)[i * v.stride]; }

/// Valid rows, local targets, class weights and constants of a call; errors name the target.
Status build_problem(const detail::LinearCall& call, Problem* pp) {
  Problem& p = *pp;
  const Options& o = call.options;
  const bool sharded = call.shard_step != 0;
  const int64_t N = call.hidden.rows, V = call.weight.rows;
  const int64_t total = sharded ? call.shard.vocab_total : V;
  p.call = &call;
  p.H = call.hidden.cols;
  p.V = V;
  p.offset = sharded ? call.shard.vocab_start : 0;
  p.k = tiles();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = detail::linear_target(call, i);
    if (t == o.ignore_index) continue;
    if (t < 0 || t >= total) {
      return Status(StatusCode::kTargetOutOfRange, "target[" + std::to_string(call.linear.shift_seq_len > 0 ? i + 1 : i) +
                                                       "] = " + std::to_string(t) + " is out of range [0, " +
                                                       std::to_string(total) + ") and is not ignore_index (" +
                                                       std::to_string(o.ignore_index) + ")");
    }
    p.rows.push_back(i);
    p.targets.push_back(t - p.offset);
  }
  if (!o.class_weight.empty()) {
    p.weight.resize(V);
    for (int64_t j = 0; j < V; ++j) p.weight[j] = float_at(o.class_weight, j);
  }
  p.softcap = o.softcap > 0.0f;
  p.smoothing = o.label_smoothing != 0.0f;
  p.metrics = o.return_metrics;
  return Status::Ok();
}

/// Sum of the (local) class weights, or V without weights.
double weight_sum_of(const Problem& p) {
  if (p.weight.empty()) return static_cast<double>(p.V);
  double w = 0.0;
  for (float x : p.weight) w += x;
  return w;
}

/// The local target's class weight (1 unweighted); 0 when the target lies in another shard.
float target_weight(const Problem& p, int64_t tl) {
  if (p.weight.empty()) return 1.0f;
  return tl >= 0 && tl < p.V ? p.weight[tl] : 0.0f;
}

/// Phase 1 (parallel over row chunks): every valid row's statistics over the columns.
std::vector<RowState> row_statistics(const Problem& p) {
  const detail::LinearCall& call = *p.call;
  const int64_t M = static_cast<int64_t>(p.rows.size()), H = p.H, V = p.V;
  const int64_t chunks = (M + kRows - 1) / kRows, tiles_n = (V + kCols - 1) / kCols;
  std::vector<RowState> rs(M);
  parallel_for(chunks, 1, call.device.num_threads, [&](int64_t b, int64_t e) {
    std::vector<float> hid(kRows * H), wt(kCols * H), z(kRows * kCols);
    for (int64_t ch = b; ch < e; ++ch) {
      const int64_t i0 = ch * kRows, rc = std::min(kRows, M - i0);
      load_rows(call.hidden, p.rows.data() + i0, rc, hid.data());
      for (int64_t t = 0; t < tiles_n; ++t) {
        const int64_t v0 = t * kCols, vt = std::min(kCols, V - v0);
        load_range(call.weight, v0, vt, wt.data());
        form_z(p, hid.data(), wt.data(), rc, v0, vt, z.data());
        fold_tile(p, z.data(), rc, v0, vt, p.targets.data() + i0, rs.data() + i0);
      }
    }
  });
  return rs;
}

/// Phases 2 and 3: grad_weight / grad_bias (parallel over vocabulary tiles) and grad_hidden
/// (parallel over row chunks), from each valid row's lse and gradient coefficients.
void gradients(const Problem& p, const std::vector<float>& lse, const std::vector<detail::RowGrad>& rg) {
  const detail::LinearCall& call = *p.call;
  const LinearGrads& g = call.grads;
  const int64_t N = call.hidden.rows, M = static_cast<int64_t>(p.rows.size()), H = p.H, V = p.V;
  const int64_t chunks = (M + kRows - 1) / kRows, tiles_n = (V + kCols - 1) / kCols;
  const int threads = call.device.num_threads;
  // Phase 2: grad_weight and grad_bias, one vocabulary tile per task, rows in order.
  if (!g.grad_weight.empty() || !g.grad_bias.empty()) {
    parallel_for(tiles_n, 1, threads, [&](int64_t b, int64_t e) {
      std::vector<float> hid(kRows * H), wt(kCols * H), z(kRows * kCols), acc(kCols * H), accb(kCols);
      for (int64_t t = b; t < e; ++t) {
        const int64_t v0 = t * kCols, vt = std::min(kCols, V - v0);
        load_range(call.weight, v0, vt, wt.data());
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(accb.begin(), accb.end(), 0.0f);
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const int64_t i0 = ch * kRows, rc = std::min(kRows, M - i0);
          load_rows(call.hidden, p.rows.data() + i0, rc, hid.data());
          form_z(p, hid.data(), wt.data(), rc, v0, vt, z.data());
          grad_tile(p, z.data(), rc, v0, vt, p.targets.data() + i0, lse.data() + i0, rg.data() + i0);
          p.k.dw(z.data(), hid.data(), rc, vt, H, acc.data());
          for (int64_t r = 0; r < rc; ++r) {
            for (int64_t v = 0; v < vt; ++v) accb[v] += z[r * vt + v];
          }
        }
        if (!g.grad_weight.empty()) {
          for (int64_t v = 0; v < vt; ++v) {
            for (int64_t h = 0; h < H; ++h) store_elem(g.grad_weight.data, g.grad_weight.dtype, (v0 + v) * g.grad_weight.row_stride + h, acc[v * H + h]);
          }
        }
        if (!g.grad_bias.empty()) {
          for (int64_t v = 0; v < vt; ++v) store_elem(g.grad_bias.data, g.grad_bias.dtype, (v0 + v) * g.grad_bias.stride, accb[v]);
        }
      }
    });
  }
  // Phase 3: grad_hidden, one row chunk per task, vocabulary tiles in order; ignored rows are 0.
  if (!g.grad_hidden.empty()) {
    const MatrixView& gh = g.grad_hidden;
    for (int64_t i = 0; i < N; ++i) {
      for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, i * gh.row_stride + h, 0.0f);
    }
    parallel_for(chunks, 1, threads, [&](int64_t b, int64_t e) {
      std::vector<float> hid(kRows * H), wt(kCols * H), z(kRows * kCols), acc(kRows * H);
      for (int64_t ch = b; ch < e; ++ch) {
        const int64_t i0 = ch * kRows, rc = std::min(kRows, M - i0);
        load_rows(call.hidden, p.rows.data() + i0, rc, hid.data());
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t < tiles_n; ++t) {
          const int64_t v0 = t * kCols, vt = std::min(kCols, V - v0);
          load_range(call.weight, v0, vt, wt.data());
          form_z(p, hid.data(), wt.data(), rc, v0, vt, z.data());
          grad_tile(p, z.data(), rc, v0, vt, p.targets.data() + i0, lse.data() + i0, rg.data() + i0);
          p.k.dh(z.data(), wt.data(), rc, vt, H, acc.data());
        }
        for (int64_t r = 0; r < rc; ++r) {
          for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, p.rows[i0 + r] * gh.row_stride + h, acc[r * H + h]);
        }
      }
    });
  }
}

/// The upstream gradient of valid row i: grad_loss per row (reduction none) or its one entry,
/// 1 when absent, times g_chain (the mean's 1 / denominator).
float upstream(const Problem& p, int64_t i, float g_chain) {
  const detail::LinearCall& call = *p.call;
  const VectorView& gl = call.grad_loss;
  const float up = gl.empty() ? 1.0f
                              : float_at(gl, call.options.reduction == Reduction::kNone ? p.rows[i] : 0);
  return g_chain * up;
}

/// Shard step 1: each row's statistics in the layout of cross_entropy_shard_stats.
Status shard_stats(const Problem& p) {
  const detail::LinearCall& call = *p.call;
  const int64_t N = call.hidden.rows, M = static_cast<int64_t>(p.rows.size());
  const std::vector<RowState> rs = row_statistics(p);
  float* out = static_cast<float*>(call.stats.data);
  std::fill(out, out + (N + 1) * kShardStatsWidth, 0.0f);  // ignored rows: zeros
  for (int64_t i = 0; i < M; ++i) {
    const RowState& r = rs[i];
    const int64_t tl = p.targets[i];
    const bool holds = tl >= 0 && tl < p.V;
    const detail::LseState st = detail::lse_accum_state(r.st);
    float* o = out + p.rows[i] * kShardStatsWidth;
    o[0] = st.m;
    o[1] = st.s;
    o[2] = st.ez;
    o[3] = holds ? r.z_target : 0.0f;
    o[4] = holds ? 1.0f : 0.0f;
    o[5] = static_cast<float>(r.smooth);
    o[6] = r.best;
    const int32_t gi = static_cast<int32_t>(r.argmax + p.offset);
    std::memcpy(&o[7], &gi, sizeof(gi));
    o[8] = holds ? target_weight(p, tl) : 0.0f;
  }
  out[N * kShardStatsWidth] = static_cast<float>(weight_sum_of(p));
  return Status::Ok();
}

/// Shard step 3: the gradients from the merged lse, target weights and batch scalars.
Status shard_backward(Problem& p) {
  const detail::LinearCall& call = *p.call;
  const Options& o = call.options;
  const int64_t M = static_cast<int64_t>(p.rows.size());
  const float W = float_at(call.batch, 1);
  p.c = detail::make_loss_constants(o, call.shard.vocab_total, W);
  const float g_chain = o.reduction == Reduction::kMean ? 1.0f / float_at(call.batch, 0) : 1.0f;
  std::vector<float> lse(M);
  std::vector<detail::RowGrad> rg(M);
  for (int64_t i = 0; i < M; ++i) {
    lse[i] = float_at(call.lse_in, p.rows[i]);
    rg[i] = detail::row_grad(p.c, lse[i], float_at(call.row_weight, p.rows[i]), upstream(p, i, g_chain));
  }
  gradients(p, lse, rg);
  return Status::Ok();
}

}  // namespace

Status run_linear_tiled(const detail::LinearCall& call) {
  Problem p;
  Status st = build_problem(call, &p);
  if (!st.ok()) return st;
  if (call.shard_step == 1) {
    p.c = detail::make_loss_constants(call.options, call.shard.vocab_total, 0.0f);
    return shard_stats(p);
  }
  if (call.shard_step == 3) return shard_backward(p);

  const Options& o = call.options;
  const int64_t N = call.hidden.rows;
  const double weight_sum = weight_sum_of(p);
  double denominator = 0.0;
  for (int64_t t : p.targets) denominator += p.weight.empty() ? 1.0 : p.weight[t];
  p.c = detail::make_loss_constants(o, p.V, static_cast<float>(weight_sum));

  const int64_t M = static_cast<int64_t>(p.rows.size());
  std::vector<float> lse(M), loss_row(M), entropy(M);
  std::vector<uint8_t> correct(M);
  {
    const std::vector<RowState> rs = row_statistics(p);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t t = p.targets[i];
      const float l = detail::lse_accum_value(rs[i].st);
      const float w_t = p.weight.empty() ? 1.0f : p.weight[t];
      lse[i] = l;
      loss_row[i] = detail::row_loss(p.c, l, rs[i].z_target, w_t, static_cast<float>(rs[i].smooth), !p.weight.empty());
      entropy[i] = detail::lse_accum_entropy(rs[i].st);
      correct[i] = rs[i].argmax == t;
    }
  }

  // ---- forward outputs
  write_forward_outputs(call.out, o, denominator, N, ComputedRows{p.rows, loss_row, lse, correct, entropy});
  if (call.job != Job::kForwardBackward) return Status::Ok();

  // ---- gradients
  const float g_chain = o.reduction == Reduction::kMean ? static_cast<float>(1.0 / denominator) : 1.0f;
  std::vector<detail::RowGrad> rg(M);
  for (int64_t i = 0; i < M; ++i) {
    rg[i] = detail::row_grad(p.c, lse[i], p.weight.empty() ? 1.0f : p.weight[p.targets[i]], upstream(p, i, g_chain));
  }
  gradients(p, lse, rg);
  return Status::Ok();
}

}  // namespace cpu
}  // namespace fusedce
