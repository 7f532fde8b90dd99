// The kernels of lp_fused_products.h, sm_90a: CUTLASS's persistent ping-pong GEMM (TMA loads
// into a shared-memory ring, WGMMA with float32 accumulation, two consumer warp groups that take
// turns, so one's epilogue runs while the other's main loop does) with an epilogue of our own
// on the accumulators in registers, through CUTLASS's adapter for register epilogues. The
// gradient's tiles leave through a shared-memory stage by TMA stores where the TMA can address
// dlogits, so that the L2 takes whole lines, not the half sectors of pair stores from the
// accumulator layout.
//
// The epilogue first rounds each accumulator to bf16, the value the product would have stored:
// everything after is the row kernels' arithmetic (logprobs_kernels.cu) on the same logits.
// Accumulator layout (sm90, one 64 x N WGMMA a row block): value mode (2, 2, N / 8) = (column
// pair, row half, column group), then MMA_M blocks; a row of the tile lies in one quad of lanes,
// each lane holding columns 8 g + 2 (lane % 4) + {0, 1} of it, and a lane holds 2 MMA_M rows.
#include "cuda/logprobs/lp_fused_products.h"

#include <cuda_runtime.h>

#include "common/logprob_math.h"
#include "cuda/linear/cutlass_run.h"
#include "cuda/port.h"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/cuda_host_adapter.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

namespace fusedce {
namespace cuda {
// The epilogue's device helpers have external linkage (lp_fused): the host pass, which never
// calls them, would warn about unreferenced internal ones.
namespace lp_fused {

using namespace cute;
using bf16 = cutlass::bfloat16_t;

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;

/// The gradient's staging buffer (cutlass_run::TileStage).
using Stage = cutlass_run::TileStage;
static_assert(Stage::kTileCols == kLpFusedTile, "the stage holds one CTA tile's columns");

/// What the epilogue reads and writes besides the accumulators.
struct LpEpiParams {
  cute::TmaDescriptor dl_map;  // gradient, staged: dlogits (cols x rows) in the stage's boxes
  LpRows r;            // the rows' targets; r.vocab_start: global index of the product's column 0
  float4* partials;    // statistics: (tile, row) partials, tile-major
  float4* dist;        // with r.dist: the distribution columns' partials, the same layout
  int64_t tiles;       // statistics: lp_fused_tiles(N); a padded tile index beyond writes nothing
  LpFusedGrad g;       // gradient: the rows' inputs and the dlogits output
};

/// Both floats rounded to bf16 (round to nearest even, as the product's bf16 output), in place.
__device__ __forceinline__ void round_bf16_pair(float& a, float& b) {
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(b), "f"(a));  // the first source: the high half
  a = __uint_as_float(d << 16);
  b = __uint_as_float(d & 0xffff0000u);
}

/// max(a, b), NaN where either is NaN (fmaxf would drop it).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float y;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(y) : "f"(a), "f"(b));
  return y;
}

__device__ __forceinline__ int64_t target_of(const LpRows& r, int64_t i) {
  return r.target_i64 ? static_cast<const int64_t*>(r.target)[i * r.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(r.target)[i * r.target_stride]);
}

/// A lane's part of a row's tile state in base 2: M the raw max, r, u (and the squares' q)
/// relative to M c exactly (logprobs_kernels.cu's LaneState after state()).
struct TileState {
  float M, r, u, q;
};

/// Two lanes' states of one row merged (logprobs_kernels.cu's merge2, in float: a tile's part).
__device__ __forceinline__ TileState merge_lanes(const TileState& a, const TileState& b, float c) {
  if (b.M == -INFINITY) return TileState{a.M, a.r + b.r, a.u + b.u, a.q + b.q};
  if (a.M == -INFINITY) return TileState{b.M, b.r + a.r, b.u + a.u, b.q + a.q};
  const bool a_top = a.M >= b.M;
  const TileState hi = a_top ? a : b, lo = a_top ? b : a;
  const float d = (lo.M - hi.M) * c;
  const float f = ex2_subnormal(d);
  return TileState{hi.M, hi.r + (1.0f + lo.r) * f, hi.u + (lo.u + (1.0f + lo.r) * d) * f,
                   hi.q + (1.0f + lo.q) * f * f};
}

}  // namespace lp_fused

namespace {

using namespace cute;
using namespace lp_fused;

/// kGrad: dlogits; else the statistics, with kDist also the distribution columns (the squares'
/// sum, the sum of z, the max of z before the target's column). kStaged (with kGrad): a tile's
/// dlogits go out through shared memory by TMA stores of whole boxes, else by pair stores from
/// registers (a half of each 32-byte sector a warp's store touches).
template <bool kGrad, bool kDist = false, bool kStaged = false>
class LpEpilogue : public cutlass_run::RegisterEpilogueBase<LpEpiParams> {
  static_assert(kGrad || !kStaged, "only the gradient is staged");
 public:
  // The ping-pong kernel runs its two warp groups' epilogues one after the other (its order
  // barrier), so one buffer serves both.
  struct SharedStorage {
    alignas(1024) uint8_t stage[kStaged ? Stage::kBytes : 16];
  };
  using TensorStorage = SharedStorage;

  // p is the kernel's parameter (grid constant), where the TMA store's descriptor must stay.
  CUTLASS_HOST_DEVICE explicit LpEpilogue(Params const& p) : params(p), dl_map(&p.dl_map) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK, BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc_in, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char* smem) {
    const int M = get<0>(problem), N = get<1>(problem);
    constexpr int BM = size<0>(BlockShapeMNK{}), BN = size<1>(BlockShapeMNK{});
    static_assert(BN == kLpFusedTile, "a vocabulary tile is one CTA tile's columns");
    const int m_tile = get<0>(blk_coord), n_tile = get<1>(blk_coord);
    // The accumulators are this warp group's alone once its main loop is done: rounded in place.
    auto& acc = const_cast<cute::Tensor<FrgEngine, FrgLayout>&>(acc_in);
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "sm90 accumulator layout expected");
    constexpr int V0 = size<0, 0>(FrgLayout{}), V1 = size<0, 1>(FrgLayout{}), V2 = size<0, 2>(FrgLayout{});
    constexpr int MM = size<1>(FrgLayout{}), MN = size<2>(FrgLayout{});
    static_assert(V0 == 2 && V1 == 2, "sm90 accumulator value mode (2, 2, N/8) expected");

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor tCcD = thr_mma.partition_C(make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{})));
    const int row0 = m_tile * BM, col0 = n_tile * BN;
    // This lane's first column in the tile: every other one lies a constant past it, so the
    // loops below compare constants with per-row values (columns formed per entry are the same
    // for every row, and ptxas would keep them all live across the rows, spilling).
    const int lane_col = get<1>(tCcD(0));
    const float inv_t = params.r.inv_t;
    const float c = inv_t * kLog2e;

    // The statistics of a partial last tile: its columns past N are -inf, once, here, so that
    // the loops below need no bounds (the gradient's stores keep theirs).
    if (!kGrad && col0 + BN > N) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(acc); ++i) acc(i) = col0 + get<1>(tCcD(i)) < N ? acc(i) : -INFINITY;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < MM; ++m) {
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < V1; ++v1) {
        const int row = row0 + get<0>(tCcD(make_coord(make_coord(0, v1, 0), m, 0)));
        const bool row_in = row < M;
        const int64_t t = row_in ? target_of(params.r, row) : params.r.ignore_index;
        const bool live = t != params.r.ignore_index;
        // the target's column in this tile (any int: compared, never used as an index), and the
        // columns before it (all of the tile's past its end, none before its start)
        const int64_t tl64 = t - params.r.vocab_start - col0;
        const int tl = (tl64 >= 0 && tl64 < BN) ? static_cast<int>(tl64) : -1;
        const int before = tl64 < 0 ? 0 : tl64 > BN ? BN : static_cast<int>(tl64);

        // the row's columns of this lane, rounded to bf16, their least, and for the statistics
        // the lane's max (NaN where an entry is NaN)
        float top = -INFINITY, least = INFINITY;
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < MN; ++n) {
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2) {
            auto c0 = make_coord(make_coord(0, v1, v2), m, n);
            auto c1 = make_coord(make_coord(1, v1, v2), m, n);
            float x0 = acc(c0), x1 = acc(c1);
            round_bf16_pair(x0, x1);
            if constexpr (!kGrad) top = fmax_nan(top, fmax_nan(x0, x1));
            least = fminf(least, fminf(x0, x1));
            acc(c0) = x0;
            acc(c1) = x1;
          }
        }
        if constexpr (kStaged) {
          stage_dlogits<V2, MN>(acc, tCcD, m, v1, row, row_in, live, tl, least, c, inv_t, smem, N - col0, lane_col);
        } else if constexpr (kGrad) {
          store_dlogits<V2, MN>(acc, tCcD, m, v1, row, row_in, live, tl, least, c, inv_t, col0, N);
        } else {
          // the target's z where this lane holds its column: a branch the row takes in one tile
          float zt = 0.0f;
          if (tl >= 0) {
            const int tl_off = tl - lane_col;
            CUTLASS_PRAGMA_UNROLL
            for (int n = 0; n < MN; ++n) {
              CUTLASS_PRAGMA_UNROLL
              for (int v2 = 0; v2 < V2; ++v2) {
                auto c0 = make_coord(make_coord(0, v1, v2), m, n);
                auto c1 = make_coord(make_coord(1, v1, v2), m, n);
                const int off = get<1>(tCcD(c0)) - lane_col;  // even; off + 1 is the pair's other column
                zt = off == tl_off ? acc(c0) : zt;
                zt = off + 1 == tl_off ? acc(c1) : zt;
              }
            }
          }
          stats_row<V2, MN>(acc, tCcD, m, v1, row, row_in, live, tl, before, top, least, zt, c, inv_t, col0, N,
                            n_tile, lane_col);
        }
      }
    }
    if constexpr (kStaged) {
      Stage::store(dl_map, smem, row0, col0, M, N, thread_idx, static_cast<bf16*>(params.g.dlogits), params.g.ld_dlogits);
    }
  }

 private:
  /// Statistics: the lane's state of the row (top: its max), merged over the quad, written by
  /// the quad's first lane with the target's z where this tile holds it.
  template <int V2, int MN, class Acc, class Coords>
  CUTLASS_DEVICE void stats_row(Acc& acc, Coords const& tCcD, int m, int v1, int row, bool row_in, bool live, int tl,
                                int before, float top, float least, float zt, float c, float inv_t, int col0, int N,
                                int n_tile, int lane_col) {
    TileState s{top, 0.0f, 0.0f, 0.0f};
    float xs = 0.0f, mb = -INFINITY;  // kDist: the sum of the lane's columns, their max before the target's
    const bool whole = col0 + kLpFusedTile <= N;  // no column of the tile past N
    if constexpr (kDist) {
      // The sum over the tile's columns below N: taken in the statistics' loop (lane_sums) where
      // that runs over a whole tile (the same entries in the same order: the same bits; as a loop
      // of its own it cost more than the variant's other additions together), else by a masked
      // loop here. The max before the target's column: the lane's max where the whole tile
      // precedes it (no NaN: fmaxf would skip one), none where none does; a loop only in the
      // tile that holds the target.
      if (!(whole && top == top && top != INFINITY && top != -INFINITY)) {
        xs = masked_columns<V2, MN>(acc, tCcD, m, v1, lane_col, N - col0 - lane_col, 0.0f,
                                    [](float a, float x) { return a + x; });
      }
      if (before >= kLpFusedTile && top == top) {
        mb = top;
      } else if (before > 0) {
        mb = masked_columns<V2, MN>(acc, tCcD, m, v1, lane_col, before - lane_col, -INFINITY,
                                    [](float a, float x) { return fmaxf(a, x); });
      }
    }
    if (top != top || top == INFINITY) {
      s.r = s.u = s.q = NAN;  // a NaN entry; or inf - inf, as torch's log_softmax gives
    } else if (top != -INFINITY) {
      // Positions d = fl(x c - fl(top c)) (one FFMA), 2^d on the SFU; every instance of top
      // is left out of r (ties) and put back exactly after the fold.
      const float ym = top * c;
      const float delta = fmaf(top, c, -ym);
      float rs = 0.0f, us = 0.0f, qs = 0.0f, ties = 0.0f;
      // 2^d is a normal float wherever d >= -126, and there the flushing instruction gives the
      // bits of the one that keeps subnormal results: so the lane takes it (one MUFU) unless its
      // least entry lies lower (a collapsed row's log-probability lives in those terms)
      if (fmaf(least, c, -ym) >= -126.0f) {
        lane_sums<true, V2, MN>(acc, m, v1, top, c, ym, rs, us, qs, ties, xs, whole);
      } else {
        lane_sums<false, V2, MN>(acc, m, v1, top, c, ym, rs, us, qs, ties, xs, whole);
      }
      // relative to top c exactly (fmaf's residual delta folded out); the ties but one join at 1
      const float g = ex2_subnormal(-delta);
      s.r = rs * g + (ties - 1.0f);
      s.u = (us - delta * rs) * g;
      if constexpr (kDist) s.q = qs * g * g + (ties - 1.0f);
    }
    // the quad's lanes in a fixed order: (0 with 1, 2 with 3), then the pairs
    CUTLASS_PRAGMA_UNROLL
    for (int off = 1; off <= 2; off <<= 1) {
      const TileState o{__shfl_xor_sync(0xffffffffu, s.M, off), __shfl_xor_sync(0xffffffffu, s.r, off),
                        __shfl_xor_sync(0xffffffffu, s.u, off),
                        kDist ? __shfl_xor_sync(0xffffffffu, s.q, off) : 0.0f};
      s = (threadIdx.x & off) ? merge_lanes(o, s, c) : merge_lanes(s, o, c);
      if constexpr (kDist) {
        const float oxs = __shfl_xor_sync(0xffffffffu, xs, off), omb = __shfl_xor_sync(0xffffffffu, mb, off);
        xs = (threadIdx.x & off) ? oxs + xs : xs + oxs;
        mb = fmaxf(mb, omb);
      }
    }
    // the target's z from the lane that holds its column (every lane takes part in the shuffle)
    const int owner = tl >= 0 ? (tl % 8) / 2 : 0;
    zt = __shfl_sync(0xffffffffu, zt, (threadIdx.x & ~3) | owner);
    if ((threadIdx.x & 3) == 0 && row_in && live && n_tile < params.tiles) {
      const int64_t at = int64_t(n_tile) * params.r.rows + row;
      params.partials[at] = make_float4(s.M * inv_t, s.r, s.u * kLn2, tl >= 0 ? zt * inv_t : 0.0f);
      if constexpr (kDist) params.dist[at] = make_float4(s.q, xs * inv_t, mb * inv_t, 0.0f);
    }
  }

  /// f folded over the lane's columns of the row that lie less than `left` past lane_col, in
  /// column order from `init` (the stats' distribution columns).
  template <int V2, int MN, class Acc, class Coords, class F>
  CUTLASS_DEVICE static float masked_columns(Acc& acc, Coords const& tCcD, int m, int v1, int lane_col, int left,
                                             float init, F f) {
    float a = init;
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < MN; ++n)
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < V2; ++v2)
        CUTLASS_PRAGMA_UNROLL
        for (int v0 = 0; v0 < 2; ++v0) {
          auto cc = make_coord(make_coord(v0, v1, v2), m, n);
          a = get<1>(tCcD(cc)) - lane_col < left ? f(a, acc(cc)) : a;
        }
    return a;
  }

  /// A lane's sums over its columns of the row (stats_row); kFlush: 2^d by the flushing
  /// instruction, else by the one that keeps subnormal results.
  template <bool kFlush, int V2, int MN, class Acc>
  CUTLASS_DEVICE static void lane_sums(Acc& acc, int m, int v1, float top, float c, float ym, float& rs, float& us,
                                       float& qs, float& ties, float& xs, bool whole) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < MN; ++n) {
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < V2; ++v2) {
        CUTLASS_PRAGMA_UNROLL
        for (int v0 = 0; v0 < 2; ++v0) {
          auto cc = make_coord(make_coord(v0, v1, v2), m, n);
          const float x = acc(cc);
          const float d = fmaf(x, c, -ym);
          const bool is_top = x == top;
          const float e = is_top ? 0.0f : (kFlush ? ex2(d) : ex2_subnormal(d));
          ties += is_top ? 1.0f : 0.0f;
          rs += e;
          us = fmaf(e, fmaxf(d, -256.0f), us);  // 0 * clamp, not 0 * -inf
          if constexpr (kDist) {
            qs = fmaf(e, e, qs);
            xs = whole ? xs + x : xs;
          }
        }
      }
    }
  }

  /// A counted row's factors of its dlogits (store_dlogits): nl2 = -lse log2(e), A, B and the
  /// target's entry.
  struct RowGrad {
    float nl2, A, B, at_target;
  };
  CUTLASS_DEVICE RowGrad row_grad(int row, float inv_t) const {
    const LpFusedGrad& g = params.g;
    const bool with_h = g.g_h != nullptr;
    const detail::LpRowGrad rg{g.lse[row * g.lse_stride], g.logprob[row * g.logprob_stride],
                               with_h ? g.entropy[row * g.entropy_stride] : 0.0f, g.g_lp[row * g.g_lp_stride],
                               with_h ? g.g_h[row * g.g_h_stride] : 0.0f};
    return RowGrad{-(rg.lse * kLog2e), -(rg.g_lp + rg.g_h * rg.entropy) * inv_t, -rg.g_h * inv_t * kLn2,
                   detail::lp_grad(rg, 0.0f, true) * inv_t};
  }

  /// store_dlogits into the stage, the whole tile's columns (those past N too: the TMA store
  /// leaves them out, as it does rows past M, which are not written).
  template <int V2, int MN, class Acc, class Coords>
  CUTLASS_DEVICE void stage_dlogits(Acc& acc, Coords const& tCcD, int m, int v1, int row, bool row_in, bool live,
                                    int tl, float least, float c, float inv_t, char* smem, int n_left,
                                    int lane_col) {
    if (!row_in) return;
    const int rl = get<0>(tCcD(make_coord(make_coord(0, v1, 0), m, 0)));
    char* const srow = Stage::row(smem, rl, lane_col);
    const int sw = (rl & 7) << 4;
    if (!live) {  // an ignored row's dlogits are zeros, whatever its logits
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < MN; ++n) {
        CUTLASS_PRAGMA_UNROLL
        for (int v2 = 0; v2 < V2; ++v2) {
          const int off = get<1>(tCcD(make_coord(make_coord(0, v1, v2), m, n))) - lane_col;
          *Stage::pair(srow, sw, off) = 0u;
        }
      }
      return;
    }
    const RowGrad rg = row_grad(row, inv_t);
    if (fmaf(least, c, rg.nl2) >= -126.0f) {
      stage_pairs<true, V2, MN>(acc, tCcD, m, v1, srow, sw, lane_col, c, rg);
    } else {
      stage_pairs<false, V2, MN>(acc, tCcD, m, v1, srow, sw, lane_col, c, rg);
    }
    // the target's entry over the pair stored by the same lane (store_dlogits)
    if (tl >= 0 && tl < n_left) {
      const int tl_off = (tl & ~1) - lane_col;
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < MN; ++n) {
        CUTLASS_PRAGMA_UNROLL
        for (int v2 = 0; v2 < V2; ++v2) {
          if (get<1>(tCcD(make_coord(make_coord(0, v1, v2), m, n))) - lane_col == tl_off) {
            float t0 = rg.at_target, t1 = 0.0f;
            round_bf16_pair(t0, t1);
            const uint16_t bits = static_cast<uint16_t>(__float_as_uint(t0) >> 16);
            *reinterpret_cast<uint16_t*>(smem + Stage::at(rl, tl)) = bits;
          }
        }
      }
    }
  }

  /// The bf16 bits of a pair of dlogits, the first in the low half: dx = 2^d2 (A + B max(d2,
  /// -256)) with d2 = x c + nl2 (store_dlogits); kFlush as in lane_sums.
  template <bool kFlush>
  CUTLASS_DEVICE static uint32_t dlogit_pair(float x0, float x1, float c, float nl2, float A, float B) {
    const float d0 = fmaf(x0, c, nl2), d1 = fmaf(x1, c, nl2);
    float dz0 = (kFlush ? ex2(d0) : ex2_subnormal(d0)) * fmaf(B, fmaxf(d0, -256.0f), A);
    float dz1 = (kFlush ? ex2(d1) : ex2_subnormal(d1)) * fmaf(B, fmaxf(d1, -256.0f), A);
    round_bf16_pair(dz0, dz1);
    return (__float_as_uint(dz0) >> 16) | (__float_as_uint(dz1) & 0xffff0000u);
  }

  /// stage_dlogits' stores of the lane's columns of a counted row, but the target's.
  template <bool kFlush, int V2, int MN, class Acc, class Coords>
  CUTLASS_DEVICE static void stage_pairs(Acc& acc, Coords const& tCcD, int m, int v1, char* srow, int sw,
                                         int lane_col, float c, const RowGrad& rg) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < MN; ++n) {
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < V2; ++v2) {
        auto c0 = make_coord(make_coord(0, v1, v2), m, n);
        auto c1 = make_coord(make_coord(1, v1, v2), m, n);
        const uint32_t bits = dlogit_pair<kFlush>(acc(c0), acc(c1), c, rg.nl2, rg.A, rg.B);
        *Stage::pair(srow, sw, get<1>(tCcD(c0)) - lane_col) = bits;
      }
    }
  }

  /// Gradient: logprobs_kernels.cu's lp_backward_kernel element for element: with d2 = x c -
  /// lse log2(e), dx = 2^d2 (A + B max(d2, -256)), the target's entry lp_grad's own; ignored
  /// rows 0. Stored as bf16 pairs (a pair's second column may lie past N: then alone).
  template <int V2, int MN, class Acc, class Coords>
  CUTLASS_DEVICE void store_dlogits(Acc& acc, Coords const& tCcD, int m, int v1, int row, bool row_in, bool live,
                                    int tl, float least, float c, float inv_t, int col0, int N) {
    if (!row_in) return;
    const LpFusedGrad& g = params.g;
    const RowGrad rg = live ? row_grad(row, inv_t) : RowGrad{0.0f, 0.0f, 0.0f, 0.0f};
    const float nl2 = rg.nl2, A = rg.A, B = rg.B, at_target = rg.at_target;
    bf16* out = static_cast<bf16*>(g.dlogits) + int64_t(row) * g.ld_dlogits;
    if (!live) {  // an ignored row's dlogits are zeros, whatever its logits
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < MN; ++n) {
        CUTLASS_PRAGMA_UNROLL
        for (int v2 = 0; v2 < V2; ++v2) {
          const int col = col0 + get<1>(tCcD(make_coord(make_coord(0, v1, v2), m, n)));
          if (col + 1 < N) {
            *reinterpret_cast<uint32_t*>(out + col) = 0u;
          } else if (col < N) {
            *reinterpret_cast<uint16_t*>(out + col) = 0;
          }
        }
      }
      return;
    }
    // as in stats_row: the flushing 2^d where no d2 of the lane's lies under -126; a tile of
    // whole pairs below N (all but a partial last one) without per-pair bounds
    const bool flush = fmaf(least, c, nl2) >= -126.0f;
    if (col0 + kLpFusedTile > N) {
      dlogits_pairs<false, false, V2, MN>(acc, tCcD, m, v1, out, c, nl2, A, B, col0, N);
    } else if (flush) {
      dlogits_pairs<true, true, V2, MN>(acc, tCcD, m, v1, out, c, nl2, A, B, col0, N);
    } else {
      dlogits_pairs<true, false, V2, MN>(acc, tCcD, m, v1, out, c, nl2, A, B, col0, N);
    }
    // The target's entry, lp_grad's own, over the one the loop stored (the same thread's later
    // store): a branch a row takes in one tile, where this lane holds the column. Only below N:
    // a vocabulary chunk may end inside a tile, and a target past its end belongs to the next
    // chunk (stored here it would land in the next row's first columns).
    if (live && tl >= 0 && col0 + tl < N) {
      CUTLASS_PRAGMA_UNROLL
      for (int n = 0; n < MN; ++n) {
        CUTLASS_PRAGMA_UNROLL
        for (int v2 = 0; v2 < V2; ++v2) {
          if (get<1>(tCcD(make_coord(make_coord(0, v1, v2), m, n))) == (tl & ~1)) {
            float t0 = at_target, t1 = 0.0f;
            round_bf16_pair(t0, t1);
            *reinterpret_cast<uint16_t*>(out + col0 + tl) = static_cast<uint16_t>(__float_as_uint(t0) >> 16);
          }
        }
      }
    }
  }

  /// store_dlogits' stores of the lane's columns of a counted row, but the target's; kFull:
  /// every pair lies below N; kFlush as in lane_sums.
  template <bool kFull, bool kFlush, int V2, int MN, class Acc, class Coords>
  CUTLASS_DEVICE static void dlogits_pairs(Acc& acc, Coords const& tCcD, int m, int v1, bf16* out, float c, float nl2,
                                           float A, float B, int col0, int N) {
    CUTLASS_PRAGMA_UNROLL
    for (int n = 0; n < MN; ++n) {
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < V2; ++v2) {
        auto c0 = make_coord(make_coord(0, v1, v2), m, n);
        auto c1 = make_coord(make_coord(1, v1, v2), m, n);
        const int col = col0 + get<1>(tCcD(c0));
        if (!kFull && col >= N) continue;
        const uint32_t bits = dlogit_pair<kFlush>(acc(c0), acc(c1), c, nl2, A, B);
        if (kFull || col + 1 < N) {
          *reinterpret_cast<uint32_t*>(out + col) = bits;
        } else {
          *reinterpret_cast<uint16_t*>(out + col) = static_cast<uint16_t>(bits);
        }
      }
    }
  }

  Params params;
  const cute::TmaDescriptor* dl_map;
};

using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
/// The persistent scheduler's tile order: CUTLASS's raster order and swizzle size.
struct LpTileOrder {
  RasterOrder raster;
  int swizzle;
};
/// The order the statistics product and the dlogits product's pair stores run in.
inline constexpr LpTileOrder kLpTileOrder{RasterOrder::Heuristic, 1};
/// The order the staged dlogits product runs in: swizzled columns first, the best of
/// dev/lp_order's twelve on the backward's vocabulary chunks.
inline constexpr LpTileOrder kLpGradOrder{RasterOrder::AlongN, 8};

/// The fused products on cutlass_run::RowsProduct (128 x 192 ping-pong tiles, clusters of two).
template <bool kGrad, bool kDist = false, bool kStaged = false>
struct FusedKernel {
  static Status run(const LpFusedProduct& p, const LpEpiParams& epi, LpTileOrder order = kLpTileOrder) {
    return cutlass_run::RowsProduct<LpEpilogue<kGrad, kDist, kStaged>>::run(
        p.rows, p.cols, p.H, p.hidden, p.ld_hidden, p.weight, p.ld_weight, epi, order.raster, order.swizzle, p.device,
        p.stream, "the CUTLASS log-probability product");
  }
};

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// TMA needs 16-byte aligned bases and row strides that are multiples of 16 bytes (H % 8 for
/// the contiguous extent); int sizes.
bool addressable(const LpFusedProduct& p) {
  const int64_t big = (int64_t(1) << 31) - 1;
  if (p.rows <= 0 || p.cols <= 0 || p.H <= 0 || p.rows > big || p.cols > big || p.H > big) return false;
  if (p.H % 8 || p.ld_hidden % 8 || p.ld_weight % 8) return false;
  if (!aligned16(p.hidden) || !aligned16(p.weight)) return false;
  return p.r.rows == p.rows;
}

}  // namespace

Status run_lp_stats_product(const LpFusedProduct& p, float4* partials) {
  if (!addressable(p) || !aligned16(partials)) return Status(StatusCode::kUnsupported, "operands TMA cannot address");
  LpEpiParams epi{};
  epi.r = p.r;
  epi.partials = partials;
  epi.tiles = lp_fused_tiles(p.cols);
  if (!p.r.dist) return FusedKernel<false>::run(p, epi);
  epi.dist = partials + epi.tiles * p.rows;
  return FusedKernel<false, true>::run(p, epi);
}

namespace {

/// run_lp_dlogits_product: whole tiles through the stage where the TMA can address dlogits, else
/// pair stores; each at its own order unless one is given (dev/lp_order's probe).
Status run_dlogits(const LpFusedProduct& p, const LpFusedGrad& g, const LpTileOrder* order = nullptr) {
  if (!addressable(p) || reinterpret_cast<uintptr_t>(g.dlogits) % 4 || g.ld_dlogits % 2) {
    return Status(StatusCode::kUnsupported, "operands TMA cannot address");
  }
  LpEpiParams epi{};
  epi.r = p.r;
  epi.g = g;
  if (Stage::map(g.dlogits, p.rows, p.cols, g.ld_dlogits, &epi.dl_map)) {
    return FusedKernel<true, false, true>::run(p, epi, order ? *order : kLpGradOrder);
  }
  return FusedKernel<true>::run(p, epi, order ? *order : kLpTileOrder);
}

}  // namespace

Status run_lp_dlogits_product(const LpFusedProduct& p, const LpFusedGrad& g) { return run_dlogits(p, g); }

}  // namespace cuda
}  // namespace fusedce
