// The CPU backend of the per-token log-probabilities (fusedce/logprobs.h): the three steps over
// logits or over hidden @ weight.T + bias, through one tile loop. Rows whose target is ignored
// are dropped first; the rest go in chunks of kRows rows against tiles of kCols columns, formed
// as float32 z = (x [+ bias]) / temperature, never more than one tile per worker:
//   step 1 (parallel over row chunks): each tile folded into the rows' LpState (a float state
//     per tile, folded into a double one per row: no compounding over V);
//   step 2: the gathered states of every rank folded in rank order, finished per row;
//   step 3: the tiles formed again and turned into dz / temperature; over logits they are the
//     dlogits rows; for the linear form grad_weight / grad_bias accumulate per vocabulary tile
//     (parallel over tiles, rows in order) and grad_hidden per row chunk (parallel over chunks,
//     tiles in order), float32 throughout, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/call.h"
#include "common/logprob_call.h"
#include "common/logprob_math.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace fusedce {
namespace cpu {
namespace {

constexpr int64_t kRows = 16;   // rows per chunk
constexpr int64_t kCols = 128;  // columns per tile

float load_elem(const void* base, DType d, int64_t i) {
  switch (d) {
    case DType::kFloat32: return static_cast<const float*>(base)[i];
    case DType::kBFloat16: return detail::bf16_to_float(static_cast<const uint16_t*>(base)[i]);
    default: return detail::fp16_to_float(static_cast<const uint16_t*>(base)[i]);
  }
}

void store_elem(void* base, DType d, int64_t i, float v) {
  switch (d) {
    case DType::kFloat32: static_cast<float*>(base)[i] = v; break;
    case DType::kBFloat16: static_cast<uint16_t*>(base)[i] = detail::float_to_bf16(v); break;
    default: static_cast<uint16_t*>(base)[i] = detail::float_to_fp16(v); break;
  }
}

float float_at(const VectorView& v, int64_t i) { return static_cast<const float*>(v.data)[i * v.stride]; }
float& float_ref(const VectorView& v, int64_t i) { return static_cast<float*>(v.data)[i * v.stride]; }

/// The call's valid rows and their targets local to the columns (outside [0, V) when another
/// shard holds the target).
struct Problem {
  const detail::LogprobCall* call;
  int64_t N, V, H;
  float inv_t;
  std::vector<int64_t> rows;
  std::vector<int64_t> targets;
  TileKernels k;
};

Status build_problem(const detail::LogprobCall& c, Problem* p) {
  Status s = detail::check_targets_host(c.target, c.shard.vocab_total, c.options.ignore_index);
  if (!s.ok()) return s;
  p->call = &c;
  p->N = c.rows();
  p->V = c.local_vocab();
  p->H = c.linear ? c.hidden.cols : 0;
  p->inv_t = 1.0f / c.options.temperature;
  for (int64_t i = 0; i < p->N; ++i) {
    const int64_t t = load_target(c.target.data, c.target.dtype, c.target.stride, i);
    if (t == c.options.ignore_index) continue;
    p->rows.push_back(i);
    p->targets.push_back(t - c.shard.vocab_start);
  }
  if (c.linear) p->k = best_tile_kernels();
  return Status::Ok();
}

/// Forms z tiles of rows [i0, i0 + rc) of the valid rows over columns [v0, v0 + vt). For the
/// linear form the chunk's hidden rows are loaded once (load_rows) and each tile's weight rows
/// per tile.
class TileSource {
 public:
  explicit TileSource(const Problem& p) : p_(p) {
    if (p.call->linear) {
      hid_.resize(kRows * p.H);
      wt_.resize(kCols * p.H);
    }
  }

  void load_rows(int64_t i0, int64_t rc) {
    if (!p_.call->linear) return;
    const MatrixView& h = p_.call->hidden;
    for (int64_t r = 0; r < rc; ++r) {
      const int64_t base = p_.rows[i0 + r] * h.row_stride;
      for (int64_t j = 0; j < p_.H; ++j) hid_[r * p_.H + j] = load_elem(h.data, h.dtype, base + j);
    }
  }

  void load_cols(int64_t v0, int64_t vt) {
    if (!p_.call->linear) return;
    const MatrixView& w = p_.call->weight;
    for (int64_t v = 0; v < vt; ++v) {
      const int64_t base = (v0 + v) * w.row_stride;
      for (int64_t j = 0; j < p_.H; ++j) wt_[v * p_.H + j] = load_elem(w.data, w.dtype, base + j);
    }
  }

  /// z (rc x vt, row-major) from the loaded rows and columns.
  void form(int64_t i0, int64_t rc, int64_t v0, int64_t vt, float* z) const {
    const detail::LogprobCall& c = *p_.call;
    if (!c.linear) {
      for (int64_t r = 0; r < rc; ++r) {
        const int64_t base = p_.rows[i0 + r] * c.logits.row_stride + v0;
        for (int64_t v = 0; v < vt; ++v) z[r * vt + v] = load_elem(c.logits.data, c.logits.dtype, base + v) * p_.inv_t;
      }
      return;
    }
    p_.k.logits(hid_.data(), wt_.data(), rc, vt, p_.H, z);
    for (int64_t r = 0; r < rc; ++r) {
      for (int64_t v = 0; v < vt; ++v) {
        float x = z[r * vt + v];
        if (!c.bias.empty()) x += load_elem(c.bias.data, c.bias.dtype, (v0 + v) * c.bias.stride);
        z[r * vt + v] = x * p_.inv_t;
      }
    }
  }

  const float* hidden_rows() const { return hid_.data(); }
  const float* weight_cols() const { return wt_.data(); }

 private:
  const Problem& p_;
  std::vector<float> hid_, wt_;
};

/// One tile row's state: its max, the exps of every entry but the first max, and u.
detail::LpState<float> tile_state(const float* z, int64_t vt) {
  float m = -INFINITY;
  int64_t at = -1;
  bool nan = false;
  for (int64_t v = 0; v < vt; ++v) {
    nan |= z[v] != z[v];
    if (z[v] > m) {
      m = z[v];
      at = v;
    }
  }
  if (nan) return detail::LpState<float>{m, NAN, NAN};
  if (at < 0) return detail::lp_empty<float>();
  float r = 0.0f, u = 0.0f;
  for (int64_t v = 0; v < vt; ++v) {
    if (v == at) continue;
    const float d = z[v] - m;
    const float e = std::exp(d);
    r += e;
    if (e > 0.0f) u += e * d;
  }
  return detail::LpState<float>{m, r, u};
}

struct RowFold {
  detail::LpState<double> st = detail::lp_empty<double>();
  float z_t = 0.0f;
  bool holds = false;
};

Status stats(const Problem& p) {
  const detail::LogprobCall& c = *p.call;
  const int64_t M = static_cast<int64_t>(p.rows.size()), V = p.V;
  const int64_t chunks = (M + kRows - 1) / kRows, tiles_n = (V + kCols - 1) / kCols;
  std::vector<RowFold> rs(M);
  parallel_for(chunks, 1, c.device.num_threads, [&](int64_t b, int64_t e) {
    TileSource src(p);
    std::vector<float> z(kRows * kCols);
    for (int64_t ch = b; ch < e; ++ch) {
      const int64_t i0 = ch * kRows, rc = std::min(kRows, M - i0);
      src.load_rows(i0, rc);
      for (int64_t t = 0; t < tiles_n; ++t) {
        const int64_t v0 = t * kCols, vt = std::min(kCols, V - v0);
        src.load_cols(v0, vt);
        src.form(i0, rc, v0, vt, z.data());
        for (int64_t r = 0; r < rc; ++r) {
          RowFold& f = rs[i0 + r];
          f.st = detail::lp_merge(f.st, tile_state(z.data() + r * vt, vt));
          const int64_t tl = p.targets[i0 + r];
          if (tl >= v0 && tl < v0 + vt) {
            f.z_t = z[r * vt + (tl - v0)];
            f.holds = true;
          }
        }
      }
    }
  });
  float* out = static_cast<float*>(c.stats.data);
  std::fill(out, out + (p.N + 1) * kLogprobStatsWidth, 0.0f);  // ignored rows and row N: zeros
  for (int64_t i = 0; i < M; ++i) {
    float* o = out + p.rows[i] * kLogprobStatsWidth;
    o[0] = rs[i].st.m;
    o[1] = static_cast<float>(rs[i].st.r);
    o[2] = static_cast<float>(rs[i].st.u);
    o[3] = rs[i].holds ? rs[i].z_t : 0.0f;
    o[4] = rs[i].holds ? 1.0f : 0.0f;
  }
  return Status::Ok();
}

Status merge(const detail::LogprobCall& c) {
  Status s = detail::check_targets_host(c.target, c.shard.vocab_total, c.options.ignore_index);
  if (!s.ok()) return s;
  const int64_t N = c.rows(), R = c.world;
  const float* g = static_cast<const float*>(c.stats.data);
  const bool with_entropy = !c.out.entropy.empty();
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = load_target(c.target.data, c.target.dtype, c.target.stride, i);
    detail::LpResult res{0.0f, 0.0f, 0.0f};
    if (t != c.options.ignore_index) {
      detail::LpState<double> st = detail::lp_empty<double>();
      float z_t = NAN;
      for (int64_t r = 0; r < R; ++r) {
        const float* row = g + (r * (N + 1) + i) * kLogprobStatsWidth;
        st = detail::lp_merge(st, detail::LpState<float>{row[0], row[1], row[2]});
        if (row[4] != 0.0f) z_t = row[3];
      }
      res = detail::lp_finish(st, z_t);
    }
    float_ref(c.out.logprob, i) = res.logprob;
    float_ref(c.out.lse, i) = res.lse;
    if (with_entropy) float_ref(c.out.entropy, i) = res.entropy;
  }
  return Status::Ok();
}

/// Each valid row's gradient constants.
std::vector<detail::LpRowGrad> row_grads(const Problem& p) {
  const detail::LogprobCall& c = *p.call;
  const bool with_h = !c.grad_entropy.empty();
  std::vector<detail::LpRowGrad> g(p.rows.size());
  for (size_t k = 0; k < p.rows.size(); ++k) {
    const int64_t i = p.rows[k];
    g[k] = detail::LpRowGrad{float_at(c.out.lse, i), float_at(c.out.logprob, i),
                             with_h ? float_at(c.out.entropy, i) : 0.0f, float_at(c.grad_logprob, i),
                             with_h ? float_at(c.grad_entropy, i) : 0.0f};
  }
  return g;
}

/// z tile -> dlogits tile (d/dx of the row's objective), in place.
void grad_tile(const Problem& p, const detail::LpRowGrad* g, const int64_t* tg, int64_t rc, int64_t v0, int64_t vt,
               float* z) {
  for (int64_t r = 0; r < rc; ++r) {
    for (int64_t v = 0; v < vt; ++v) {
      float& x = z[r * vt + v];
      x = detail::lp_grad(g[r], x, v0 + v == tg[r]) * p.inv_t;
    }
  }
}

Status backward_logits(const Problem& p) {
  const detail::LogprobCall& c = *p.call;
  const MatrixView& d = c.dlogits;
  for (int64_t i = 0; i < p.N; ++i) {
    for (int64_t v = 0; v < p.V; ++v) store_elem(d.data, d.dtype, i * d.row_stride + v, 0.0f);
  }
  const std::vector<detail::LpRowGrad> g = row_grads(p);
  const int64_t M = static_cast<int64_t>(p.rows.size()), V = p.V;
  const int64_t chunks = (M + kRows - 1) / kRows, tiles_n = (V + kCols - 1) / kCols;
  parallel_for(chunks, 1, c.device.num_threads, [&](int64_t b, int64_t e) {
    TileSource src(p);
    std::vector<float> z(kRows * kCols);
    for (int64_t ch = b; ch < e; ++ch) {
      const int64_t i0 = ch * kRows, rc = std::min(kRows, M - i0);
      for (int64_t t = 0; t < tiles_n; ++t) {
        const int64_t v0 = t * kCols, vt = std::min(kCols, V - v0);
        src.form(i0, rc, v0, vt, z.data());
        grad_tile(p, g.data() + i0, p.targets.data() + i0, rc, v0, vt, z.data());
        for (int64_t r = 0; r < rc; ++r) {
          const int64_t base = p.rows[i0 + r] * d.row_stride + v0;
          for (int64_t v = 0; v < vt; ++v) store_elem(d.data, d.dtype, base + v, z[r * vt + v]);
        }
      }
    }
  });
  return Status::Ok();
}

Status backward_linear(const Problem& p) {
  const detail::LogprobCall& c = *p.call;
  const LinearGrads& gr = c.grads;
  const std::vector<detail::LpRowGrad> g = row_grads(p);
  const int64_t M = static_cast<int64_t>(p.rows.size()), H = p.H, V = p.V;
  const int64_t chunks = (M + kRows - 1) / kRows, tiles_n = (V + kCols - 1) / kCols;
  const int threads = c.device.num_threads;
  if (!gr.grad_weight.empty() || !gr.grad_bias.empty()) {
    parallel_for(tiles_n, 1, threads, [&](int64_t b, int64_t e) {
      TileSource src(p);
      std::vector<float> z(kRows * kCols), acc(kCols * H), accb(kCols);
      for (int64_t t = b; t < e; ++t) {
        const int64_t v0 = t * kCols, vt = std::min(kCols, V - v0);
        src.load_cols(v0, vt);
        std::fill(acc.begin(), acc.end(), 0.0f);
        std::fill(accb.begin(), accb.end(), 0.0f);
        for (int64_t ch = 0; ch < chunks; ++ch) {
          const int64_t i0 = ch * kRows, rc = std::min(kRows, M - i0);
          src.load_rows(i0, rc);
          src.form(i0, rc, v0, vt, z.data());
          grad_tile(p, g.data() + i0, p.targets.data() + i0, rc, v0, vt, z.data());
          p.k.dw(z.data(), src.hidden_rows(), rc, vt, H, acc.data());
          for (int64_t r = 0; r < rc; ++r) {
            for (int64_t v = 0; v < vt; ++v) accb[v] += z[r * vt + v];
          }
        }
        if (!gr.grad_weight.empty()) {
          const MatrixView& gw = gr.grad_weight;
          for (int64_t v = 0; v < vt; ++v) {
            for (int64_t h = 0; h < H; ++h) store_elem(gw.data, gw.dtype, (v0 + v) * gw.row_stride + h, acc[v * H + h]);
          }
        }
        if (!gr.grad_bias.empty()) {
          for (int64_t v = 0; v < vt; ++v) store_elem(gr.grad_bias.data, gr.grad_bias.dtype, (v0 + v) * gr.grad_bias.stride, accb[v]);
        }
      }
    });
  }
  if (!gr.grad_hidden.empty()) {
    const MatrixView& gh = gr.grad_hidden;
    for (int64_t i = 0; i < p.N; ++i) {
      for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, i * gh.row_stride + h, 0.0f);
    }
    parallel_for(chunks, 1, threads, [&](int64_t b, int64_t e) {
      TileSource src(p);
      std::vector<float> z(kRows * kCols), acc(kRows * H);
      for (int64_t ch = b; ch < e; ++ch) {
        const int64_t i0 = ch * kRows, rc = std::min(kRows, M - i0);
        src.load_rows(i0, rc);
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t t = 0; t < tiles_n; ++t) {
          const int64_t v0 = t * kCols, vt = std::min(kCols, V - v0);
          src.load_cols(v0, vt);
          src.form(i0, rc, v0, vt, z.data());
          grad_tile(p, g.data() + i0, p.targets.data() + i0, rc, v0, vt, z.data());
          p.k.dh(z.data(), src.weight_cols(), rc, vt, H, acc.data());
        }
        for (int64_t r = 0; r < rc; ++r) {
          for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, p.rows[i0 + r] * gh.row_stride + h, acc[r * H + h]);
        }
      }
    });
  }
  return Status::Ok();
}

}  // namespace

Status run_logprobs(const detail::LogprobCall& call) {
  if (call.step == 2) return merge(call);
  Problem p;
  Status s = build_problem(call, &p);
  if (!s.ok()) return s;
  if (call.step == 1) return stats(p);
  return call.linear ? backward_linear(p) : backward_logits(p);
}

}  // namespace cpu
}  // namespace fusedce
