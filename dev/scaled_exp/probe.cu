// Experiment: the logits product with the cross-entropy's statistics in its epilogue, written by
// hand on CUTLASS's persistent ping-pong main loop (128 x 192 tiles, cluster 2 x 1), instead of an
// epilogue visitor tree. Does the epilogue hide under the other warpgroup's main loop, so that
// the product costs what the plain product costs?
//
// Per tile (rows i, vocabulary columns j of one 192-wide tile t), from the float32 accumulators
// in registers, in two phases:
//   1. m_it = max_j z_ij (in-thread, then across the quad of lanes that holds a row);
//      k_it = ceil(m_it log2 e), an integer, so that later rescaling by 2^(k_it - k) is exact;
//   2. E_ij = 2^(z_ij log2 e - k_it) written in bf16 (E <= 1: the row's largest terms keep
//      bf16's full precision; bf16 has float32's exponent range, so nothing flushes that
//      matters); the partials S_it = sum_j E_ij (unrounded) and U_it = sum_j E_ij z_ij (the
//      entropy's), and the exact float32 logit of the row's target if it falls in the tile.
// A merge over the (rows x tiles) partials gives lse_i = ln 2 (K_i + log2 sum_t S_it 2^(k_it - K_i))
// with K_i = max_t k_it, and the entropy lse_i - sum_t 2^(k_it - K_i) U_it / sum_t 2^(k_it - K_i) S_it.
// The gradient products can then form dlogits = E 2^(k_it) e^(-lse_i) - onehot on load (a
// power-of-two factor per (row, tile)), so no pass over the (rows x V) logits remains.
//
// The float64 reference is formed from cuBLASLt's float32 product; a second one, at 16 sampled
// rows a shape, from float64 dot products of the bf16 operands (no cuBLASLt), checks it and the
// full kernel's lse and entropy (the line under each shape's row).
//
// Timed against cuBLASLt's plain bf16 logits product and CUTLASS's own ping-pong and cooperative
// kernels writing plain logits (interleaved rounds, medians); checked against float64 (E, lse,
// entropy, target logit) before timing. The staged variant with E stored by TMA (a line of its
// own under each shape's row): does an asynchronous store of the stage take back what the
// hand-written stores cost against CUTLASS's TMA epilogue?
//
// The per-(row, tile) partials are checked one by one (the "partials:" lines after each shape's),
// so that a wrong lse or entropy can be traced to the tiles that cause it. The float64 reference
// per (row, tile) comes from the cuBLASLt float32 logits: ln sum_j e^z_ij, the tile's
// e^z-weighted means of z and |z|, and ceil(max_j z_ij log2 e) as the kernel forms it. For each
// variant (full, staged, staged with the row offset given, no E store), every pair is checked:
// S_it 2^k_it against sum_j e^z_ij (relative: a different choice of k compares fairly);
// U_it 2^k_it against sum_j e^z_ij z_ij (relative to sum_j e^z_ij |z_ij|, as z has both signs);
// k_it against the tile's ceil(max log2 e) (off by one can be the two products' rounding at an
// integer) or the given row offset; E against 2^(z log2 e - k_it) per tile where E is stored.
// The bad pairs are summarized by where they lie (rows, N-tiles, whether the last N-tile, bad
// rows per 128-row M-tile, 128 x 192 output tiles whole or in part), and each is compared with
// the references of nearby slots (N-tiles t-2..t+2 of every row in its M-tile and of rows
// +-128, +-256): a partial that matches another slot's reference landed in the wrong slot.
// Then the same kernel runs again on partials filled with a NaN sentinel: slots still holding
// it were never written (the first run's values there were left over), and written slots that
// differ bitwise from the first run show a race (the kernel is otherwise deterministic). The
// reference itself is checked per tile at the 16 sampled rows against the float64 dot products,
// so that an error in cuBLASLt's product is not taken for the kernel's.
//
// Shapes whose rows (K or N bf16 values) are not a multiple of 16 bytes are skipped: TMA needs
// 16-byte row pitches.
//
// Build (here, no GPU; the include dir is the one CMake unpacks from the pinned CUTLASS wheel,
// e.g. build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -lineinfo -I<cutlass include dir> \
//     dev/scaled_exp/probe.cu -o build-probe/scaled_exp -lcublasLt
// Run (GPU): the binary [grpo]; a table row and a float64 line a shape, then its "partials:" lines.
// With `grpo`, GRPO's head shape (8192 x 896 x 151936) after a small warm-up shape.
#include <cublasLt.h>
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
using bf16 = cutlass::bfloat16_t;
using RM = cutlass::layout::RowMajor;
using CM = cutlass::layout::ColumnMajor;
using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;

#define CK(x)                                                 \
  do {                                                        \
    cudaError_t e_ = (x);                                     \
    if (e_ != cudaSuccess) {                                  \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));         \
      exit(1);                                                \
    }                                                         \
  } while (0)

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// What the epilogue writes. Partials are (rows x tiles), row-major with ld `tiles`.
struct ScaledExpOut {
  __nv_bfloat16* e = nullptr;  // rows x V, ld ldE
  int64_t ldE = 0;
  float* k = nullptr;        // per (row, tile): the integer offset k_it
  float* s = nullptr;        // per (row, tile): sum_j E_ij (float32, unrounded E)
  float* u = nullptr;        // per (row, tile): sum_j E_ij z_ij
  int tiles = 0;
  const int* target = nullptr;  // per row; -1: none
  float* target_logit = nullptr;
  const float* shift = nullptr;  // Mode::StagedShift: per row, the integer offset
  // Mode::StagedTma: E's tensor map (rows x V, pitch ldE; boxes of 128 rows x 64 columns, 128-byte
  // swizzle), a kernel parameter as TMA wants it
  CUtensorMap tmap{};  // aligned as TMA wants by its type
};

/// E's tensor map for Mode::StagedTma (tma_map_e): TMA stores 128 x 64 boxes from the stage,
/// clipping at the matrix's edges.
bool tma_map_e(ScaledExpOut& o, int M, int N) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (!encode) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult q{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess || fn == nullptr)
      return false;
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  const cuuint64_t dims[2] = {cuuint64_t(N), cuuint64_t(M)};
  const cuuint64_t strides[1] = {cuuint64_t(o.ldE) * 2};
  const cuuint32_t box[2] = {64, 128};
  const cuuint32_t elem[2] = {1, 1};
  return encode(&o.tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, o.e, dims, strides, box, elem,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_NONE,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

/// The epilogue: operator-style (CUTLASS's sm90 kernels call it through
/// Sm90TmaWarpSpecializedAdapter), on the consumer warpgroup's accumulators in registers.
/// What the epilogue does, to split its cost: everything (E stored from registers: each lane a
/// 4-byte word, a quad 16 contiguous bytes of a row); everything with E staged through shared
/// memory in four 48-column passes and stored in 16-byte pieces along rows; the statistics
/// without storing E; or plain bf16 logits through the register-to-global stores. StagedTma:
/// Staged with three 64-column passes into a stage in TMA's 128-byte swizzle (conflict-free
/// 4-byte writes), each pass stored by one TMA instruction (the warpgroup waits only for TMA to
/// have read the stage, not for the global writes). StagedShift:
/// Staged with the offset given per row (an integer s_i >= the row's max z log2 e, chosen before
/// the product), no max pass: with one offset for the whole row the gradient products need no
/// operand transform (grad_hidden's rows and grad_weight's hidden rows take the per-row factor).
enum class Mode { Full, Staged, StagedShift, NoStore, Plain, StagedTma };

template <class BlockShape, Mode kMode>
class ScaledExpEpilogue {
 public:
  struct ThreadEpilogueOp {
    using ElementOutput = bf16;
    using ElementAccumulator = float;
    using ElementCompute = float;
    using ElementD = bf16;
    static constexpr int kCount = 2;
    struct Params {};
  };
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = bf16;
  using StrideC = cute::Stride<int64_t, cute::Int<1>, int64_t>;
  using ElementD = bf16;
  using StrideD = StrideC;
  using ElementOutput = bf16;
  using ElementAccumulator = float;
  using ElementCompute = float;
  using ElementScalar = float;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  // Staging for Mode::Staged: 128 rows of one 48-column pass, rows padded to 112 bytes so that
  // the 8 rows x 4 lanes of a warp's 4-byte writes fall in 32 distinct banks.
  static constexpr int kPassCols = 48, kStageLd = kPassCols + 8;
  static constexpr int kTmaCols = 64;  // StagedTma: a pass is one 128-byte swizzled row a tile row
  struct SharedStorage {
    alignas(1024) __nv_bfloat16 stage[(kMode == Mode::Staged || kMode == Mode::StagedShift) ? size<0>(BlockShape{}) * kStageLd
                                      : kMode == Mode::StagedTma                              ? size<0>(BlockShape{}) * kTmaCols
                                                                                              : 1];
  };
  using TensorStorage = SharedStorage;
  using Arguments = ScaledExpOut;
  using Params = ScaledExpOut;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& a, void*) { return a; }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) { return 0; }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const& p, Arguments const& a) {
    return get<1>(p) % 2 == 0 && a.ldE % 2 == 0;  // bf16 pairs stored as one 32-bit word
  }

  CUTLASS_HOST_DEVICE ScaledExpEpilogue(Params const& p, SharedStorage const& = SharedStorage())
      : params(p), kernel_params(p) {}
  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL problem, BlockShapeMNK, BlockCoordMNKL blk_coord,
                                 cute::Tensor<FrgEngine, FrgLayout> const& acc_in, TiledMma tiled_mma, ResidueMNK,
                                 int thread_idx, char* smem) {
    constexpr float kLog2e = 1.4426950408889634f;
    const int M = get<0>(problem), N = get<1>(problem);
    constexpr int BM = size<0>(BlockShapeMNK{}), BN = size<1>(BlockShapeMNK{});
    const int m_tile = get<0>(blk_coord), n_tile = get<1>(blk_coord);
    auto& acc = const_cast<cute::Tensor<FrgEngine, FrgLayout>&>(acc_in);

    // The accumulator fragment of a 64 x N warpgroup product: value mode (2, 2, N/8) =
    // (column pair, row half, column group); then MMA_M, MMA_N. A row of the tile sits in one
    // quad of lanes; a thread holds rows (m, v1): 2 * MMA_M of them.
    static_assert(rank(FrgLayout{}) == 3 && rank<0>(FrgLayout{}) == 3, "sm90 accumulator layout expected");
    constexpr int V0 = size<0, 0>(FrgLayout{}), V1 = size<0, 1>(FrgLayout{}), V2 = size<0, 2>(FrgLayout{});
    constexpr int MM = size<1>(FrgLayout{}), MN = size<2>(FrgLayout{});
    static_assert(V0 == 2 && V1 == 2, "sm90 accumulator value mode (2, 2, N/8) expected");
    constexpr int kRows = V1 * MM;

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor cD = make_identity_tensor(make_shape(Int<BM>{}, Int<BN>{}));
    Tensor tCcD = thr_mma.partition_C(cD);  // same shape as acc: each value's (row, col) in the tile
    const int row0 = m_tile * BM, col0 = n_tile * BN;

    float rmax[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) rmax[r] = -INFINITY;
    if constexpr (kMode != Mode::Plain && kMode != Mode::StagedShift)
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < MM; ++m)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < V1; ++v1)
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < MN; ++n)
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2)
            CUTLASS_PRAGMA_UNROLL
            for (int v0 = 0; v0 < V0; ++v0) {
              auto c = make_coord(make_coord(v0, v1, v2), m, n);
              const bool in = col0 + get<1>(tCcD(c)) < N;
              rmax[m * V1 + v1] = fmaxf(rmax[m * V1 + v1], in ? acc(c) : -INFINITY);
            }
    float koff[kRows], ssum[kRows], usum[kRows];
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 1));
      rmax[r] = fmaxf(rmax[r], __shfl_xor_sync(0xffffffffu, rmax[r], 2));
      koff[r] = ceilf(rmax[r] * kLog2e);
      if constexpr (kMode == Mode::StagedShift) {
        const int row = row0 + get<0>(tCcD(make_coord(make_coord(0, r % V1, 0), r / V1, 0)));
        koff[r] = row < M ? params.shift[row] : 0.0f;
      }
      ssum[r] = 0.0f;
      usum[r] = 0.0f;
    }
    if constexpr (kMode == Mode::StagedTma) {
      static_assert(MN == 1 && (V2 * 8) % kTmaCols == 0, "one MMA along N, whole passes");
      constexpr int kGroups = kTmaCols / 8;  // column groups of 8 (16 bytes) per pass
      auto* stage = reinterpret_cast<SharedStorage*>(smem)->stage;
      char* stage_bytes = reinterpret_cast<char*>(stage);
      const uint32_t sbase = cute::cast_smem_ptr_to_uint(stage);  // 128-byte aligned (SharedStorage)
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
              const bool in = col0 + col < N;
              const float z0 = acc(c0), z1 = acc(c1);
              const float e0 = in ? ex2(fmaf(z0, kLog2e, -koff[r])) : 0.0f;
              const float e1 = in ? ex2(fmaf(z1, kLog2e, -koff[r])) : 0.0f;
              ssum[r] += e0 + e1;
              usum[r] = fmaf(e0, z0, fmaf(e1, z1, usum[r]));
              // 128-byte swizzle: the 16-byte chunk c of a 128-byte line sits at chunk c ^ (the
              // line's address bits 7-9), so the phase follows the stage's address
              const int cb = (col - pass * kTmaCols) * 2;
              const int line = int((sbase >> 7) + uint32_t(lrow)) & 7;
              const int at = lrow * 128 + (((cb >> 4) ^ line) << 4) + (cb & 15);
              *reinterpret_cast<__nv_bfloat162*>(stage_bytes + at) = __floats2bfloat162_rn(e0, e1);
            }
          }
        cute::tma_store_fence();  // the stage's generic writes before the async proxy reads it
        bar.arrive_and_wait();
        if (thread_idx == 0) {
          cute::SM90_TMA_STORE_2D::copy(&kernel_params.tmap, stage, col0 + pass * kTmaCols, row0);
          cute::tma_store_arrive();
          cute::tma_store_wait<0>();  // the stage read: it may be written again
        }
        bar.arrive_and_wait();
      }
    } else if constexpr (kMode == Mode::Staged || kMode == Mode::StagedShift) {
      static_assert(MN == 1 && (V2 * 8) % kPassCols == 0, "one MMA along N, whole passes");
      constexpr int kGroups = kPassCols / 8;  // column groups of 8 per pass
      auto* stage = reinterpret_cast<SharedStorage*>(smem)->stage;
      // One barrier per consumer warpgroup (ids after CUTLASS's reserved ones).
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
              const bool in = col0 + col < N;
              const float z0 = acc(c0), z1 = acc(c1);
              const float e0 = in ? ex2(fmaf(z0, kLog2e, -koff[r])) : 0.0f;
              const float e1 = in ? ex2(fmaf(z1, kLog2e, -koff[r])) : 0.0f;
              ssum[r] += e0 + e1;
              usum[r] = fmaf(e0, z0, fmaf(e1, z1, usum[r]));
              *reinterpret_cast<__nv_bfloat162*>(stage + lrow * kStageLd + col - pass * kPassCols) =
                  __floats2bfloat162_rn(e0, e1);
            }
          }
        bar.arrive_and_wait();
        // 16-byte pieces along rows: 6 a row, 768 a pass, 6 a thread.
        constexpr int kPieces = kPassCols / 8;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < BM * kPieces / 128; ++i) {
          const int piece = thread_idx + 128 * i;
          const int lrow = piece / kPieces, seg = piece % kPieces;
          const int row = row0 + lrow, col = col0 + pass * kPassCols + seg * 8;
          const uint4 v = *reinterpret_cast<const uint4*>(stage + lrow * kStageLd + seg * 8);
          if (row < M) {
            if (col + 8 <= N) {
              *reinterpret_cast<uint4*>(params.e + row * params.ldE + col) = v;
            } else {
              const __nv_bfloat16* h = reinterpret_cast<const __nv_bfloat16*>(&v);
              for (int j = 0; j < 8 && col + j < N; ++j) params.e[row * params.ldE + col + j] = h[j];
            }
          }
        }
        bar.arrive_and_wait();
      }
    } else {
    CUTLASS_PRAGMA_UNROLL
    for (int m = 0; m < MM; ++m)
      CUTLASS_PRAGMA_UNROLL
      for (int v1 = 0; v1 < V1; ++v1) {
        const int r = m * V1 + v1;
        const int row = row0 + get<0>(tCcD(make_coord(make_coord(0, v1, 0), m, 0)));
        CUTLASS_PRAGMA_UNROLL
        for (int n = 0; n < MN; ++n)
          CUTLASS_PRAGMA_UNROLL
          for (int v2 = 0; v2 < V2; ++v2) {
            auto c0 = make_coord(make_coord(0, v1, v2), m, n);
            auto c1 = make_coord(make_coord(1, v1, v2), m, n);
            const int col = get<1>(tCcD(c0));  // even
            const bool in = col0 + col < N;    // N even: the pair is in or out together
            const float z0 = acc(c0), z1 = acc(c1);
            if constexpr (kMode == Mode::Plain) {
              if (in && row < M)
                *reinterpret_cast<__nv_bfloat162*>(params.e + row * params.ldE + col0 + col) = __floats2bfloat162_rn(z0, z1);
              continue;
            }
            const float e0 = in ? ex2(fmaf(z0, kLog2e, -koff[r])) : 0.0f;
            const float e1 = in ? ex2(fmaf(z1, kLog2e, -koff[r])) : 0.0f;
            ssum[r] += e0 + e1;
            usum[r] = fmaf(e0, z0, fmaf(e1, z1, usum[r]));
            if (kMode == Mode::Full && in && row < M) {
              __nv_bfloat162 p = __floats2bfloat162_rn(e0, e1);
              *reinterpret_cast<__nv_bfloat162*>(params.e + row * params.ldE + col0 + col) = p;
            }
          }
      }
    }
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < kRows; ++r) {
      ssum[r] += __shfl_xor_sync(0xffffffffu, ssum[r], 1);
      ssum[r] += __shfl_xor_sync(0xffffffffu, ssum[r], 2);
      usum[r] += __shfl_xor_sync(0xffffffffu, usum[r], 1);
      usum[r] += __shfl_xor_sync(0xffffffffu, usum[r], 2);
    }
    if (kMode != Mode::Plain && (thread_idx & 3) == 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int m = 0; m < MM; ++m)
        CUTLASS_PRAGMA_UNROLL
        for (int v1 = 0; v1 < V1; ++v1) {
          const int r = m * V1 + v1;
          const int row = row0 + get<0>(tCcD(make_coord(make_coord(0, v1, 0), m, 0)));
          // The scheduler's swizzle pads the tile grid to whole swizzle groups: a padded N-tile
          // (n_tile >= tiles) holds no column, and its row's slot would be the next row's first
          // tiles (row * tiles + n_tile), so it writes nothing.
          if (row < M && n_tile < params.tiles) {
            const int64_t at = int64_t(row) * params.tiles + n_tile;
            params.k[at] = koff[r];
            params.s[at] = ssum[r];
            params.u[at] = usum[r];
          }
        }
    }
  }

 private:
  Params params;
  // The kernel's own parameter (a __grid_constant__, which the adapter passes by reference):
  // TMA reads the tensor map there, never from a copy in registers or local memory.
  Params const& kernel_params;
};

template <class Stride>
Stride with_ld(int64_t ld) {
  Stride s{};
  if constexpr (!is_static<remove_cvref_t<decltype(get<0>(s))>>::value) get<0>(s) = ld;
  if constexpr (!is_static<remove_cvref_t<decltype(get<1>(s))>>::value) get<1>(s) = ld;
  return s;
}

using Tile192 = Shape<_128, _192, _64>;
using Cluster21 = Shape<_2, _1, _1>;

// The product with the scaled-exp epilogue: ping-pong (each consumer warpgroup its own tile;
// one warpgroup's epilogue runs while the other's main loop does).
template <Mode kMode>
struct ExpKernel {
  using Epi = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<ScaledExpEpilogue<Tile192, kMode>>;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, RM, 8, bf16, CM, 8, float, Tile192, Cluster21,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      cutlass::gemm::KernelTmaWarpSpecializedPingpong>::CollectiveOp;
  using GK = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;
};

// The same product writing plain bf16 logits with CUTLASS's TMA epilogue.
template <class Tile, class KSched, class ESched>
struct PlainKernel {
  using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster21, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, RM, 8, bf16, RM, 8, ESched>::CollectiveOp;
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, RM, 8, bf16, CM, 8, float, Tile, Cluster21,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KSched>::CollectiveOp;
  using GK = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;
};
using PlainPingPong = PlainKernel<Tile192, cutlass::gemm::KernelTmaWarpSpecializedPingpong, cutlass::epilogue::TmaWarpSpecialized>;
using PlainCoop = PlainKernel<Shape<_256, _192, _64>, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                              cutlass::epilogue::TmaWarpSpecializedCooperative>;

cutlass::KernelHardwareInfo hw_info() {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  return hw;
}

template <class G>
struct Runner {
  typename G::Gemm gemm;
  bool ok = false;
  bool init(typename G::Gemm::Arguments args, Raster raster, int swizzle, void* ws, size_t wsb, cudaStream_t s) {
    args.scheduler.raster_order = raster;
    args.scheduler.max_swizzle_size = swizzle;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
    if (G::Gemm::get_workspace_size(args) > wsb) return false;
    ok = gemm.initialize(args, ws, s) == cutlass::Status::kSuccess;
    return ok;
  }
  void run(cudaStream_t s) { gemm.run(s); }
};

template <class G>
typename G::Gemm::Arguments exp_args(int M, int N, int K, const bf16* A, const bf16* W, ScaledExpOut out) {
  using GK = typename G::GK;
  return {cutlass::gemm::GemmUniversalMode::kGemm,
          {M, N, K, 1},
          {A, with_ld<typename GK::StrideA>(K), W, with_ld<typename GK::StrideB>(K)},
          out,
          hw_info()};
}

template <class G>
typename G::Gemm::Arguments plain_args(int M, int N, int K, const bf16* A, const bf16* W, bf16* D) {
  using GK = typename G::GK;
  typename G::Gemm::Arguments a{cutlass::gemm::GemmUniversalMode::kGemm,
                                {M, N, K, 1},
                                {A, with_ld<typename GK::StrideA>(K), W, with_ld<typename GK::StrideB>(K)},
                                {{}, nullptr, with_ld<typename GK::StrideC>(N), D, with_ld<typename GK::StrideD>(N)},
                                hw_info()};
  a.epilogue.thread.alpha = 1.0f;
  a.epilogue.thread.beta = 0.0f;
  return a;
}

/// The merge of the per-tile partials: one warp a row. lse, entropy.
__global__ void merge_rows(const float* k, const float* s, const float* u, int tiles, int M, float* lse, float* ent) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= M) return;
  const float* kr = k + int64_t(row) * tiles;
  float K = -INFINITY;
  for (int t = lane; t < tiles; t += 32) K = fmaxf(K, kr[t]);
  for (int o = 16; o > 0; o /= 2) K = fmaxf(K, __shfl_xor_sync(0xffffffffu, K, o));
  float S = 0, U = 0;
  for (int t = lane; t < tiles; t += 32) {
    const float f = exp2f(kr[t] - K);  // exact: an integer power of two
    S = fmaf(s[int64_t(row) * tiles + t], f, S);
    U = fmaf(u[int64_t(row) * tiles + t], f, U);
  }
  for (int o = 16; o > 0; o /= 2) {
    S += __shfl_xor_sync(0xffffffffu, S, o);
    U += __shfl_xor_sync(0xffffffffu, U, o);
  }
  if (lane == 0) {
    const float l = 0.69314718055994531f * (K + log2f(S));
    lse[row] = l;
    ent[row] = l - U / S;
  }
}

/// The target's logit per row, h_i . w_{t_i} in float32 (one warp a row): a gather of N rows of
/// the weight, so the epilogue's inner loop carries no compare against the target.
__global__ void target_dot(const bf16* A, const bf16* W, const int* tgt, int M, int K, float* out) {
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (row >= M) return;
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(A + int64_t(row) * K);
  const __nv_bfloat162* w = reinterpret_cast<const __nv_bfloat162*>(W + int64_t(tgt[row]) * K);
  float acc = 0;
  for (int j = lane; j < K / 2; j += 32) {
    const float2 x = __bfloat1622float2(a[j]), y = __bfloat1622float2(w[j]);
    acc = fmaf(x.x, y.x, fmaf(x.y, y.y, acc));
  }
  for (int o = 16; o > 0; o /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, o);
  if (lane == 0) out[row] = acc;
}

__global__ void fill_random(bf16* p, size_t n, float scale, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    const float u = (x & 0xffff) / 65536.0f + (x >> 16) / 65536.0f - 1.0f;
    p[i] = bf16(u * scale);
  }
}

__global__ void fill_targets(int* t, int M, int V, uint32_t seed) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < M) t[i] = int((uint32_t(i) * 2654435761u ^ seed) % uint32_t(V));
}

/// float64 reference per row from float32 logits z (cuBLASLt, float32 out): lse, entropy; and
/// the worst relative error of E against 2^(z log2 e - k) with the kernel's k. One block a row.
__global__ void check_rows(const float* z, int N, const __nv_bfloat16* E, const float* kpart, int tiles, int tile_n,
                           const float* lse, const float* ent, const int* target, const float* tlogit, float* worst) {
  const int row = blockIdx.x;
  const float* zr = z + int64_t(row) * N;
  __shared__ double red[256];
  double m = -INFINITY;
  for (int j = threadIdx.x; j < N; j += blockDim.x) m = fmax(m, double(zr[j]));
  red[threadIdx.x] = m;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] = fmax(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  m = red[0];
  __syncthreads();
  double s = 0, zs = 0;
  float we = 0;
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    const double e = exp(double(zr[j]) - m);
    s += e;
    zs += e * zr[j];
    const double k = kpart[int64_t(row) * tiles + j / tile_n];
    const double ref = exp2(double(zr[j]) * 1.4426950408889634 - k);
    const double got = double(__bfloat162float(E[int64_t(row) * N + j]));
    we = fmaxf(we, float(fabs(got - ref) / fmax(ref, 1e-30)));
  }
  red[threadIdx.x] = s;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  s = red[0];
  __syncthreads();
  red[threadIdx.x] = zs;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] += red[threadIdx.x + w];
    __syncthreads();
  }
  zs = red[0];
  atomicMax(reinterpret_cast<int*>(&worst[0]), __float_as_int(we));
  if (threadIdx.x == 0) {
    const double l = m + log(s);
    const double h = l - zs / s;
    atomicMax(reinterpret_cast<int*>(&worst[1]), __float_as_int(float(fabs(lse[row] - l))));
    atomicMax(reinterpret_cast<int*>(&worst[2]), __float_as_int(float(fabs(ent[row] - h))));
    atomicMax(reinterpret_cast<int*>(&worst[3]), __float_as_int(float(fabs(tlogit[row] - zr[target[row]]))));
  }
}

/// The second reference: logits of sampled rows as float64 dot products of the bf16 operands
/// (no cuBLASLt), z64 (rows x N). One thread a column.
__global__ void z_f64(const bf16* A, const bf16* W, const int* rows, int K, int N, double* z64) {
  const int r = blockIdx.y;
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= N) return;
  const bf16* a = A + int64_t(rows[r]) * K;
  const bf16* w = W + int64_t(j) * K;
  double acc = 0.0;
  for (int k = 0; k < K; ++k) acc += double(float(a[k])) * double(float(w[k]));
  z64[int64_t(r) * N + j] = acc;
}

/// Per sampled row (one block each): lse and entropy in float64 from z64, and from the float32
/// cuBLASLt logits Z; worst[0] = max |lse - lse64| of the kernel under test, worst[1] the same
/// for the cuBLASLt float32 reference, worst[2] = max |entropy - entropy64| of the kernel.
__global__ void check_f64(const double* z64, const float* Z, const int* rows, int N, const float* lse,
                          const float* ent, float* worst) {
  const int r = blockIdx.x, row = rows[r];
  __shared__ double red[256];
  auto reduce = [&](double v, bool is_max) {
    red[threadIdx.x] = v;
    __syncthreads();
    for (int w = blockDim.x / 2; w > 0; w /= 2) {
      if (threadIdx.x < w) red[threadIdx.x] = is_max ? fmax(red[threadIdx.x], red[threadIdx.x + w])
                                                     : red[threadIdx.x] + red[threadIdx.x + w];
      __syncthreads();
    }
    const double out = red[0];
    __syncthreads();
    return out;
  };
  const double* z = z64 + int64_t(r) * N;
  const float* zf = Z + int64_t(row) * N;
  double m = -INFINITY, mf = -INFINITY;
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    m = fmax(m, z[j]);
    mf = fmax(mf, double(zf[j]));
  }
  m = reduce(m, true);
  mf = reduce(mf, true);
  double s = 0, zs = 0, sf = 0;
  for (int j = threadIdx.x; j < N; j += blockDim.x) {
    const double e = exp(z[j] - m);
    s += e;
    zs += e * z[j];
    sf += exp(double(zf[j]) - mf);
  }
  s = reduce(s, false);
  zs = reduce(zs, false);
  sf = reduce(sf, false);
  if (threadIdx.x == 0) {
    const double l = m + log(s), h = l - zs / s, lf = mf + log(sf);
    atomicMax(reinterpret_cast<int*>(&worst[0]), __float_as_int(float(fabs(lse[row] - l))));
    atomicMax(reinterpret_cast<int*>(&worst[1]), __float_as_int(float(fabs(lf - l))));
    atomicMax(reinterpret_cast<int*>(&worst[2]), __float_as_int(float(fabs(ent[row] - h))));
  }
}

/// The shifted variant's per-row offset: ceil(max_j z_ij log2 e) + margin (log2 units).
__global__ void row_shift(const float* z, int N, float margin, float* shift) {
  const float* row = z + int64_t(blockIdx.x) * N;
  __shared__ float red[256];
  float m = -INFINITY;
  for (int j = threadIdx.x; j < N; j += blockDim.x) m = fmaxf(m, row[j]);
  red[threadIdx.x] = m;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w /= 2) {
    if (threadIdx.x < w) red[threadIdx.x] = fmaxf(red[threadIdx.x], red[threadIdx.x + w]);
    __syncthreads();
  }
  if (threadIdx.x == 0) shift[blockIdx.x] = ceilf(red[0] * 1.4426950408889634f) + margin;
}

// ---- Per-(row, tile) checks of the partials ----

constexpr int kTileN = 192;  // the N extent of Tile192: one partial per 192 columns
// Per-(row, tile) flags. A pair is bad (kPartialBad) when S or U is off by more than
// kPartialTol, k is off by more than one, or a value is not finite.
enum : uint8_t {
  kBadS = 1,        // S 2^k against sum_j e^z: relative error > kPartialTol
  kBadU = 2,        // U 2^k against sum_j e^z z: error relative to sum_j e^z |z| > kPartialTol
  kOff1 = 4,        // k one off the expected (may be the rounding of z at an integer)
  kOffMore = 8,     // k off by more than one
  kNonFinite = 16,  // k, S or U not finite
  kBadE = 32,       // E against 2^(z log2 e - k), k the kernel's: relative error > kETol
  kDiffers = 64,    // second run: written, but bitwise not the first run's value
  kUnwritten = 128  // second run: still the NaN sentinel
};
constexpr uint8_t kPartialBad = kBadS | kBadU | kOffMore | kNonFinite;
constexpr double kPartialTol = 1e-3, kMatchTol = 1e-4, kETol = 1e-2;
// Candidate slots for a misplaced partial: every row of the pair's 128-row M-tile and rows
// +-128, +-256, each at N-tiles t-2..t+2.
constexpr int kNearRows = 128 + 4, kNearTiles = 5;

__host__ __device__ inline bool finite_f(float x) { return fabsf(x) <= 3.402823466e38f; }

/// A kernel partial (k, S, U) against one slot's reference (rl = ln sum_j e^z, ru and ra = the
/// e^z-weighted means of z and |z|): rel = S 2^k / sum_j e^z - 1, se = |rel|, ue = the error of
/// U 2^k relative to sum_j e^z |z|. Infinite where a value is not finite or S <= 0.
__host__ __device__ inline void pair_errors(float k, float s, float u, double rl, double ru, double ra, double& rel,
                                            double& se, double& ue) {
  if (!(finite_f(k) && finite_f(s) && finite_f(u) && s > 0.0f)) {
    rel = se = ue = INFINITY;
    return;
  }
  const double d = double(k) * 0.69314718055994531 - rl;  // ln(2^k / sum_j e^z)
  rel = expm1(d + log(double(s)));
  se = fabs(rel);
  ue = fabs(double(u) * exp(d) - ru) / fmax(ra, 1e-300);
  if (!(se <= 1e300)) se = INFINITY;
  if (!(ue <= 1e300)) ue = INFINITY;
}

/// The float64 reference per (row, tile) from the float32 logits z (one warp a pair): rl = ln
/// sum_j e^z_ij, ru = sum_j e^z z / sum_j e^z, ra = sum_j e^z |z| / sum_j e^z, and rk =
/// ceil(max_j z log2 e) formed in float32 as the epilogue forms it.
__global__ void ref_tiles(const float* z, int M, int N, int tiles, double* rl, double* ru, double* ra, float* rk) {
  const int lane = threadIdx.x & 31;
  const int64_t P = int64_t(M) * tiles, nw = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t p = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; p < P; p += nw) {
    const int row = int(p / tiles), t = int(p % tiles);
    const float* zr = z + int64_t(row) * N + int64_t(t) * kTileN;
    const int n = min(kTileN, N - t * kTileN);
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, zr[j]);
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    double s = 0, su = 0, sa = 0;
    for (int j = lane; j < n; j += 32) {
      const double zj = zr[j], e = exp(zj - double(m));
      s += e;
      su += e * zj;
      sa += e * fabs(zj);
    }
    for (int o = 16; o > 0; o /= 2) {
      s += __shfl_xor_sync(0xffffffffu, s, o);
      su += __shfl_xor_sync(0xffffffffu, su, o);
      sa += __shfl_xor_sync(0xffffffffu, sa, o);
    }
    if (lane == 0) {
      rl[p] = double(m) + log(s);
      ru[p] = su / s;
      ra[p] = sa / s;
      rk[p] = ceilf(m * 1.4426950408889634f);
    }
  }
}

/// Device buffers of the partials check, (rows x tiles) each unless said.
struct PairBufs {
  double *rl, *ru, *ra;  // reference (ref_tiles)
  float* rk;
  uint8_t* flags;
  int* match;        // bad pairs: the nearest other slot, (drow + 1024) * 8 + (dt + 2); -1: none
  float* match_err;  // bad pairs: that slot's error, max(S, U)
  float* ratio;      // S 2^k / sum_j e^z
  float* worst;      // 3: worst S, U and E errors (float bits, atomicMax)
};

/// Every (row, tile) partial of one kernel run against the reference (one warp a pair): flags,
/// the S ratio and the worst errors; with `search`, each bad pair's nearest other slot among the
/// candidates. kexp_row: the given per-row offset (StagedShift), else k is expected to be the
/// tile's ceil(max log2 e). E: the stored E (rows x N), or null.
__global__ void check_partials(const float* z, int M, int N, int tiles, const float* k, const float* s,
                               const float* u, const float* kexp_row, const __nv_bfloat16* E, PairBufs b,
                               int search) {
  const int lane = threadIdx.x & 31;
  const int64_t P = int64_t(M) * tiles, nw = int64_t(gridDim.x) * (blockDim.x / 32);
  double ws = 0, wu = 0, we = 0;
  for (int64_t p = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; p < P; p += nw) {
    const int row = int(p / tiles), t = int(p % tiles);
    const float kk = k[p], ss = s[p], uu = u[p];
    double rel, se, ue;
    pair_errors(kk, ss, uu, b.rl[p], b.ru[p], b.ra[p], rel, se, ue);
    const float ke = kexp_row ? kexp_row[row] : b.rk[p];
    uint8_t f = 0;
    if (!(finite_f(kk) && finite_f(ss) && finite_f(uu))) f |= kNonFinite;
    if (!(se <= kPartialTol)) f |= kBadS;
    if (!(ue <= kPartialTol)) f |= kBadU;
    const float dk = fabsf(kk - ke);
    if (dk == 1.0f)
      f |= kOff1;
    else if (!(dk == 0.0f))
      f |= kOffMore;
    double e_err = 0;
    if (E) {
      const int n = min(kTileN, N - t * kTileN);
      const float* zr = z + int64_t(row) * N + int64_t(t) * kTileN;
      const __nv_bfloat16* er = E + int64_t(row) * N + int64_t(t) * kTileN;
      for (int j = lane; j < n; j += 32) {
        const double ref = exp2(double(zr[j]) * 1.4426950408889634 - double(kk));
        double err = fabs(double(__bfloat162float(er[j])) - ref) / fmax(ref, 1e-30);
        if (!(err <= 1e300)) err = INFINITY;
        e_err = fmax(e_err, err);
      }
      for (int o = 16; o > 0; o /= 2) e_err = fmax(e_err, __shfl_xor_sync(0xffffffffu, e_err, o));
      if (!(e_err <= kETol)) f |= kBadE;
    }
    ws = fmax(ws, se);
    wu = fmax(wu, ue);
    we = fmax(we, e_err);
    if (search && (f & kPartialBad)) {  // warp-uniform: every lane has the same f
      const int rb = row & ~127;
      float best = INFINITY;
      int code = -1;
      for (int ci = lane; ci < kNearRows * kNearTiles; ci += 32) {
        const int rc = ci / kNearTiles, dt = ci % kNearTiles - kNearTiles / 2;
        const int r2 = rc < 128 ? rb + rc : row + (rc == 128 ? -256 : rc == 129 ? -128 : rc == 130 ? 128 : 256);
        const int t2 = t + dt;
        if (r2 < 0 || r2 >= M || t2 < 0 || t2 >= tiles || (r2 == row && t2 == t)) continue;
        const int64_t q = int64_t(r2) * tiles + t2;
        double rel2, se2, ue2;
        pair_errors(kk, ss, uu, b.rl[q], b.ru[q], b.ra[q], rel2, se2, ue2);
        const float e2 = float(fmax(se2, ue2));
        if (e2 < best) best = e2, code = (r2 - row + 1024) * 8 + (dt + kNearTiles / 2);
      }
      for (int o = 16; o > 0; o /= 2) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oc = __shfl_xor_sync(0xffffffffu, code, o);
        if (ob < best || (ob == best && oc > code)) best = ob, code = oc;
      }
      if (lane == 0) {
        b.match[p] = code;
        b.match_err[p] = best;
      }
    }
    if (lane == 0) {
      b.flags[p] = f;
      b.ratio[p] = float(1.0 + rel);
    }
  }
  if (lane == 0) {
    atomicMax(reinterpret_cast<int*>(&b.worst[0]), __float_as_int(float(ws)));
    atomicMax(reinterpret_cast<int*>(&b.worst[1]), __float_as_int(float(wu)));
    atomicMax(reinterpret_cast<int*>(&b.worst[2]), __float_as_int(float(we)));
  }
}

/// The second run's partials against the first run's (saved in k1, s1, u1): kUnwritten where a
/// value is still the NaN sentinel (all bits set), else kDiffers where one differs bitwise.
__global__ void diff_partials(const float* k, const float* s, const float* u, const float* k1, const float* s1,
                              const float* u1, int64_t P, uint8_t* flags) {
  for (int64_t p = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; p < P; p += int64_t(gridDim.x) * blockDim.x) {
    const uint32_t a = __float_as_uint(k[p]), c = __float_as_uint(s[p]), e = __float_as_uint(u[p]);
    uint8_t f = flags[p];
    if (a == 0xffffffffu || c == 0xffffffffu || e == 0xffffffffu)
      f |= kUnwritten;
    else if (a != __float_as_uint(k1[p]) || c != __float_as_uint(s1[p]) || e != __float_as_uint(u1[p]))
      f |= kDiffers;
    flags[p] = f;
  }
}

/// The reference itself per tile at the sampled rows: ln sum_j e^z from the cuBLASLt float32
/// logits (rl) against the float64 dot products (z64, one row per sampled row; one warp a pair).
/// worst: the largest relative difference of sum_j e^z; count and list (the first 8 by arrival,
/// as row * tiles + tile) of those over kPartialTol.
__global__ void check_ref_tiles(const double* z64, const int* rows, int nrows, int N, int tiles, const double* rl,
                                float* worst, unsigned* count, int* list) {
  const int lane = threadIdx.x & 31;
  const int64_t P = int64_t(nrows) * tiles, nw = int64_t(gridDim.x) * (blockDim.x / 32);
  for (int64_t p = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32; p < P; p += nw) {
    const int r = int(p / tiles), t = int(p % tiles);
    const double* zr = z64 + int64_t(r) * N + int64_t(t) * kTileN;
    const int n = min(kTileN, N - t * kTileN);
    double m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmax(m, zr[j]);
    for (int o = 16; o > 0; o /= 2) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    double sum = 0;
    for (int j = lane; j < n; j += 32) sum += exp(zr[j] - m);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) {
      const int64_t q = int64_t(rows[r]) * tiles + t;
      double err = fabs(expm1(rl[q] - (m + log(sum))));
      if (!(err <= 1e300)) err = INFINITY;
      atomicMax(reinterpret_cast<int*>(worst), __float_as_int(float(err)));
      if (!(err <= kPartialTol)) {
        const unsigned i = atomicAdd(count, 1u);
        if (i < 8) list[i] = int(q);
      }
    }
  }
}

/// Appends printf-formatted text.
void app(std::string& o, const char* fmt, ...) {
  char buf[4096];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  o += buf;
}

template <class T>
T dev_at(const T* p, int64_t i) {
  T v;
  CK(cudaMemcpy(&v, p + i, sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

/// Where the pairs with (flags & mask) lie: rows, N-tiles, the last N-tile, M-tiles of 128 rows
/// and output tiles of 128 x 192. Returns their count; prints nothing when there are none.
int64_t summarize(std::string& o, const char* what, const std::vector<uint8_t>& f, uint8_t mask, int M, int tiles) {
  const int mtiles = (M + 127) / 128;
  int64_t n = 0, in_last = 0;
  int rows = 0, rmin = M, rmax = -1, tmin = tiles, tmax = -1;
  std::vector<int> rows_mt(mtiles, 0);
  std::vector<int64_t> pairs_mt(mtiles, 0), pairs_nt(tiles, 0);
  std::vector<int> rows_blk(size_t(mtiles) * tiles, 0);  // bad rows per (M-tile, N-tile)
  for (int r = 0; r < M; ++r) {
    bool any = false;
    for (int t = 0; t < tiles; ++t)
      if (f[size_t(r) * tiles + t] & mask) {
        ++n;
        any = true;
        rmin = std::min(rmin, r);
        rmax = std::max(rmax, r);
        tmin = std::min(tmin, t);
        tmax = std::max(tmax, t);
        in_last += t == tiles - 1;
        ++pairs_mt[r / 128];
        ++pairs_nt[t];
        ++rows_blk[size_t(r / 128) * tiles + t];
      }
    if (any) ++rows, ++rows_mt[r / 128];
  }
  if (n == 0) return 0;
  auto rows_in = [&](int b) { return std::min(128, M - b * 128); };
  int mt_touched = 0, mt_whole = 0, blk_touched = 0, blk_whole = 0, nt_touched = 0;
  for (int b = 0; b < mtiles; ++b) {
    mt_touched += rows_mt[b] > 0;
    mt_whole += rows_mt[b] == rows_in(b);
    for (int t = 0; t < tiles; ++t) {
      blk_touched += rows_blk[size_t(b) * tiles + t] > 0;
      blk_whole += rows_blk[size_t(b) * tiles + t] == rows_in(b);
    }
  }
  for (int t = 0; t < tiles; ++t) nt_touched += pairs_nt[t] > 0;
  app(o, "partials:   %s: %lld (row, tile) pairs in %d rows; rows %d..%d, N-tiles %d..%d; in the last N-tile (%d) %lld, "
      "interior %lld; M-tiles (row / 128) touched %d of %d, every row bad in %d; N-tiles touched %d of %d; output tiles "
      "(128 x 192) touched %d, every row bad in %d\n",
      what, (long long)n, rows, rmin, rmax, tmin, tmax, tiles - 1, (long long)in_last, (long long)(n - in_last),
      mt_touched, mtiles, mt_whole, nt_touched, tiles, blk_touched, blk_whole);
  app(o, "partials:   %s per M-tile (M-tile:bad rows/bad pairs):", what);
  for (int b = 0; b < mtiles; ++b)
    if (rows_mt[b]) app(o, " %d:%d/%lld", b, rows_mt[b], (long long)pairs_mt[b]);
  app(o, "\n");
  app(o, "partials:   %s per N-tile (N-tile:bad pairs; the first 24 of %d touched):", what, nt_touched);
  for (int t = 0, shown = 0; t < tiles && shown < 24; ++t)
    if (pairs_nt[t]) app(o, " %d:%lld", t, (long long)pairs_nt[t]), ++shown;
  app(o, "\n");
  app(o, "partials:   %s output tiles ((M-tile, N-tile):bad rows; the first 16 of %d touched, M-tile-major):", what,
      blk_touched);
  for (int b = 0, shown = 0; b < mtiles && shown < 16; ++b)
    for (int t = 0; t < tiles && shown < 16; ++t)
      if (rows_blk[size_t(b) * tiles + t]) app(o, " (%d,%d):%d", b, t, rows_blk[size_t(b) * tiles + t]), ++shown;
  app(o, "\n");
  return n;
}

/// The partials check's buffers and its report for one kernel variant.
struct PartialsCheck {
  PairBufs b{};
  float *k1 = nullptr, *s1 = nullptr, *u1 = nullptr;  // the first run's partials, saved
  float* rworst = nullptr;
  unsigned* rcount = nullptr;
  int* rlist = nullptr;
  static constexpr int kGrid = 4096, kBlock = 256;

  void alloc(size_t pairs) {
    CK(cudaMalloc(&b.rl, pairs * 8));
    CK(cudaMalloc(&b.ru, pairs * 8));
    CK(cudaMalloc(&b.ra, pairs * 8));
    CK(cudaMalloc(&b.rk, pairs * 4));
    CK(cudaMalloc(&b.flags, pairs));
    CK(cudaMalloc(&b.match, pairs * 4));
    CK(cudaMalloc(&b.match_err, pairs * 4));
    CK(cudaMalloc(&b.ratio, pairs * 4));
    CK(cudaMalloc(&b.worst, 3 * 4));
    CK(cudaMalloc(&k1, pairs * 4));
    CK(cudaMalloc(&s1, pairs * 4));
    CK(cudaMalloc(&u1, pairs * 4));
    CK(cudaMalloc(&rworst, 4));
    CK(cudaMalloc(&rcount, 4));
    CK(cudaMalloc(&rlist, 8 * 4));
  }

  void reference(const float* Z, int M, int N, int tiles, cudaStream_t s) {
    ref_tiles<<<kGrid, kBlock, 0, s>>>(Z, M, N, tiles, b.rl, b.ru, b.ra, b.rk);
    CK(cudaGetLastError());
  }

  /// The reference's per-tile sums at the sampled rows against the float64 dot products.
  void reference_f64(std::string& o, const double* z64, const int* rows, int nrows, int N, int tiles, cudaStream_t s) {
    CK(cudaMemsetAsync(rworst, 0, 4, s));
    CK(cudaMemsetAsync(rcount, 0, 4, s));
    check_ref_tiles<<<kGrid, kBlock, 0, s>>>(z64, rows, nrows, N, tiles, b.rl, rworst, rcount, rlist);
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    float w;
    unsigned cnt;
    int list[8];
    CK(cudaMemcpy(&w, rworst, 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(&cnt, rcount, 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(list, rlist, sizeof list, cudaMemcpyDeviceToHost));
    app(o, "partials:   the reference's ln sum_j e^z per (row, tile) at %d sampled rows x %d tiles against float64 dot "
        "products of the operands: %u pairs > %.0e relative, worst %.2e",
        nrows, tiles, cnt, kPartialTol, w);
    for (unsigned i = 0; i < std::min(cnt, 8u); ++i) app(o, "%s(row %d, tile %d)", i ? " " : "; such pairs: ", list[i] / tiles, list[i] % tiles);
    app(o, "\n");
  }

  /// One variant: the first run's partials (as left in k, s, u by the caller's run) checked and
  /// summarized, then a second run (`run`) on sentinel-filled partials.
  template <class Run>
  void variant(std::string& o, const char* shape, const char* name, const char* config, Run run, const float* Z, int M,
               int N, int tiles, float* k, float* s, float* u, const float* kexp_row, const __nv_bfloat16* E,
               cudaStream_t st) {
    const int64_t P = int64_t(M) * tiles;
    std::vector<uint8_t> f(P);
    float w[3];
    auto check = [&](int search) {
      CK(cudaMemsetAsync(b.worst, 0, 12, st));
      check_partials<<<kGrid, kBlock, 0, st>>>(Z, M, N, tiles, k, s, u, kexp_row, E, b, search);
      CK(cudaStreamSynchronize(st));
      CK(cudaGetLastError());
      CK(cudaMemcpy(f.data(), b.flags, P, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(w, b.worst, 12, cudaMemcpyDeviceToHost));
    };
    auto count = [&](uint8_t mask) {
      int64_t n = 0;
      for (int64_t p = 0; p < P; ++p) n += (f[p] & mask) != 0;
      return n;
    };
    check(1);
    app(o, "partials: %s %s (%s): %lld (row, tile) pairs against the float32 reference (S 2^k vs sum_j e^z relative; "
        "U 2^k vs sum_j e^z z relative to sum_j e^z |z|; k vs %s; E vs 2^(z log2 e - k)%s): S > %.0e: %lld, U > %.0e: "
        "%lld, k off by 1: %lld, k off by more: %lld, not finite: %lld, E > %.0e: %lld; bad: %lld; worst S %.2e, U "
        "%.2e, E %.2e\n",
        shape, name, config, (long long)P, kexp_row ? "the given row offset" : "ceil(tile max log2 e)",
        E ? "" : ", not stored", kPartialTol, (long long)count(kBadS), kPartialTol, (long long)count(kBadU),
        (long long)count(kOff1), (long long)count(kOffMore), (long long)count(kNonFinite), kETol,
        (long long)count(kBadE), (long long)count(kPartialBad), w[0], w[1], w[2]);
    const int64_t nbad = summarize(o, "bad pairs", f, kPartialBad, M, tiles);
    if (nbad > 0) {
      std::vector<int> match(P);
      std::vector<float> merr(P), ratio(P);
      CK(cudaMemcpy(match.data(), b.match, P * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(merr.data(), b.match_err, P * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ratio.data(), b.ratio, P * 4, cudaMemcpyDeviceToHost));
      std::vector<int64_t> bad;
      bad.reserve(nbad);
      for (int64_t p = 0; p < P; ++p)
        if (f[p] & kPartialBad) bad.push_back(p);
      // S 2^k over the reference, across the bad pairs.
      std::vector<float> rb;
      rb.reserve(bad.size());
      for (int64_t p : bad) rb.push_back(ratio[p]);
      std::sort(rb.begin(), rb.end());
      app(o, "partials:   bad pairs' S 2^k / sum_j e^z: min %.6f, median %.6f, max %.6f\n", rb.front(),
          rb[rb.size() / 2], rb.back());
      // Another slot's reference matched (within kMatchTol): the partial landed in the wrong slot.
      std::vector<std::pair<int64_t, int>> hist;
      {
        std::vector<int64_t> counts(2048 * 8, 0);
        for (int64_t p : bad)
          if (match[p] >= 0 && merr[p] <= kMatchTol) ++counts[match[p]];
        for (int cde = 0; cde < 2048 * 8; ++cde)
          if (counts[cde]) hist.push_back({counts[cde], cde});
        std::sort(hist.rbegin(), hist.rend());
      }
      int64_t matched = 0;
      for (auto& h : hist) matched += h.first;
      app(o, "partials:   bad pairs matching another slot's reference within %.0e (S and U; candidates: N-tiles t-2..t+2 "
          "of the rows of the same M-tile and of rows +-128, +-256): %lld of %lld; by offset (row, tile):count, the 8 "
          "most frequent:",
          kMatchTol, (long long)matched, (long long)nbad);
      for (size_t i = 0; i < std::min<size_t>(hist.size(), 8); ++i)
        app(o, " (%+d,%+d):%lld", hist[i].second / 8 - 1024, hist[i].second % 8 - kNearTiles / 2,
            (long long)hist[i].first);
      app(o, "\n");
      // The first four bad pairs in row-major order, those at the quartiles and the last.
      std::vector<int64_t> pick;
      for (int64_t i : {int64_t(0), int64_t(1), int64_t(2), int64_t(3), nbad / 4, nbad / 2, 3 * nbad / 4, nbad - 1})
        if (i < nbad && std::find(pick.begin(), pick.end(), i) == pick.end()) pick.push_back(i);
      std::sort(pick.begin(), pick.end());
      app(o, "partials:   %d bad pairs (in row-major order: the first four, those at the quartiles, the last):\n",
          int(pick.size()));
      for (int64_t i : pick) {
        const int64_t p = bad[size_t(i)];
        const int row = int(p / tiles), t = int(p % tiles);
        const float kk = dev_at(k, p), ss = dev_at(s, p), uu = dev_at(u, p);
        const double rl = dev_at(b.rl, p), ru = dev_at(b.ru, p), ra = dev_at(b.ra, p);
        const float ke = kexp_row ? dev_at(kexp_row, int64_t(row)) : dev_at(b.rk, p);
        double rel, se, ue;
        pair_errors(kk, ss, uu, rl, ru, ra, rel, se, ue);
        char fl[64] = "";
        if (f[p] & kBadS) strcat(fl, " S");
        if (f[p] & kBadU) strcat(fl, " U");
        if (f[p] & kOff1) strcat(fl, " k+-1");
        if (f[p] & kOffMore) strcat(fl, " k");
        if (f[p] & kNonFinite) strcat(fl, " non-finite");
        if (f[p] & kBadE) strcat(fl, " E");
        app(o, "partials:     row %d (M-tile %d, row %d in it), N-tile %d%s: kernel k %g, S %.6e, U %.6e, ln(S 2^k) "
            "%.7f, U/S %.6f; reference k %g, ln sum_j e^z %.7f, sum_j e^z z / sum_j e^z %.6f; S 2^k / reference "
            "%.6f, U error %.2e; flags:%s; nearest other slot (row %+d, tile %+d): error %.2e%s\n",
            row, row / 128, row % 128, t, t == tiles - 1 ? " (last)" : "", kk, ss, uu,
            log(double(ss)) + double(kk) * 0.69314718055994531, double(uu) / double(ss), ke, rl, ru, 1.0 + rel, ue,
            fl, match[p] >= 0 ? match[p] / 8 - 1024 : 0, match[p] >= 0 ? match[p] % 8 - kNearTiles / 2 : 0,
            merr[p], match[p] >= 0 && merr[p] <= kMatchTol ? " (matches)" : "");
      }
    }
    if (count(kBadE) > 0) summarize(o, "E > 1e-2", f, kBadE, M, tiles);
    // The second run: partials filled with the NaN sentinel first.
    CK(cudaMemcpyAsync(k1, k, P * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemcpyAsync(s1, s, P * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemcpyAsync(u1, u, P * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemsetAsync(k, 0xff, P * 4, st));
    CK(cudaMemsetAsync(s, 0xff, P * 4, st));
    CK(cudaMemsetAsync(u, 0xff, P * 4, st));
    run();
    check(0);
    diff_partials<<<kGrid, kBlock, 0, st>>>(k, s, u, k1, s1, u1, P, b.flags);
    CK(cudaStreamSynchronize(st));
    CK(cudaGetLastError());
    CK(cudaMemcpy(f.data(), b.flags, P, cudaMemcpyDeviceToHost));
    app(o, "partials: %s %s, second run on partials filled with a NaN sentinel: unwritten %lld, written but bitwise not "
        "the first run's %lld, bad %lld (unwritten ones included), E > %.0e %lld; worst S %.2e, U %.2e, E %.2e\n",
        shape, name, (long long)count(kUnwritten), (long long)count(kDiffers), (long long)count(kPartialBad), kETol,
        (long long)count(kBadE), w[0], w[1], w[2]);
    summarize(o, "unwritten", f, kUnwritten, M, tiles);
    summarize(o, "differing from the first run", f, kDiffers, M, tiles);
    // The first run's partials back, so that what runs next finds them as it would without this
    // check (a slot the next kernel leaves unwritten keeps what it held).
    CK(cudaMemcpyAsync(k, k1, P * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemcpyAsync(s, s1, P * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaMemcpyAsync(u, u1, P * 4, cudaMemcpyDeviceToDevice, st));
    CK(cudaStreamSynchronize(st));
  }
};

template <class F>
float time_it(F f, cudaStream_t s, int reps = 15) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  std::vector<float> t;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s);
    f();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    t.push_back(ms);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// cuBLASLt: row-major D (M x N) = A (M x K, row-major) W^T (W: N x K row-major); D's type dt.
/// Untimed: 0, or -1 where no algorithm was found, -2 where the product failed.
struct Lt {
  cublasLtHandle_t h;
  Lt() { cublasLtCreate(&h); }
  float run(int M, int N, int K, const bf16* A, const bf16* W, void* D, cudaDataType_t dt, void* ws, size_t wsb,
            cudaStream_t s, bool timed) {
    cublasLtMatmulDesc_t op;
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasOperation_t t = CUBLAS_OP_T, n = CUBLAS_OP_N;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &n, sizeof(n));
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, N, K);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, K, M, K);
    cublasLtMatrixLayoutCreate(&ld, dt, N, M, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    cublasLtMatmulHeuristicResult_t r;
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &r, &found);
    if (found == 0) return -1;
    float alpha = 1, beta = 0;
    auto f = [&] { cublasLtMatmul(h, op, &alpha, W, la, A, lb, &beta, D, ld, D, ld, &r.algo, ws, wsb, s); };
    if (!timed)  // -2: the product failed (the reference's product is reported by the partials check)
      return cublasLtMatmul(h, op, &alpha, W, la, A, lb, &beta, D, ld, D, ld, &r.algo, ws, wsb, s) ==
                     CUBLAS_STATUS_SUCCESS ? 0.0f : -2.0f;
    return time_it(f, s);
  }
};

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

/// A CUTLASS kernel under test: its best raster order and swizzle from a screening pass, then
/// timed in the interleaved rounds.
template <class G>
struct Candidate {
  Runner<G> r;
  bool ok = false;
  Raster raster = Raster::AlongN;
  int swizzle = 1;
  float screen(typename G::Gemm::Arguments const& args, void* ws, size_t wsb, cudaStream_t s) {
    float best = 1e30f;
    for (Raster ra : {Raster::AlongM, Raster::AlongN})
      for (int sw : {1, 2, 8}) {
        Runner<G> t;
        if (!t.init(args, ra, sw, ws, wsb, s)) continue;
        const float ms = time_it([&] { t.run(s); }, s, 5);
        if (ms < best) best = ms, raster = ra, swizzle = sw;
      }
    ok = best < 1e30f && r.init(args, raster, swizzle, ws, wsb, s);
    return best;
  }
  float time(cudaStream_t s) { return ok ? time_it([&] { r.run(s); }, s) : -1.0f; }
  const char* config() const {
    static char buf[8][32];
    static int i = 0;
    i = (i + 1) % 8;
    snprintf(buf[i], 32, "%s/%d", raster == Raster::AlongM ? "M" : "N", swizzle);
    return buf[i];
  }
};

int main(int argc, char** argv) {
  struct Case {
    int M, K, N;  // rows (tokens), hidden, vocabulary
  };
  std::vector<Case> cases = {{4096, 4096, 128256}, {8192, 4096, 128256}, {8192, 4096, 151936},
                             {4096, 2304, 256000}, {1000, 512, 5002}};
  // `grpo`: GRPO's head (8192 x 896 x 151936; issue 44), after a small shape that warms the chip
  // up. At K = 896 a tile's main loop is 14 k-blocks, so whether the epilogue still hides under
  // the other warpgroup's main loop is the question: "statistics, no E stored" is what a forward
  // with the statistics in the product's epilogue would cost, "full" what a backward product
  // forming dlogits in its epilogue would (one exponential and one bf16 store an element).
  if (argc > 1) {
    if (std::string(argv[1]) != "grpo") {
      printf("usage: scaled_exp [grpo]\n");
      return 2;
    }
    cases = {{1000, 512, 5002}, {8192, 896, 151936}};
  }
  // TMA addresses rows whose pitch is a multiple of 16 bytes: A's and W's (K bf16 values) and the
  // plain kernels' logits (N); other shapes are skipped.
  auto tma_rows_ok = [](Case c) { return (int64_t(c.K) * 2) % 16 == 0 && (int64_t(c.N) * 2) % 16 == 0; };
  size_t max_mn = 0, max_nk = 0, max_mk = 0, max_m = 0, max_mt = 0;
  for (auto c : cases) {
    if (!tma_rows_ok(c)) continue;
    max_mn = std::max(max_mn, size_t(c.M) * c.N);
    max_nk = std::max(max_nk, size_t(c.N) * c.K);
    max_mk = std::max(max_mk, size_t(c.M) * c.K);
    max_m = std::max(max_m, size_t(c.M));
    max_mt = std::max(max_mt, size_t(c.M) * ((c.N + 191) / 192));
  }
  bf16 *A, *W, *D;
  float *Z, *kp, *sp, *up, *lse, *ent, *tl, *worst;
  int* tgt;
  CK(cudaMalloc(&A, max_mk * 2));
  CK(cudaMalloc(&W, max_nk * 2));
  CK(cudaMalloc(&D, max_mn * 2));
  CK(cudaMalloc(&Z, max_mn * 4));
  CK(cudaMalloc(&kp, max_mt * 4));
  CK(cudaMalloc(&sp, max_mt * 4));
  CK(cudaMalloc(&up, max_mt * 4));
  CK(cudaMalloc(&lse, max_m * 4));
  CK(cudaMalloc(&ent, max_m * 4));
  CK(cudaMalloc(&tl, max_m * 4));
  CK(cudaMalloc(&tgt, max_m * 4));
  CK(cudaMalloc(&worst, 16));
  const size_t wsb = size_t(64) << 20;
  char* ws;
  CK(cudaMalloc(&ws, 9 * wsb));
  float* shiftbuf;
  CK(cudaMalloc(&shiftbuf, max_m * 4));
  constexpr int kSample = 16;
  int* sample_rows;
  double* z64;
  size_t max_n = 0;
  for (auto c : cases)
    if (tma_rows_ok(c)) max_n = std::max(max_n, size_t(c.N));
  PartialsCheck pc;
  pc.alloc(max_mt);
  CK(cudaMalloc(&sample_rows, kSample * 4));
  CK(cudaMalloc(&z64, kSample * max_n * 8));
  fill_random<<<1024, 256>>>(A, max_mk, 1.7f, 1);
  fill_random<<<1024, 256>>>(W, max_nk, 0.04f, 2);
  cudaStream_t s;
  cudaStreamCreate(&s);
  Lt lt;
  std::printf("| M x K x N | full: E rel err, lse, entropy, target abs err | staged: the same | staged, row offset given: the same | cuBLASLt ms | CUTLASS coop 256x192 plain | ping-pong 128x192 plain (TMA epilogue) | ping-pong, hand epilogue: plain stores | exp, statistics, no E store | full | full, E staged | staged, row offset given | merge + target dot | best full / cuBLASLt | best full / ping-pong plain | row offset given / cuBLASLt |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (auto c : cases) {
    if (!tma_rows_ok(c)) {
      std::printf("| %d x %d x %d | skipped: rows of %d bytes are not 16-byte aligned for TMA |\n", c.M, c.K, c.N,
                  (int64_t(c.N) * 2) % 16 != 0 ? c.N * 2 : c.K * 2);
      std::fflush(stdout);
      continue;
    }
    const int tiles = (c.N + 191) / 192;
    fill_targets<<<(c.M + 255) / 256, 256, 0, s>>>(tgt, c.M, c.N, 7);
    ScaledExpOut out{reinterpret_cast<__nv_bfloat16*>(D), c.N, kp, sp, up, tiles, tgt, tl};
    Candidate<ExpKernel<Mode::Full>> full;
    Candidate<ExpKernel<Mode::Staged>> staged;
    Candidate<ExpKernel<Mode::StagedShift>> shifted;
    Candidate<ExpKernel<Mode::StagedTma>> tma;
    Candidate<ExpKernel<Mode::NoStore>> nostore;
    Candidate<ExpKernel<Mode::Plain>> hand;
    Candidate<PlainPingPong> pp;
    Candidate<PlainCoop> co;
    full.screen(exp_args<ExpKernel<Mode::Full>>(c.M, c.N, c.K, A, W, out), ws, wsb, s);
    staged.screen(exp_args<ExpKernel<Mode::Staged>>(c.M, c.N, c.K, A, W, out), ws + 5 * wsb, wsb, s);
    ScaledExpOut out_tma = out;
    if (tma_map_e(out_tma, c.M, c.N)) {
      tma.screen(exp_args<ExpKernel<Mode::StagedTma>>(c.M, c.N, c.K, A, W, out_tma), ws + 8 * wsb, wsb, s);
    }
    // The per-row offset the shifted variant is given: here the row's exact max (from the float32
    // reference product) plus 4, standing for an estimate made before the product.
    lt.run(c.M, c.N, c.K, A, W, Z, CUDA_R_32F, ws + 6 * wsb, wsb, s, false);
    row_shift<<<c.M, 256, 0, s>>>(Z, c.N, 4.0f, shiftbuf);
    ScaledExpOut out_shift = out;
    out_shift.shift = shiftbuf;
    shifted.screen(exp_args<ExpKernel<Mode::StagedShift>>(c.M, c.N, c.K, A, W, out_shift), ws + 7 * wsb, wsb, s);
    nostore.screen(exp_args<ExpKernel<Mode::NoStore>>(c.M, c.N, c.K, A, W, out), ws + wsb, wsb, s);
    hand.screen(exp_args<ExpKernel<Mode::Plain>>(c.M, c.N, c.K, A, W, out), ws + 2 * wsb, wsb, s);
    pp.screen(plain_args<PlainPingPong>(c.M, c.N, c.K, A, W, D), ws + 3 * wsb, wsb, s);
    co.screen(plain_args<PlainCoop>(c.M, c.N, c.K, A, W, D), ws + 4 * wsb, wsb, s);
    auto merge = [&] {
      merge_rows<<<(c.M + 7) / 8, 256, 0, s>>>(kp, sp, up, tiles, c.M, lse, ent);
      target_dot<<<(c.M + 7) / 8, 256, 0, s>>>(A, W, tgt, c.M, c.K, tl);
    };
    // Each full kernel's E and statistics against float64 (worst E relative error, lse, entropy
    // and target-logit absolute errors); -1: it did not run.
    const float lt_ref = lt.run(c.M, c.N, c.K, A, W, Z, CUDA_R_32F, ws + 6 * wsb, wsb, s, false);
    // The partials check's reference per (row, tile), from Z; its lines are printed after the
    // shape's others.
    pc.reference(Z, c.M, c.N, tiles, s);
    char shape[64];
    snprintf(shape, sizeof shape, "%d x %d x %d", c.M, c.K, c.N);
    std::string pout;
    app(pout, "partials: %s: %d N-tiles of %d (the last %d columns), %d M-tiles of 128 rows; the cuBLASLt float32 "
        "reference product: %s\n",
        shape, tiles, kTileN, c.N - (tiles - 1) * kTileN, (c.M + 127) / 128,
        lt_ref == 0.0f ? "ran" : lt_ref == -1.0f ? "no algorithm found (Z is stale)" : "failed (Z is stale)");
    auto diag = [&](auto& cand, const char* name, const float* kexp_row, const __nv_bfloat16* E) {
      if (!cand.ok) {
        app(pout, "partials: %s %s: did not run\n", shape, name);
        return;
      }
      pc.variant(pout, shape, name, cand.config(), [&] { cand.r.run(s); }, Z, c.M, c.N, tiles, kp, sp, up, kexp_row, E,
                 s);
    };
    auto check = [&](auto& cand, float* werr) {
      for (int i = 0; i < 4; ++i) werr[i] = -1;
      if (!cand.ok) return;
      CK(cudaMemsetAsync(D, 0, size_t(c.M) * c.N * 2, s));
      cand.r.run(s);
      merge();
      CK(cudaMemsetAsync(worst, 0, 16, s));
      check_rows<<<c.M, 256, 0, s>>>(Z, c.N, reinterpret_cast<__nv_bfloat16*>(D), kp, tiles, 192, lse, ent, tgt, tl, worst);
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      CK(cudaMemcpy(werr, worst, 16, cudaMemcpyDeviceToHost));
    };
    float werr[4], werr_st[4];
    check(full, werr);
    // The full kernel's lse and entropy (still in lse / ent) and the cuBLASLt float32 reference's
    // lse, at kSample rows spread over the shape, against float64 dot products of the operands.
    float w64[3] = {-1, -1, -1};
    if (full.ok) {
      std::vector<int> pick(kSample);
      for (int q = 0; q < kSample; ++q) pick[q] = int((int64_t(q) * (c.M - 1)) / (kSample - 1));
      CK(cudaMemcpy(sample_rows, pick.data(), kSample * 4, cudaMemcpyHostToDevice));
      z_f64<<<dim3((c.N + 255) / 256, kSample), 256, 0, s>>>(A, W, sample_rows, c.K, c.N, z64);
      CK(cudaMemsetAsync(worst, 0, 16, s));
      check_f64<<<kSample, 256, 0, s>>>(z64, Z, sample_rows, c.N, lse, ent, worst);
      CK(cudaStreamSynchronize(s));
      CK(cudaGetLastError());
      CK(cudaMemcpy(w64, worst, 12, cudaMemcpyDeviceToHost));
      pc.reference_f64(pout, z64, sample_rows, kSample, c.N, tiles, s);
    } else {
      app(pout, "partials:   the reference per (row, tile) not checked against float64 dot products (full did not run)\n");
    }
    // Each variant's partials as its check above left them (full's: still in kp / sp / up), then a
    // second run; no E store: one run made here, then the second.
    diag(full, "full", nullptr, reinterpret_cast<const __nv_bfloat16*>(D));
    check(staged, werr_st);
    diag(staged, "staged", nullptr, reinterpret_cast<const __nv_bfloat16*>(D));
    float werr_sh[4];
    check(shifted, werr_sh);
    diag(shifted, "staged, row offset given", shiftbuf, reinterpret_cast<const __nv_bfloat16*>(D));
    float werr_tma[4];
    check(tma, werr_tma);
    diag(tma, "staged, TMA store", nullptr, reinterpret_cast<const __nv_bfloat16*>(D));
    if (nostore.ok) nostore.r.run(s);
    diag(nostore, "no E store", nullptr, nullptr);
    std::vector<float> t_lt, t_co, t_pp, t_hand, t_ns, t_full, t_st, t_sh, t_mg, t_tma;
    for (int round = 0; round < 3; ++round) {
      t_lt.push_back(lt.run(c.M, c.N, c.K, A, W, D, CUDA_R_16BF, ws + 6 * wsb, wsb, s, true));
      t_co.push_back(co.time(s));
      t_pp.push_back(pp.time(s));
      t_hand.push_back(hand.time(s));
      t_ns.push_back(nostore.time(s));
      t_full.push_back(full.time(s));
      t_st.push_back(staged.time(s));
      t_sh.push_back(shifted.time(s));
      t_tma.push_back(tma.time(s));
      t_mg.push_back(time_it(merge, s));
    }
    CK(cudaStreamSynchronize(s));
    CK(cudaGetLastError());
    const float a = median(t_lt), f = median(t_full), st = median(t_st), sh = median(t_sh), p = median(t_pp);
    std::printf("| %d x %d x %d | %.2e, %.2e, %.2e, %.2e | %.2e, %.2e, %.2e, %.2e | %.2e, %.2e, %.2e, %.2e | %.3f | %.3f (%s) | %.3f (%s) | %.3f (%s) | %.3f (%s) | %.3f (%s) | %.3f (%s) | %.3f (%s) | %.3f | %.3f | %.3f | %.3f |\n",
                c.M, c.K, c.N, werr[0], werr[1], werr[2], werr[3], werr_st[0], werr_st[1], werr_st[2], werr_st[3],
                werr_sh[0], werr_sh[1], werr_sh[2], werr_sh[3], a, median(t_co), co.config(), p, pp.config(),
                median(t_hand), hand.config(), median(t_ns), nostore.config(), f, full.config(), st,
                staged.config(), sh, shifted.config(), median(t_mg), std::min(f, st) / a, std::min(f, st) / p,
                sh / a);
    std::printf("|   %d x %d x %d, staged with the TMA store | E rel err, lse, entropy, target abs err: %.2e, %.2e, %.2e, %.2e | %.3f ms (%s) | / staged %.3f | / cuBLASLt %.3f | / ping-pong plain %.3f |\n",
                c.M, c.K, c.N, werr_tma[0], werr_tma[1], werr_tma[2], werr_tma[3], median(t_tma), tma.config(),
                median(t_tma) / st, median(t_tma) / a, median(t_tma) / p);
    std::printf("|   %d x %d x %d, %d rows against float64 dot products | full: lse %.2e, entropy %.2e | cuBLASLt float32 reference: lse %.2e |\n",
                c.M, c.K, c.N, kSample, w64[0], w64[2], w64[1]);
    std::fputs(pout.c_str(), stdout);
    std::fflush(stdout);
  }
  return 0;
}
