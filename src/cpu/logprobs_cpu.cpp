// The CPU backend of the per-token log-probabilities (fusedce/logprobs.h): the three steps over
// logits or over hidden @ weight.T + bias. Rows whose target is ignored are dropped first.
//   Over logits: the row kernels (kernels_impl.h, the cross-entropy rows' vectorised exp and
//     staging) read each valid row once per step, forming z = x / temperature chunk by chunk.
//   The linear form: chunks of rows (at most kMaxChunkRows, float32 logits within the budget)
//     whose logits come from the build's matrix products (cpu/gemm.h: OpenBLAS or the core's own)
//     plus the bias in place; the same row kernels then read them (step 1) or turn them into
//     dz / temperature in place (step 3).
//   step 1: each row's chunks folded into its LpState in column order (a float state per chunk,
//     folded into a double one per row: no compounding over V); the linear form's chunk logits
//     by vocabulary blocks of kVocabBlock rows;
//   step 2: the gathered states of every rank folded in rank order, finished per row;
//   step 3: over logits the rows' gradients are the dlogits rows. The linear form goes block by
//     block of weight rows W_b (backward_block_rows: sized to stay in a core's cache), each block
//     on one thread: its logits z_b = hidden_chunk @ W_b.T (+ bias_b), turned into dz_b in place
//     by the row kernel over the block's columns, then grad_weight_b (+)= dz_b.T @ hidden_chunk
//     (float32, chunks added in row order), grad_bias_b += column sums and a grad_hidden partial
//     += dz_b @ W_b. The blocks fall into a number of groups fixed by the shape, each with its
//     own partial summed in block order; the partials are added in group order. Block and group
//     sizes are fixed by the shapes, so results do not depend on the thread count. A fresh
//     grad_weight is faulted in by a pass of its own first (fault_in_fresh, fresh_pages.h).
// Memory traffic over logits: one read of the (N, V) logits in step 1; one read and one write of
// (N, V) in step 3. The linear form reads the weight once per chunk in step 1, and once per chunk
// in step 3, where it also writes grad_weight (and reads it from the second chunk on); step 3
// stores nothing of size (rows, V), only a (rows, H) grad_hidden partial per group.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "common/call.h"
#include "common/logprob_call.h"
#include "common/logprob_math.h"
#include "cpu/elements.h"
#include "cpu/fresh_pages.h"
#include "cpu/gemm.h"
#include "cpu/kernels.h"
#include "cpu/thread_pool.h"

namespace fusedce {
namespace cpu {
namespace {

// The linear form's chunks: float32 logits of at most kDefaultBudget bytes and kMaxChunkRows rows
// (grad_weight is summed within a chunk by one product, chunk after chunk into float32, as the
// linear cross-entropy does); the statistics' products by blocks of kVocabBlock vocabulary rows.
// The backward's blocks: at most kVocabBlock weight rows of at most kBackwardBlockBytes (1 MiB
// measured 2% faster than 256 KiB and the same as 2 MiB at 64 x 1024 x 32000), in groups that
// each hold a (rows, H) float32 grad_hidden partial (backward_groups).
constexpr size_t kDefaultBudget = size_t(128) << 20;
constexpr int64_t kMaxChunkRows = 256;
constexpr int64_t kVocabBlock = 256;
constexpr size_t kBackwardBlockBytes = size_t(1) << 20;

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
  return Status::Ok();
}

/// The linear form's operands, chunk by chunk: the chunk's hidden rows (float32, rc x H), the
/// weight (read in place when float32, else converted once per call) and the bias; and its
/// logits (rc x V, row-major) hidden rows @ weight.T [+ bias], the product through the build's
/// matrix products by vocabulary blocks (the row kernels divide by the temperature).
class LinearChunks {
 public:
  explicit LinearChunks(const Problem& p) : p_(p), ops_(gemm()), threads_(p.call->device.num_threads) {
    const detail::LogprobCall& c = *p.call;
    const size_t budget = c.chunk_budget_bytes != 0 ? c.chunk_budget_bytes : kDefaultBudget;
    rows_ = std::max<int64_t>(1, std::min<int64_t>(kMaxChunkRows, int64_t(budget / (size_t(std::max<int64_t>(p.V, 1)) * 4))));
    const MatrixView& w = c.weight;
    if (w.dtype == DType::kFloat32) {
      w_ = static_cast<const float*>(w.data);
      ld_ = w.row_stride;
    } else {
      w_copy_.resize(p.V * p.H);
      parallel_for(p.V, kVocabBlock, threads_, [&](int64_t b, int64_t e) {
        for (int64_t v = b; v < e; ++v) {
          for (int64_t h = 0; h < p.H; ++h) w_copy_[v * p.H + h] = load_elem(w.data, w.dtype, v * w.row_stride + h);
        }
      });
      w_ = w_copy_.data();
      ld_ = p.H;
    }
    if (!c.bias.empty()) {
      bias_.resize(p.V);
      for (int64_t v = 0; v < p.V; ++v) bias_[v] = load_elem(c.bias.data, c.bias.dtype, v * c.bias.stride);
    }
    capacity_ = std::min<int64_t>(rows_, std::max<int64_t>(static_cast<int64_t>(p.rows.size()), 1));
    hc_.resize(capacity_ * p.H);
  }

  int64_t rows() const { return rows_; }
  /// Rows of the largest chunk of this call: min(rows(), valid rows).
  int64_t capacity() const { return capacity_; }
  const float* hidden() const { return hc_.data(); }
  const float* weight() const { return w_; }
  int64_t weight_ld() const { return ld_; }
  const GemmOps& ops() const { return ops_; }

  /// The hidden rows of valid rows [i0, i0 + rc), rc <= rows(), into hidden().
  void gather(int64_t i0, int64_t rc) {
    const detail::LogprobCall& c = *p_.call;
    const int64_t H = p_.H;
    for (int64_t r = 0; r < rc; ++r) {
      const int64_t base = p_.rows[i0 + r] * c.hidden.row_stride;
      for (int64_t h = 0; h < H; ++h) hc_[r * H + h] = load_elem(c.hidden.data, c.hidden.dtype, base + h);
    }
  }

  /// z (rc x vb, leading dimension ldz) = hidden() @ weight rows [v0, v0 + vb).T [+ bias].
  void logits_block(int64_t rc, int64_t v0, int64_t vb, float* z, int64_t ldz) const {
    ops_.nt(rc, vb, p_.H, hc_.data(), p_.H, w_ + v0 * ld_, ld_, z, ldz);
    if (bias_.empty()) return;
    for (int64_t r = 0; r < rc; ++r) {
      float* zr = z + r * ldz;
      for (int64_t v = 0; v < vb; ++v) zr[v] += bias_[v0 + v];
    }
  }

  /// Logits of valid rows [i0, i0 + rc), rc <= rows().
  float* form(int64_t i0, int64_t rc) {
    const int64_t V = p_.V;
    gather(i0, rc);
    if (z_.data() == nullptr) z_ = ScratchFloats(capacity_ * V);
    const int64_t blocks = (V + kVocabBlock - 1) / kVocabBlock;
    parallel_for(blocks, 1, threads_, [&](int64_t b, int64_t e) {
      for (int64_t blk = b; blk < e; ++blk) {
        const int64_t v0 = blk * kVocabBlock;
        logits_block(rc, v0, std::min(kVocabBlock, V - v0), z_.data() + v0, V);
      }
    });
    return z_.data();
  }

 private:
  const Problem& p_;
  const GemmOps ops_;
  const int threads_;
  int64_t rows_ = 1, capacity_ = 1;
  const float* w_ = nullptr;
  int64_t ld_ = 0;
  std::vector<float> w_copy_, bias_, hc_;
  ScratchFloats z_;
};

/// Row-kernel arguments over the valid rows of the logits form.
LpRowArgs logits_rows(const Problem& p) {
  const MatrixView& x = p.call->logits;
  LpRowArgs a{};
  a.x = static_cast<const char*>(x.data);
  a.dtype = x.dtype;
  a.vocab = p.V;
  a.stride = x.row_stride;
  a.rows = p.rows.data();
  a.targets = p.targets.data();
  a.scale = p.inv_t;
  a.distribution_stats = p.call->options.distribution_stats;
  return a;
}

/// Row-kernel arguments over a linear chunk's float32 logits z: valid rows i0.., contiguous.
LpRowArgs chunk_rows(const Problem& p, const float* z, int64_t i0) {
  LpRowArgs a{};
  a.x = reinterpret_cast<const char*>(z);
  a.dtype = DType::kFloat32;
  a.vocab = p.V;
  a.stride = p.V;
  a.targets = p.targets.data() + i0;
  a.scale = p.inv_t;
  a.distribution_stats = p.call->options.distribution_stats;
  return a;
}

Status write_stats(const Problem& p, const std::vector<LpRowStats>& rs) {
  const detail::LogprobCall& c = *p.call;
  float* out = static_cast<float*>(c.stats.data);
  std::fill(out, out + (p.N + 1) * kLogprobStatsWidth, 0.0f);  // ignored rows and row N: zeros
  for (size_t i = 0; i < rs.size(); ++i) {
    float* o = out + p.rows[i] * kLogprobStatsWidth;
    o[0] = rs[i].st.m;
    o[1] = static_cast<float>(rs[i].st.r);
    o[2] = static_cast<float>(rs[i].st.u);
    o[3] = rs[i].holds ? rs[i].z_t : 0.0f;
    o[4] = rs[i].holds ? 1.0f : 0.0f;
    if (c.options.distribution_stats) {
      o[5] = static_cast<float>(rs[i].st.q);
      o[6] = static_cast<float>(rs[i].z_sum);
      o[7] = rs[i].max_before;
    }
  }
  return Status::Ok();
}

Status stats_logits(const Problem& p) {
  std::vector<LpRowStats> rs(p.rows.size());
  LpRowArgs a = logits_rows(p);
  a.stats = rs.data();
  run_lp_stats_rows(a, static_cast<int64_t>(rs.size()), p.call->device.num_threads);
  return write_stats(p, rs);
}

Status stats_linear(const Problem& p) {
  const int64_t M = static_cast<int64_t>(p.rows.size());
  std::vector<LpRowStats> rs(M);
  if (M > 0) {
    LinearChunks lc(p);
    for (int64_t i0 = 0; i0 < M; i0 += lc.rows()) {
      const int64_t rc = std::min(lc.rows(), M - i0);
      LpRowArgs a = chunk_rows(p, lc.form(i0, rc), i0);
      a.stats = rs.data() + i0;
      run_lp_stats_rows(a, rc, p.call->device.num_threads);
    }
  }
  return write_stats(p, rs);
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
        st = detail::lp_merge(st, detail::LpState<float>{row[0], row[1], row[2], 0.0f});
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

/// Step 4: each row's distribution statistics from every rank's statistics, folded in rank
/// order (the sums in double), the same on every rank.
Status distribution_stats(const detail::LogprobCall& c) {
  Status s = detail::check_targets_host(c.target, c.shard.vocab_total, c.options.ignore_index);
  if (!s.ok()) return s;
  const int64_t N = c.rows(), R = c.world;
  const float* g = static_cast<const float*>(c.stats.data);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = load_target(c.target.data, c.target.dtype, c.target.stride, i);
    detail::LpDist d{0.0f, 0.0f, 0.0f};
    if (t != c.options.ignore_index) {
      detail::LpState<double> st = detail::lp_empty<double>();
      double z_sum = 0.0;
      float max_before = -INFINITY, z_t = NAN;
      for (int64_t r = 0; r < R; ++r) {
        const float* row = g + (r * (N + 1) + i) * kLogprobStatsWidth;
        st = detail::lp_merge(st, detail::LpState<float>{row[0], row[1], row[2], row[5]});
        z_sum += row[6];
        max_before = std::fmax(max_before, row[7]);
        if (row[4] != 0.0f) z_t = row[3];
      }
      d = detail::lp_dist_finish(st, z_sum, max_before, z_t, c.shard.vocab_total);
    }
    if (!c.dist.log_sum_sq_probs.empty()) float_ref(c.dist.log_sum_sq_probs, i) = d.log_sum_sq_probs;
    if (!c.dist.mean_logit.empty()) float_ref(c.dist.mean_logit, i) = d.mean_logit;
    if (!c.dist.is_top1.empty()) float_ref(c.dist.is_top1, i) = d.is_top1;
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

Status backward_logits(const Problem& p) {
  const detail::LogprobCall& c = *p.call;
  const MatrixView& d = c.dlogits;
  // Ignored rows: zeros (all-zero bits in every float dtype); the kernels write the others.
  const size_t elem = dtype_size(d.dtype);
  for (int64_t i = 0, k = 0; i < p.N; ++i) {
    if (k < static_cast<int64_t>(p.rows.size()) && p.rows[k] == i) {
      ++k;
      continue;
    }
    std::memset(static_cast<char*>(d.data) + static_cast<size_t>(i * d.row_stride) * elem, 0, static_cast<size_t>(p.V) * elem);
  }
  const std::vector<detail::LpRowGrad> g = row_grads(p);
  LpRowArgs a = logits_rows(p);
  a.grad = g.data();
  a.dx = static_cast<char*>(d.data);
  a.dx_stride = d.row_stride;
  run_lp_grad_rows(a, static_cast<int64_t>(g.size()), c.device.num_threads);
  return Status::Ok();
}

/// Vocabulary rows per block of the linear backward: about kBackwardBlockBytes of float32 weight
/// rows (a multiple of 16, between 16 and kVocabBlock), so that the block stays in a core's
/// cache across the three products that read it.
int64_t backward_block_rows(int64_t H) {
  const int64_t rows = int64_t(kBackwardBlockBytes / (sizeof(float) * size_t(std::max<int64_t>(H, 1)))) / 16 * 16;
  return std::min(kVocabBlock, std::max<int64_t>(16, rows));
}

/// Groups of the linear backward's blocks (each summed by one thread into its own partial): as
/// many as kPartialBytes of (rows, H) partials hold, at least kMinGroups (work for the threads
/// of a many-core pool) and at most kMaxGroups (the partials are added row by row at the end),
/// never more than the blocks. Fixed by the shape: the sums' order does not depend on threads.
/// 64 rows x 1024: 64 groups, 16 MiB; 256 rows x 1024: 16 groups (64 measured 3% slower there).
int64_t backward_groups(int64_t blocks, int64_t rows, int64_t H) {
  constexpr size_t kPartialBytes = size_t(16) << 20;
  constexpr int64_t kMinGroups = 16, kMaxGroups = 64;
  const int64_t fit = int64_t(kPartialBytes / (sizeof(float) * size_t(std::max<int64_t>(rows * H, 1))));
  return std::min(blocks, std::min(kMaxGroups, std::max(kMinGroups, fit)));
}

/// Where the linear backward's sums go: grad_weight's float32 accumulator (the output itself or
/// a buffer), grad_bias's, and whether grad_hidden is wanted.
struct BackwardSinks {
  float* gw = nullptr;  // (V, H), leading dimension gw_ld; null when not wanted
  int64_t gw_ld = 0;
  float* gb = nullptr;  // (V,); null when not wanted
  bool gh = false;
};

/// The linear form's backward, one chunk of rows at a time, blocked over the vocabulary: per
/// block of weight rows W_b (backward_block_rows), its logits z_b = hidden_chunk @ W_b.T (+ b_b)
/// turn into dz_b / temperature in place (the row kernel over the block's columns), then
/// grad_weight_b (+)= dz_b.T @ hidden_chunk, grad_bias_b += column sums and a grad_hidden
/// partial += dz_b @ W_b, while W_b is still in cache: the weight is read from memory once per
/// chunk. The blocks fall into a number of groups fixed by the shape (consecutive blocks,
/// backward_groups), each summed in block order into its own grad_hidden partial by one thread;
/// the partials are then added in group order, so results do not depend on the thread count.
class BlockedBackward {
 public:
  BlockedBackward(const Problem& p, LinearChunks& lc, const BackwardSinks& sinks)
      : p_(p),
        lc_(lc),
        sinks_(sinks),
        grads_(row_grads(p)),
        kernels_(best_row_kernels()),
        threads_(p.call->device.num_threads),
        block_(backward_block_rows(p.H)),
        blocks_((p.V + block_ - 1) / block_),
        groups_(backward_groups(blocks_, lc.capacity(), p.H)),
        partials_(sinks.gh ? groups_ * lc.capacity() * p.H : 0) {}

  /// Every gradient of valid rows [i0, i0 + rc), rc <= lc.rows().
  void chunk(int64_t i0, int64_t rc) {
    lc_.gather(i0, rc);
    parallel_for(groups_, 1, threads_, [&](int64_t b, int64_t e) {
      for (int64_t g = b; g < e; ++g) group(g, i0, rc);
    });
    if (sinks_.gh) store_hidden(i0, rc);
  }

 private:
  /// Blocks [g * blocks / groups, (g + 1) * blocks / groups), in order, on this thread.
  void group(int64_t g, int64_t i0, int64_t rc) {
    ScratchFloats dz(rc * block_);
    std::vector<int64_t> targets(rc);
    float* partial = sinks_.gh ? partials_.data() + g * rc * p_.H : nullptr;
    const int64_t first = g * blocks_ / groups_, last = (g + 1) * blocks_ / groups_;
    for (int64_t blk = first; blk < last; ++blk) block(blk, i0, rc, dz.data(), targets.data(), partial, blk > first);
  }

  /// One block's products and gradient rows; dz (rc x vb) and targets (rc) are scratch.
  void block(int64_t blk, int64_t i0, int64_t rc, float* dz, int64_t* targets, float* partial, bool add_partial) const {
    const GemmOps& ops = lc_.ops();
    const int64_t H = p_.H, v0 = blk * block_, vb = std::min(block_, p_.V - v0);
    lc_.logits_block(rc, v0, vb, dz, vb);
    for (int64_t r = 0; r < rc; ++r) targets[r] = p_.targets[i0 + r] - v0;  // outside [0, vb): not here
    LpRowArgs a{};
    a.x = reinterpret_cast<const char*>(dz);
    a.dtype = DType::kFloat32;
    a.vocab = vb;
    a.stride = vb;
    a.targets = targets;
    a.scale = p_.inv_t;
    a.grad = grads_.data() + i0;
    a.dx = reinterpret_cast<char*>(dz);  // dz / temperature in place of the logits
    a.dx_stride = vb;
    kernels_.lp_grad(a, 0, rc);
    if (sinks_.gw != nullptr) ops.tn(vb, H, rc, dz, vb, lc_.hidden(), H, sinks_.gw + v0 * sinks_.gw_ld, sinks_.gw_ld, i0 > 0);
    if (sinks_.gb != nullptr) {
      for (int64_t r = 0; r < rc; ++r) {
        for (int64_t v = 0; v < vb; ++v) sinks_.gb[v0 + v] += dz[r * vb + v];
      }
    }
    if (partial != nullptr) {
      ops.nn(rc, H, vb, dz, vb, lc_.weight() + v0 * lc_.weight_ld(), lc_.weight_ld(), partial, H, add_partial);
    }
  }

  /// grad_hidden of the chunk's rows: the groups' partials added in group order.
  void store_hidden(int64_t i0, int64_t rc) {
    const int64_t H = p_.H;
    const MatrixView& gh = p_.call->grads.grad_hidden;
    parallel_for(rc, 1, threads_, [&](int64_t b, int64_t e) {
      std::vector<float> row(H);
      for (int64_t r = b; r < e; ++r) {
        if (groups_ == 0) {  // a shard without columns
          std::fill(row.begin(), row.end(), 0.0f);
        } else {
          std::copy(partials_.data() + r * H, partials_.data() + (r + 1) * H, row.begin());
        }
        for (int64_t g = 1; g < groups_; ++g) {
          const float* part = partials_.data() + (g * rc + r) * H;
          for (int64_t h = 0; h < H; ++h) row[h] += part[h];
        }
        const int64_t base = p_.rows[i0 + r] * gh.row_stride;
        for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, base + h, row[h]);
      }
    });
  }

  const Problem& p_;
  LinearChunks& lc_;
  const BackwardSinks sinks_;
  const std::vector<detail::LpRowGrad> grads_;
  const RowKernels& kernels_;
  const int threads_;
  const int64_t block_, blocks_, groups_;
  ScratchFloats partials_;  // groups x chunk rows x H
};

Status backward_linear(const Problem& p) {
  const detail::LogprobCall& c = *p.call;
  const LinearGrads& gr = c.grads;
  const bool want_gw = !gr.grad_weight.empty(), want_gb = !gr.grad_bias.empty(), want_gh = !gr.grad_hidden.empty();
  const int64_t M = static_cast<int64_t>(p.rows.size()), H = p.H, V = p.V;
  const int threads = c.device.num_threads;
  // grad_weight is summed in the output itself when it is float32, else in a float32 buffer
  // rounded into it once at the end; the first chunk's product writes it, later ones add (no
  // zero fill: over the whole (V, H) that costs as much as a product).
  const MatrixView& gwo = gr.grad_weight;
  const bool gw_in_place = want_gw && gwo.dtype == DType::kFloat32;
  ScratchFloats gw_acc(want_gw && !gw_in_place && M > 0 ? V * H : 0);
  float* const gw = gw_in_place ? static_cast<float*>(gwo.data) : gw_acc.data();
  const int64_t gw_ld = gw_in_place ? gwo.row_stride : H;
  if (want_gw && M > 0) fault_in_fresh(gw, V, H, gw_ld, threads);
  std::vector<float> gb(want_gb ? V : 0, 0.0f);
  if (want_gh) {  // ignored rows' zeros; the chunks overwrite the valid rows
    const MatrixView& gh = gr.grad_hidden;
    for (int64_t i = 0; i < p.N; ++i) {
      for (int64_t h = 0; h < H; ++h) store_elem(gh.data, gh.dtype, i * gh.row_stride + h, 0.0f);
    }
  }
  if (M > 0) {
    LinearChunks lc(p);
    BlockedBackward bw(p, lc, BackwardSinks{want_gw ? gw : nullptr, gw_ld, want_gb ? gb.data() : nullptr, want_gh});
    for (int64_t i0 = 0; i0 < M; i0 += lc.rows()) bw.chunk(i0, std::min(lc.rows(), M - i0));
  }
  if (want_gw && (M == 0 || !gw_in_place)) {  // an empty batch's zeros, or a 16-bit rounding
    parallel_for(V, kVocabBlock, threads, [&](int64_t b, int64_t e) {
      for (int64_t v = b; v < e; ++v) {
        for (int64_t h = 0; h < H; ++h) store_elem(gwo.data, gwo.dtype, v * gwo.row_stride + h, M == 0 ? 0.0f : gw[v * H + h]);
      }
    });
  }
  if (want_gb) {
    for (int64_t v = 0; v < V; ++v) store_elem(gr.grad_bias.data, gr.grad_bias.dtype, v * gr.grad_bias.stride, gb[v]);
  }
  return Status::Ok();
}

}  // namespace

Status run_logprobs(const detail::LogprobCall& call) {
  if (call.step == 2) return merge(call);
  if (call.step == 4) return distribution_stats(call);
  Problem p;
  Status s = build_problem(call, &p);
  if (!s.ok()) return s;
  if (call.step == 1) return call.linear ? stats_linear(p) : stats_logits(p);
  return call.linear ? backward_linear(p) : backward_logits(p);
}

}  // namespace cpu
}  // namespace fusedce
