// The kernel of window_forward.h, sm_90a: CUTLASS's persistent ping-pong GEMM (TMA loads into a
// shared-memory ring, WGMMA with float32 accumulation, two consumer warp groups that take turns,
// so that one's epilogue runs while the other's main loop does) with an epilogue of our own on
// the accumulators in registers, through CUTLASS's adapter for register epilogues.
//
// Accumulator layout (sm90, one 64 x N WGMMA a row block): value mode (2, 2, N / 8) = (column
// pair, row half, column group), then MMA_M blocks; a row of the tile lies in one quad of lanes,
// each lane holding columns 8 g + 2 (lane % 4) + {0, 1} of it, and a lane holds 2 MMA_M rows.
// E leaves through a shared-memory stage, four passes of 48 columns, each row's 16-byte pieces
// stored whole: pair stores straight from the accumulator layout write half sectors.
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

/// What the epilogue reads and writes (window_forward.h's WindowForward, less the host's part).
struct EpiParams {
  __nv_bfloat16* e;
  int64_t ld_e;
  float* sum;
  float* offset;
  float* centred;
  float* top;
  int* top_col;
  int tiles;
  float scale;
  const __nv_bfloat16* bias;  // (V,) added to the accumulators (the kBias variants)
  // soft-cap c > 0 (the kSoftcap variants): z = c tanh(acc cap_in), y = z log2 e = tanh(.) cap_out,
  // and the stored entry E (1 - t^2) with t = z / c = y cap_t
  float cap_in, cap_out, cap_t;
};

using window_math::ahead;  // torch.argmax's order

// Each option that adds work per accumulator is a variant of its own (kMetrics, kSoftcap, kBias),
// so that the plain epilogue holds no register for what it does not do: the consumer warp groups
// have 232 registers, 192 of them the tile's accumulators.
template <class BlockShape, bool kStore, bool kMetrics, bool kSoftcap, bool kBias>
class WindowEpilogue : public cutlass_run::RegisterEpilogueBase<EpiParams> {
 public:
  // The stage: 128 rows of one 48-column pass, rows padded to 112 bytes so that the 8 rows x 4
  // lanes of a warp's 4-byte writes fall in 32 distinct banks.
  static constexpr int kPassCols = 48, kStageLd = kPassCols + 8;
  struct SharedStorage {
    alignas(128) __nv_bfloat16 stage[kStore ? size<0>(BlockShape{}) * kStageLd : 1];
  };
  using TensorStorage = SharedStorage;

  CUTLASS_HOST_DEVICE WindowEpilogue(Params const& p, SharedStorage const& = SharedStorage()) : params(p) {}

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
    static_assert(MN == 1 && (V2 * 8) % kPassCols == 0, "one MMA along N, whole passes");
    constexpr int kRows = V1 * MM;

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
    Tensor tCcD = thr_mma.partition_C(cD);  // each value's (row, col) in the tile
    const int row0 = m_tile * BM, col0 = n_tile * BN;
    // y = z log2 e = (acc + bias) * (scale log2 e) (soft-capped: tanh((acc + bias) cap_in) cap_out),
    // formed once a value by the first sweep, in place (the accumulators are this warp group's
    // alone once its main loop is done): one rounding each, never contracted into what follows,
    // so that every variant gives E, S and m the same bits.
    const float zs = params.scale * kLog2e;

    // The rows' maxima of z log2 e over the tile's columns (a quad holds a row).
    float rmax[kRows];
    float top[kMetrics ? kRows : 1];  // metrics: the argmax's value and column
    int top_col[kMetrics ? kRows : 1];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) rmax[r] = -INFINITY;
    if constexpr (kMetrics) {
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < kRows; ++r) top[r] = -INFINITY, top_col[r] = INT_MAX;
    }
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < MM; ++m)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < V1; ++v1)
        CUTLASS_PRAGMA_UNROLL
        for (int v2 = 0; v2 < V2; ++v2)
          CUTLASS_PRAGMA_UNROLL
          for (int v0 = 0; v0 < V0; ++v0) {
            auto c = make_coord(make_coord(v0, v1, v2), m, 0);
            const int col = col0 + get<1>(tCcD(c));
            const bool in = col < N;
            float x = acc(c);
            if constexpr (kBias) {
              if (in) x += __bfloat162float(params.bias[col]);
            }
            const float y = kSoftcap ? __fmul_rn(tanhf(x * params.cap_in), params.cap_out) : __fmul_rn(x, zs);
            acc(c) = y;
            rmax[m * V1 + v1] = fmaxf(rmax[m * V1 + v1], in ? y : -INFINITY);
            if constexpr (kMetrics) {
              if (in && ahead(y, col, top[m * V1 + v1], top_col[m * V1 + v1])) top[m * V1 + v1] = y, top_col[m * V1 + v1] = col;
            }
          }
    float koff[kRows], mown[kRows], ssum[kRows], usum[kMetrics ? kRows : 1];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 1));
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 2));
      if constexpr (kMetrics) {
        CUTLASS_PRAGMA_UNROLL
        for (int o = 1; o <= 2; o *= 2) {
          const float v = __shfl_xor_sync(0xffffffffu, top[r], o);
          const int j = __shfl_xor_sync(0xffffffffu, top_col[r], o);
          if (ahead(v, j, top[r], top_col[r])) top[r] = v, top_col[r] = j;
        }
        usum[r] = 0.0f;
      }
      mown[r] = ceilf(rmax[r]);
      koff[r] = window_offset(mown[r]);
      ssum[r] = 0.0f;
    }

    constexpr int kGroups = kPassCols / 8;  // column groups of 8 per pass
    auto* stage = reinterpret_cast<SharedStorage*>(smem)->stage;
    // One barrier per consumer warp group (ids after CUTLASS's reserved ones).
    cutlass::arch::NamedBarrier bar(128, cutlass::canonical_warp_group_idx() & 1);
    CUTLASS_PRAGMA_UNROLL
    for (int pass = 0; pass < V2 / kGroups; ++pass) {
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < MM; ++m)
        CUTLASS_PRAGMA_UNROLL
        for (int v1 = 0; v1 < V1; ++v1) {
          const int r = m * V1 + v1;
          const int lrow = get<0>(tCcD(make_coord(make_coord(0, v1, 0), m, 0)));
          CUTLASS_PRAGMA_UNROLL
          for (int g = 0; g < kGroups; ++g) {
            const int v2 = pass * kGroups + g;
            auto c0 = make_coord(make_coord(0, v1, v2), m, 0);
            auto c1 = make_coord(make_coord(1, v1, v2), m, 0);
            const int col = get<1>(tCcD(c0));
            // an odd N splits the last pair: its second column is out (0 in the stage, never
            // stored: the stores below stop at N)
            const bool in0 = col0 + col < N, in1 = col0 + col + 1 < N;
            const float y0 = acc(c0), y1 = acc(c1);
            const float e0 = in0 ? ex2(y0 - koff[r]) : 0.0f;
            const float e1 = in1 ? ex2(y1 - koff[r]) : 0.0f;
            ssum[r] += e0 + e1;
            // the entropy partial, centred on the tile's own offset (no cancellation at offset 0)
            if constexpr (kMetrics) usum[r] = fmaf(e0, y0 - mown[r], fmaf(e1, y1 - mown[r], usum[r]));
            if constexpr (kStore) {
              // with the soft-cap the stored entry carries dz/dx's per-entry factor 1 - t^2 (the
              // scale rides the merge's row factor); the sums above take E itself
              float s0 = e0, s1 = e1;
              if constexpr (kSoftcap) {
                const float t0 = y0 * params.cap_t, t1 = y1 * params.cap_t;
                s0 = e0 * fmaf(-t0, t0, 1.0f), s1 = e1 * fmaf(-t1, t1, 1.0f);
              }
              *reinterpret_cast<__nv_bfloat162*>(stage + lrow * kStageLd + col - pass * kPassCols) =
                  __floats2bfloat162_rn(s0, s1);
            }
          }
        }
      if constexpr (kStore) {
        bar.arrive_and_wait();
        // 16-byte pieces along rows: 6 a row, 768 a pass, 6 a thread.
        constexpr int kPieces = kPassCols / 8;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < BM * kPieces / 128; ++i) {
          const int piece = thread_idx + 128 * i;
          const int lrow = piece / kPieces, seg = piece % kPieces;
          const int row = row0 + lrow, col = col0 + pass * kPassCols + seg * 8;
          const uint4 v = *reinterpret_cast<const uint4*>(stage + lrow * kStageLd + seg * 8);
          if (row < M && col < N) {
            __nv_bfloat16* dst = params.e + int64_t(row) * params.ld_e + col;
            if (col + 8 <= N && (reinterpret_cast<uintptr_t>(dst) & 15) == 0) {
              *reinterpret_cast<uint4*>(dst) = v;
            } else {
              const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
              for (int j = 0; j < 8 && col + j < N; ++j) dst[j] = h[j];
            }
          }
        }
        bar.arrive_and_wait();
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
};

using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;

template <bool kStore, bool kMetrics, bool kSoftcap, bool kBias>
Status run_kernel(const WindowForward& p) {
  static_assert(kWindowTile == 192, "a vocabulary tile is one CTA tile's columns");
  using Epi = WindowEpilogue<Shape<_128, _192, _64>, kStore, kMetrics, kSoftcap, kBias>;
  const float cap_out = kSoftcap ? p.softcap * kLog2e : 0.0f;
  const EpiParams epi{static_cast<__nv_bfloat16*>(p.e),
                      p.ld_e,
                      p.sum,
                      p.offset,
                      p.centred,
                      p.top,
                      p.top_col,
                      static_cast<int>(window_tiles(p.V)),
                      p.scale,
                      static_cast<const __nv_bfloat16*>(p.bias),
                      kSoftcap ? p.scale / p.softcap : 0.0f,
                      cap_out,
                      kSoftcap ? 1.0f / cap_out : 0.0f};
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

/// TMA needs 16-byte aligned bases and row strides that are multiples of 16 bytes (H % 8 for the
/// contiguous extent); E's rows start on 4-byte boundaries (its 16-byte stores are taken where
/// aligned, single elements elsewhere); int sizes. Any V: an odd one's last column pair is split.
bool addressable(const WindowForward& p) {
  const int64_t big = (int64_t(1) << 31) - 1;
  if (p.rows <= 0 || p.V <= 0 || p.H <= 0 || p.rows > big || p.V > big || p.H > big) return false;
  if (p.H % 8 || p.ld_hidden % 8 || p.ld_weight % 8) return false;
  if (!aligned16(p.hidden) || !aligned16(p.weight)) return false;
  if (p.store_e && (reinterpret_cast<uintptr_t>(p.e) % 4 || p.ld_e % 2)) return false;
  return p.sum && p.offset && (!p.metrics || (p.centred && p.top && p.top_col));
}

}  // namespace window_fwd

Status run_window_forward(const WindowForward& p) {
  if (!window_fwd::addressable(p)) return Status(StatusCode::kUnsupported, "operands TMA cannot address");
  return p.bias != nullptr ? window_fwd::run_variant<true>(p) : window_fwd::run_variant<false>(p);
}

}  // namespace cuda
}  // namespace fusedce
