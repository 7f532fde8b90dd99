// The kernel of window_forward.h, sm_90a: CUTLASS's persistent ping-pong GEMM (TMA loads into a
// shared-memory ring, WGMMA with float32 accumulation, two consumer warp groups that take turns,
// so that one's epilogue runs while the other's main loop does) with an epilogue of our own on
// the accumulators in registers, through CUTLASS's adapter for register epilogues.
//
// Accumulator layout (sm90, one 64 x N WGMMA a row block): value mode (2, 2, N / 8) = (column
// pair, row half, column group), then MMA_M blocks; a row of the tile lies in one quad of lanes,
// each lane holding columns 8 g + 2 (lane % 4) + {0, 1} of it, and a lane holds 2 MMA_M rows.
// E leaves through a shared-memory stage (cutlass_run::TileStage): the warp group writes its tile
// there, one thread hands it to TMA stores, and the warp group waits only until TMA has read it,
// not for the global writes (pair stores straight from the accumulator layout would write half
// sectors, and each thread would wait on its own stores).
#include "cuda/linear/window_forward.h"
#include "cuda/linear/window_math.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <climits>

#include "cuda/linear/cutlass_run.h"
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
// The epilogue's device helpers have external linkage: the host pass, which never calls them,
// would warn about unreferenced internal ones.
namespace window_fwd {

using namespace cute;
using bf16 = cutlass::bfloat16_t;

using window_math::kLn2;
using window_math::kLog2e;

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float rcp(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// tanh(u) from w = 2 u log2 e as 1 - 2 / (2^w + 1): two MUFU operations (an exponential and a
/// reciprocal) and two others, where tanhf spends the same two and about fifteen more. Its error
/// is absolute, a few float32 ulps of 1: what the soft-capped logit c tanh(u) needs, since the
/// softmax sees a logit's absolute error. w = +-inf gives +-1 (2^w overflows to inf or flushes
/// to 0), NaN gives NaN.
__device__ __forceinline__ float tanh_from_exp2(float w) { return fmaf(-2.0f, rcp(ex2(w) + 1.0f), 1.0f); }

/// What the epilogue reads and writes (window_forward.h's WindowForward, less the host's part).
struct EpiParams {
  cute::TmaDescriptor e_map;  // kStore: E in the stage's boxes (TileStage::map)
  __nv_bfloat16* e;           // kStore: E (rows x V), its last columns written by the threads
  int64_t ld_e;
  float* sum;
  float* offset;
  float* centred;
  float* top;
  int* top_col;
  int tiles;
  float scale;
  const __nv_bfloat16* bias;  // (V,) added to the accumulators (the kBias variants)
  // soft-cap c > 0 (the kSoftcap variants): z = c tanh(u) with u = acc scale / c, formed from
  // w = 2 u log2 e = acc cap_in; y = z log2 e = tanh(u) cap_out, and the stored entry E (1 - t^2)
  // with t = z / c = y cap_t
  float cap_in, cap_out, cap_t;
};

using window_math::ahead;  // torch.argmax's order

// Each option that adds work per accumulator is a variant of its own (kMetrics, kSoftcap, kBias),
// so that the plain epilogue holds no register for what it does not do: the consumer warp groups
// have 232 registers, 192 of them the tile's accumulators.
template <class BlockShape, bool kStore, bool kMetrics, bool kSoftcap, bool kBias>
class WindowEpilogue : public cutlass_run::RegisterEpilogueBase<EpiParams> {
 public:
  using Stage = cutlass_run::TileStage;
  static_assert(size<0>(BlockShape{}) == Stage::kBoxRows && size<1>(BlockShape{}) == Stage::kTileCols,
                "the stage holds one warp group's tile");
  struct SharedStorage {
    alignas(1024) uint8_t stage[kStore ? Stage::kBytes : 16];
  };
  using TensorStorage = SharedStorage;

  // p is the kernel's parameter (grid constant), where the TMA store's map must stay.
  CUTLASS_HOST_DEVICE WindowEpilogue(Params const& p, SharedStorage const& = SharedStorage())
      : params(p), e_map(&p.e_map) {}

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK, BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc_in, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char* smem) {
    const int M = get<0>(problem), N = get<1>(problem);
    constexpr int BM = size<0>(BlockShapeMNK{}), BN = size<1>(BlockShapeMNK{});
    const int m_tile = get<0>(blk_coord), n_tile = get<1>(blk_coord);
    auto& acc = const_cast<cute::Tensor<FrgEngine, FrgLayout>&>(acc_in);

    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "sm90 accumulator layout expected");
    constexpr int V0 = size<0, 0>(FrgLayout{}), V1 = size<0, 1>(FrgLayout{}), V2 = size<0, 2>(FrgLayout{});
    constexpr int MM = size<1>(FrgLayout{}), MN = size<2>(FrgLayout{});
    static_assert(V0 == 2 && V1 == 2, "sm90 accumulator value mode (2, 2, N/8) expected");
    static_assert(MN == 1, "one MMA along N");
    constexpr int kRows = V1 * MM;

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
    Tensor tCcD = thr_mma.partition_C(cD);  // each value's (row, col) in the tile
    const int row0 = m_tile * BM, col0 = n_tile * BN;
    // y = z log2 e = (acc + bias) * (scale log2 e) (soft-capped: tanh(u) cap_out, u from (acc + bias) cap_in),
    // formed once a value by the first sweep, in place (the accumulators are this warp group's
    // alone once its main loop is done): one rounding each, never contracted into what follows,
    // so that every variant gives E, S and m the same bits.
    const float zs = params.scale * kLog2e;
    // This lane's first column in the tile: every other one lies a constant past it, so the
    // bounds below compare constants with one per-tile value (columns formed per entry are the
    // same for every row, and ptxas would keep them all live across the rows, spilling).
    const int lane_col = get<1>(tCcD(0));
    const int n_left = N - col0 - lane_col;  // a column c of the lane is in while c - lane_col < n_left

    // The rows' maxima of z log2 e over the tile's columns (a quad holds a row).
    float rmax[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) rmax[r] = -INFINITY;
    // one value: y in place of the accumulator, and its row's maximum (b: its column's bias)
    auto first = [&](int v0, int v1, int v2, int m, bool in, float b) {
      auto c = make_coord(make_coord(v0, v1, v2), m, 0);
      const float x = kBias ? acc(c) + b : acc(c);
      const float y = kSoftcap ? __fmul_rn(tanh_from_exp2(x * params.cap_in), params.cap_out) : __fmul_rn(x, zs);
      acc(c) = y;
      rmax[m * V1 + v1] = fmaxf(rmax[m * V1 + v1], in ? y : -INFINITY);
    };
    if constexpr (kBias) {  // columns outer: a column's bias is loaded once for the lane's rows
      CUTLASS_PRAGMA_UNROLL
      for (int v2 = 0; v2 < V2; ++v2)
        CUTLASS_PRAGMA_UNROLL
        for (int v0 = 0; v0 < V0; ++v0) {
          const int off = get<1>(tCcD(make_coord(make_coord(v0, 0, v2), 0, 0))) - lane_col;
          const bool in = off < n_left;
          const float b = in ? __bfloat162float(params.bias[col0 + lane_col + off]) : 0.0f;
          CUTLASS_PRAGMA_UNROLL
          for (int m = 0; m < MM; ++m)
            CUTLASS_PRAGMA_UNROLL
            for (int v1 = 0; v1 < V1; ++v1) first(v0, v1, v2, m, in, b);
        }
    } else {  // rows outer, the second sweep's order
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < MM; ++m)
        CUTLASS_PRAGMA_UNROLL
        for (int v1 = 0; v1 < V1; ++v1)
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2)
            CUTLASS_PRAGMA_UNROLL
            for (int v0 = 0; v0 < V0; ++v0) {
              const int off = get<1>(tCcD(make_coord(make_coord(v0, v1, v2), m, 0))) - lane_col;
              first(v0, v1, v2, m, off < n_left, 0.0f);
            }
    }
    float koff[kRows], mown[kRows], ssum[kRows], usum[kMetrics ? kRows : 1];
    // metrics: this lane's first column (past lane_col) holding the row's maximum, found by the
    // second sweep; exact whenever no value is NaN (a NaN makes the lane's sum NaN, see below)
    int top_col[kMetrics ? kRows : 1];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 1));
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 2));
      if constexpr (kMetrics) usum[r] = 0.0f, top_col[r] = INT_MAX;
      mown[r] = ceilf(rmax[r]);
      koff[r] = window_offset(mown[r]);
      ssum[r] = 0.0f;
    }

    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < MM; ++m)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < V1; ++v1) {
        const int r = m * V1 + v1;
        const int rl = get<0>(tCcD(make_coord(make_coord(0, v1, 0), m, 0)));
        char* const srow = Stage::row(smem, rl, lane_col);
        const int sw = (rl & 7) << 4;
        CUTLASS_PRAGMA_UNROLL
        for (int v2 = 0; v2 < V2; ++v2) {
          auto c0 = make_coord(make_coord(0, v1, v2), m, 0);
          auto c1 = make_coord(make_coord(1, v1, v2), m, 0);
          const int off = get<1>(tCcD(c0)) - lane_col;  // 8 v2
          // an odd N splits the last pair: its second column is out (0 in the stage, never
          // stored: the map ends at N rounded down to 8, the threads' stores at N)
          const bool in0 = off < n_left, in1 = off + 1 < n_left;
          const float y0 = acc(c0), y1 = acc(c1);
          const float e0 = in0 ? ex2(y0 - koff[r]) : 0.0f;
          const float e1 = in1 ? ex2(y1 - koff[r]) : 0.0f;
          ssum[r] += e0 + e1;
          // the entropy partial, centred on the tile's own offset (no cancellation at offset 0)
          if constexpr (kMetrics) {
            usum[r] = fmaf(e0, y0 - mown[r], fmaf(e1, y1 - mown[r], usum[r]));
            if (in0 && y0 == rmax[r]) top_col[r] = min(top_col[r], off);
            if (in1 && y1 == rmax[r]) top_col[r] = min(top_col[r], off + 1);
          }
          if constexpr (kStore) {
            // with the soft-cap the stored entry carries dz/dx's per-entry factor 1 - t^2 (the
            // scale rides the merge's row factor); the sums above take E itself
            float s0 = e0, s1 = e1;
            if constexpr (kSoftcap) {
              const float t0 = y0 * params.cap_t, t1 = y1 * params.cap_t;
              s0 = e0 * fmaf(-t0, t0, 1.0f), s1 = e1 * fmaf(-t1, t1, 1.0f);
            }
            *reinterpret_cast<__nv_bfloat162*>(Stage::pair(srow, sw, off)) = __floats2bfloat162_rn(s0, s1);
          }
        }
      }
    if constexpr (kStore) {
      Stage::store(e_map, smem, row0, col0, M, N, thread_idx, reinterpret_cast<cutlass::bfloat16_t*>(params.e),
                   params.ld_e);
    }
    float top[kMetrics ? kRows : 1];  // metrics: the argmax's value (its column in top_col)
    if constexpr (kMetrics) {
      // A NaN value makes its lane's sum NaN (so might an overflow): then the tile's argmax is
      // searched again in torch's order (a NaN first), which the equality above cannot express.
      bool odd = false;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) odd |= !(ssum[r] == ssum[r]);
      if (__any_sync(0xffffffffu, odd)) {
        // the lane's argmax of each row in torch's order (window_math::ahead), past lane_col
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) top[r] = -INFINITY, top_col[r] = INT_MAX;
        CUTLASS_PRAGMA_UNROLL
        for (int m = 0; m < MM; ++m)
          CUTLASS_PRAGMA_UNROLL
          for (int v1 = 0; v1 < V1; ++v1)
            CUTLASS_PRAGMA_UNROLL
            for (int v2 = 0; v2 < V2; ++v2)
              CUTLASS_PRAGMA_UNROLL
              for (int v0 = 0; v0 < V0; ++v0) {
                auto c = make_coord(make_coord(v0, v1, v2), m, 0);
                const int off = get<1>(tCcD(c)) - lane_col;
                const float y = acc(c);
                const int r = m * V1 + v1;
                if (off < n_left && ahead(y, off, top[r], top_col[r])) top[r] = y, top_col[r] = off;
              }
      } else {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < kRows; ++r) top[r] = top_col[r] == INT_MAX ? -INFINITY : rmax[r];
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) {
        // the columns in the matrix, for the quad's comparisons and the merge
        top_col[r] = top_col[r] == INT_MAX ? INT_MAX : col0 + lane_col + top_col[r];
        CUTLASS_PRAGMA_UNROLL
        for (int o = 1; o <= 2; o *= 2) {
          const float v = __shfl_xor_sync(0xffffffffu, top[r], o);
          const int j = __shfl_xor_sync(0xffffffffu, top_col[r], o);
          if (ahead(v, j, top[r], top_col[r])) top[r] = v, top_col[r] = j;
        }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      ssum[r] += __shfl_xor_sync(0xffffffffu, ssum[r], 1);
      ssum[r] += __shfl_xor_sync(0xffffffffu, ssum[r], 2);
      if constexpr (kMetrics) {
        usum[r] += __shfl_xor_sync(0xffffffffu, usum[r], 1);
        usum[r] += __shfl_xor_sync(0xffffffffu, usum[r], 2);
      }
    }
    if ((thread_idx & 3) == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < MM; ++m)
        CUTLASS_PRAGMA_UNROLL
        for (int v1 = 0; v1 < V1; ++v1) {
          const int r = m * V1 + v1;
          const int row = row0 + get<0>(tCcD(make_coord(make_coord(0, v1, 0), m, 0)));
          // The scheduler's swizzle pads the tile grid to whole swizzle groups: a padded tile
          // (n_tile >= tiles) holds no column, and its slot would be the next row's first tile.
          if (row < M && n_tile < params.tiles) {
            const int64_t at = int64_t(row) * params.tiles + n_tile;
            params.sum[at] = ssum[r];
            params.offset[at] = mown[r];
            if constexpr (kMetrics) {
              params.centred[at] = usum[r] * kLn2;
              params.top[at] = top[r];
              params.top_col[at] = top_col[r];
            }
          }
        }
    }
  }

 private:
  Params params;
  const cute::TmaDescriptor* e_map;
};

using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;

template <bool kStore, bool kMetrics, bool kSoftcap, bool kBias>
Status run_kernel(const WindowForward& p) {
  static_assert(kWindowTile == 192, "a vocabulary tile is one CTA tile's columns");
  using Epi = WindowEpilogue<Shape<_128, _192, _64>, kStore, kMetrics, kSoftcap, kBias>;
  const float cap_out = kSoftcap ? p.softcap * kLog2e : 0.0f;
  EpiParams epi{{},
                static_cast<__nv_bfloat16*>(p.e),
                p.ld_e,
                p.sum,
                p.offset,
                p.centred,
                p.top,
                p.top_col,
                static_cast<int>(window_tiles(p.V)),
                p.scale,
                static_cast<const __nv_bfloat16*>(p.bias),
                kSoftcap ? 2.0f * kLog2e * p.scale / p.softcap : 0.0f,
                cap_out,
                kSoftcap ? 1.0f / cap_out : 0.0f};
  // Under 8 columns no box is stored (TileStage::store: the threads store them all).
  if (kStore && p.V >= 8 && !Epi::Stage::map(p.e, p.rows, p.V, p.ld_e, &epi.e_map)) {
    return Status(StatusCode::kUnsupported, "E: TMA cannot address it");
  }
  const WindowTileOrder order = window_tile_order(p.rows);
  return cutlass_run::RowsProduct<Epi>::run(p.rows, p.V, p.H, p.hidden, p.ld_hidden, p.weight, p.ld_weight, epi,
                                            order.along_m ? RasterOrder::AlongM : RasterOrder::AlongN, order.swizzle,
                                            p.device, p.stream, "the CUTLASS window logits product");
}

/// The variant of the call's options (the template flags of WindowEpilogue).
template <bool kBias>
Status run_variant(const WindowForward& p) {
  if (p.softcap > 0.0f) {
    if (p.metrics) return p.store_e ? run_kernel<true, true, true, kBias>(p) : run_kernel<false, true, true, kBias>(p);
    return p.store_e ? run_kernel<true, false, true, kBias>(p) : run_kernel<false, false, true, kBias>(p);
  }
  if (p.metrics) return p.store_e ? run_kernel<true, true, false, kBias>(p) : run_kernel<false, true, false, kBias>(p);
  return p.store_e ? run_kernel<true, false, false, kBias>(p) : run_kernel<false, false, false, kBias>(p);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

/// TMA needs 16-byte aligned bases and row strides that are multiples of 16 bytes: the operands'
/// (H % 8 for the contiguous extent) and E's (TileStage::map: also V >= 8); int sizes. Any V: an
/// odd one's last column pair is split.
bool addressable(const WindowForward& p) {
  const int64_t big = (int64_t(1) << 31) - 1;
  if (p.rows <= 0 || p.V <= 0 || p.H <= 0 || p.rows > big || p.V > big || p.H > big) return false;
  if (p.H % 8 || p.ld_hidden % 8 || p.ld_weight % 8) return false;
  if (!aligned16(p.hidden) || !aligned16(p.weight)) return false;
  return p.sum && p.offset && (!p.metrics || (p.centred && p.top && p.top_col));
}

}  // namespace window_fwd

Status run_window_forward(const WindowForward& p) {
  if (!window_fwd::addressable(p)) return Status(StatusCode::kUnsupported, "operands TMA cannot address");
  return p.bias != nullptr ? window_fwd::run_variant<true>(p) : window_fwd::run_variant<false>(p);
}

}  // namespace cuda
}  // namespace fusedce
