// Experiment: grad_weight = (E * F * r)^T hidden with the scale inside our own register-sourced
// WGMMA main loop, so the prescale pass over (tokens x V) and its bf16 buffer disappear. E (T x V,
// bf16, vocabulary-contiguous, values in (0, 1]) is what the logits product's scaled-exp epilogue
// stores; F holds one power of two per (token, 192-wide vocabulary tile), F[t + T * (v / 192)];
// r is the per-token float32 factor (docs/architecture.md, "The third linear design"). The
// product: M = V (vocabulary), N = H, K = T (tokens); A = E^T (V x T) is MN-major (the vocabulary
// index, M, is contiguous), B = hidden (T x H, row-major) is MN-major too. The scale of A's
// element (m = v, k = t) is s(t, v / 192) = F[t, v / 192] r[t]: it runs along A's K index and is
// not a power of two, so the scaled element is rounded: A' = bf16(float(E) * s), s = float(F) * r
// in float32, exactly as the references' prescale pass computes it (both round float(E) * s,
// a float32 product, to bf16 with round-to-nearest-even). D (V x H, float32, row-major) = A' hidden
// is written once; the library would accumulate D over token chunks in float32 (beta 1 or a
// reduce-add store, which also reads D: twice this probe's epilogue traffic).
//
// The kernel (ours: our own __global__ and main loop, CuTe building blocks only):
// - Persistent, warp-specialized, sm_90a: grid = min(#SMs, #tiles), 384 threads, CTA tile
//   128 x 256 x 64 (M x N x K), as dev/scaled_gemm/rs_loop.cu. Warpgroup 0 is the producer
//   (setmaxnreg 40): one thread issues, per k-block (64 tokens), the TMA loads of the E tile (64
//   tokens x 128 vocabulary, i.e. A's 128 (M) x 64 (K) MN-major tile, 128B swizzle), the hidden
//   tile (64 x 256, MN-major, 128B swizzle) and the two 256-byte scale slices (below) into a ring
//   of 4 stages (4 x 48.5 KB). Warpgroups 1 and 2 consume (setmaxnreg 232), cooperative: 64 rows
//   of the tile each (a 64 x 256 float32 accumulator: 128 registers a thread).
// - Tile M = 128, not 192: a 192-row tile is three 64-row wgmma slices, which two consumer
//   warpgroups cannot share evenly (and three consumers of 64 x 256 would get at most 152
//   registers a thread, 65536 / 512 plus what the producer gives back, for a 128-register
//   accumulator). With 128-row tiles each consumer warpgroup's 64-row
//   slice starts at a multiple of 64, and 64 divides 192, so every slice lies inside one
//   192-wide vocabulary block: a warpgroup needs one scale per token per k-block, the same for
//   both of a thread's rows (the tile as a whole may straddle two blocks: then its two
//   warpgroups read different blocks' scales).
// - Scales: S[b * T + t] = float(F[b * T + t]) * r[t] (float32, (V / 192) x T, block-major like F;
//   the library's merge, which has F and r, would write S in F's place: a T x V / 192 pass). The
//   producer stages, per stage, the two slices S[b_w * T + 64 kb .. + 64] (b_w: the block of
//   consumer warpgroup w's rows) with cp.async.bulk on the stage's full barrier. Reading them
//   from global memory in the consumers would need 16 floats a thread per k-block held a k-block
//   ahead (16 more registers next to 128 + 2 x 16), and one k-block of wgmma (~1000 cycles) is
//   no more than an L2 round trip under load; staged, they arrive with the tile up to 4 stages
//   ahead and cost 8 conflict-free ld.shared.v2 (4 distinct addresses a warp) a thread per
//   k-block.
// - Tile order n-fastest (t -> n = t % (H/256), m = t / (H/256)): the ~132 CTAs in flight cover
//   ~8 m tiles x all 16 n tiles, so E (T x V: 0.5-2.1 GB) is read from DRAM once, its slabs
//   shared through L2; hidden (16-64 MB, the L2 is 50 MB) is read by every wave of tiles, from
//   DRAM at worst once a wave (~0.6 TB/s at 8192 tokens). m-fastest would read E 16 times.
// - Per k-block a consumer thread ldmatrix.trans-es its A fragment (64 rows x 64 k of its
//   warpgroup: 16 x 32-bit registers) from the swizzled MN-major stage (SM75_U16x8_LDSM_T, laid
//   out by make_tiled_copy_A over the register-sourced tiled MMA and written through retile_D of
//   the MMA's fragment; the register-sourced wgmma's A fragment has the K-major fragment layout
//   whatever the smem layout, and ldmatrix.trans is what delivers it from M-contiguous rows).
//   Each 32-bit register holds two adjacent k (two tokens, two different scales) of one row:
//   register j holds row r0 (j even) or r1 (j odd) and k = c0 + 16 (j / 4) + 8 ((j / 2) & 1) and
//   that k + 1, c0 the thread's first k (even). Per register: both halves to float32 (a shift, an
//   and), times their token's scale, cvt.rn.bf16x2.f32 (round-to-nearest-even, as the
//   references' cvt.rn.bf16.f32). check_layouts re-checks every one of these facts on the host,
//   for every consumer thread, before any launch: the copy delivers each register where the MMA
//   expects it (by CuTe's account and again from the PTX ISA's definitions of ldmatrix.x4.trans
//   and of wgmma's A fragment), reads each tile element once, in 16-byte contiguous runs of the
//   swizzled stage, whose layout is the one the TMA writes.
//   Then 4 wgmma m64n256k16 (A from registers, B from smem descriptors) as one commit group.
// - Two A register buffers: the ldmatrix + scale of k-block i + 1 runs while the wgmma group of
//   k-block i is in flight. Invariant: at most one group is pending when a buffer is written;
//   warpgroup_wait<1> right after committing group i retires group i - 1, which is the last
//   reader of the buffer about to be refilled and of stage i - 1's hidden tile, so that is where
//   stage i - 1 is released (every consumer thread arrives on its empty barrier: count 256). The
//   E tile and the scales are read synchronously (ldmatrix, ld.shared) before then. Stage and
//   phase come from one k-block counter that runs on across tiles, identical in producer and
//   consumers (stage = c % 4, full-barrier parity = (c / 4) & 1, the producer waits on the empty
//   barrier with the opposite parity).
// - Epilogue: wgmma wait 0, release the last stage, 8-byte stores (st.global.v2.f32) of the
//   accumulator straight to D (no smem). A tile's main loop is only T / 64 = 32-128 k-blocks,
//   so the 128 KB a tile stores (2.1 GB of D in all) is not negligible next to it; the stores
//   are fire-and-forget and should drain under the next tile's main loop, whose stages the
//   producer streams meanwhile (the risk to watch at 2048 tokens).
// - A runtime flag (scale_on = 0) forces every scale to 1, the negative control of the check.
// - Cluster variant (rs_weight_kernel<2>, run with the argument `cluster`): thread-block clusters
//   of two CTAs along M (V), as dev/scaled_gemm/rs_loop.cu's: a cluster walks cluster tiles (two
//   adjacent vocabulary tiles of one H tile, n-fastest; CTA rank r takes the r-th), so both CTAs
//   need the same hidden tile every k-block and each loads half of it (CuTe cuts each 64-wide H
//   box along the tokens) with SM90_TMA_LOAD_MULTICAST into both CTAs' stage; E and the scales
//   stay per CTA. Each CTA's full barrier still expects the whole stage. A producer may refill a
//   stage only when both CTAs' consumers released it: each consumer warp, after its wgmma wait,
//   arrives (one lane) on the empty barrier of every CTA of the cluster (count 2 x 8 warps). The
//   CTAs sync as a cluster after the barriers' init and before exit (a peer's last remote
//   arrives land in this CTA's shared memory). V % 256.
// - pow2 variant (rs_weight_kernel<1, true>, run with the argument `pow2`): the factor r moves to
//   the hidden rows (B = bf16(r hidden), a pass over T x H), so the kernel's scale is F alone, a
//   power of two: each A register is multiplied by its bf16x2 pair (F of token k, of token k + 1)
//   with one mul.rn.bf16x2, exact, where the float form unpacks, multiplies twice and rounds.
//   Checked against cuBLASLt on (E F, r hidden), the same way; its columns follow the table's.
//   With `pow2` the cluster form of it (rs_weight_kernel<2, true>) is checked and timed too, and
//   its sliced form (rs_weight_kernel<1, true, true>): per k16 slice j of a k-block, the slice's
//   wgmma is issued as its own commit group and then slice j of the next k-block is loaded
//   (ldmatrix.trans) and scaled into the other buffer, so that no wgmma waits on a whole
//   k-block's 16 registers (ncu had the pow2 loop stalled on its loads' short scoreboard, the
//   tensor pipe a fifth idle). Invariant: after committing slice j of k-block kb, waiting until
//   at most 4 groups are pending retires slice j of k-block kb - 1, the last reader of the
//   buffer slice about to be refilled; at j = 3 all of kb - 1, so its stage is released there.
//   check_layouts also checks that copy slice j fills exactly the registers MMA slice j reads.
// - Staged form (ss_weight_kernel, run with the argument `staged`; float and pow2 scales): the
//   product is shared-memory sourced on both sides (SS wgmma, as CUTLASS's plain kernel), and
//   warps 1-3 of the producer warpgroup rewrite each landed E stage in place, A' = bf16(float(E)
//   S) (float: the prescale pass's own rounding, so it matches cuBLASLt on A' up to summation
//   order) or E F (pow2, exact), then fence the generic-proxy writes for the async proxy and
//   arrive on the stage's `scaled` barrier, which the consumers wait on instead of the full one.
//   No wgmma waits on a register operand; the cost is a 16 KB read and write of shared memory a
//   k-block by 96 threads, off the consumers' issue path. check_stage_rows re-derives on the host
//   that each 128-byte row of a stage is one token of one 64-row half (the swizzle permutes the
//   16-byte chunks within a row), so a chunk's scale follows from its offset. Exact, and slower
//   than the register-sourced loop at every shape (docs/performance.md: the in-place rewrite adds
//   a third to the shared-memory traffic a k-block already needs).
// The host refuses (before any launch, so the kernel never waits on a load that was not issued)
// V % 128, H % 256, T % 64 and misaligned pointers.
//
// Checked first: ours against cuBLASLt's A'^T hidden on the prescaled A' (max |diff| / max |ref|;
// the same bf16 products, float32 sums in another order), 16 sampled outputs against float64 dot
// products of A' and hidden, and the control (scales forced to 1: must be far off). Timed:
// interleaved rounds (5 x 10 reps, medians of medians, CUDA events, 2 warm-ups) of the prescale
// pass (E, F, r -> A': what the fused loop removes), cuBLASLt on A', CUTLASS's plain SS
// cooperative 128 x 256 kernel on A' (A MN-major; the same-tile reference), and ours.
//
// Compiles to 168 registers at launch, no spills (the cluster and pow2 variants too); the layout check passes.
// Build (the include dir is the one CMake unpacks from the pinned CUTLASS wheel,
// e.g. build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include; add -Xptxas -v for the
// register and spill counts; no -lcuda: CUTLASS reaches cuTensorMapEncodeTiled through
// cudaGetDriverEntryPoint):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -I<cutlass include dir> \
//     dev/scaled_gemm/rs_weight.cu -o build-probe/rs_weight -lcublasLt
// Run: build-probe/rs_weight [cluster|profile|pow2|staged]; the layout and multicast checks first (without a
// GPU it stops there), then a table row a shape (with `cluster`, the cluster variant's columns
// too). A checked run that does not finish within 20 s is named and ends the process. `profile`
// runs every variant's checked runs (base, cluster, pow2 and its cluster and sliced forms, both staged forms) at 4096 tokens and times
// nothing: the run to put under ncu (dev/scaled_gemm/ncu_summary.py).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"

using namespace cute;
using bf16 = cutlass::bfloat16_t;
using RM = cutlass::layout::RowMajor;
using CM = cutlass::layout::ColumnMajor;
namespace cg = cutlass::gemm;

#define CK(x)                                                 \
  do {                                                        \
    cudaError_t e_ = (x);                                     \
    if (e_ != cudaSuccess) {                                  \
      printf("%s: %s\n", #x, cudaGetErrorString(e_));         \
      exit(1);                                                \
    }                                                         \
  } while (0)

constexpr int kGroup = 192;  // the logits product's vocabulary tile

// ------------------------------------------------------------------------------------------------
// rs_weight: the kernel
// ------------------------------------------------------------------------------------------------
namespace rw {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kSlice = 64;  // rows of one consumer warpgroup (one wgmma M)
static_assert(kGroup % kSlice == 0 && kBM == 2 * kSlice,
              "each consumer warpgroup's 64-row slice must lie inside one 192-wide block");
constexpr int kThreads = 384;  // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;

// MN-major atoms are 64 (MN) x 8 (K): fill K first, so a stage is boxes of 64 MN x 64 K
using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16>{},
                                           make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{}), Step<_2, _1, _3>{}));
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16>{},
                                           make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{}), Step<_2, _1, _3>{}));
// The register-sourced wgmma's A is K-major by definition (its register fragment layout); the
// smem A is MN-major and ldmatrix.trans bridges the two.
using MmaAtom = SM90_64x256x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>;
static_assert(is_same_v<MmaAtom, decltype(GMMA::rs_op_selector<bf16, bf16, float, Shape<_128, _256, _64>,
                                                                GMMA::Major::K, GMMA::Major::MN>())>);
// 2 warpgroups along M: each owns 64 rows of the 128 x 256 tile
using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_2, _1, _1>>{}));
using S2RCopyAtomA = Copy_Atom<SM75_U16x8_LDSM_T, bf16>;

constexpr int kBytesA = cosize_v<SmemLayoutA> * 2, kBytesB = cosize_v<SmemLayoutB> * 2;
constexpr int kBytesS = kStages * 2 * kBK * 4;  // per stage: one 64-token scale slice a warpgroup
constexpr uint32_t kTxBytes = (kBM * kBK + kBN * kBK) * 2 + 2 * kBK * 4;  // one stage's bytes
static_assert(kBytesA == kStages * kBM * kBK * 2 && kBytesB == kStages * kBN * kBK * 2);
constexpr int kSmemBytes = kBytesA + kBytesB + kBytesS + 1024;  // + room to align the base to 1 KB
static_assert(kSmemBytes <= 227 * 1024);

/// A = E^T: (M = V, K = T), M contiguous.
inline auto make_tma_a(const bf16* e, int M, int K) {
  auto g = make_tensor(make_gmem_ptr(e), make_layout(make_shape(M, K), make_stride(Int<1>{}, int64_t(M))));
  return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutA{}(_, _, Int<0>{}));
}
/// B = hidden: (N = H, K = T), N contiguous.
inline auto make_tma_b(const bf16* h, int N, int K) {
  auto g = make_tensor(make_gmem_ptr(h), make_layout(make_shape(N, K), make_stride(Int<1>{}, int64_t(N))));
  return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutB{}(_, _, Int<0>{}));
}
/// The cluster variant's hidden: each of the kClusterM CTAs of a cluster (same H tile, adjacent
/// vocabulary tiles) loads 1 / kClusterM of the stage's hidden tile and multicasts it to all.
constexpr int kClusterM = 2;
inline auto make_tma_b_mc(const bf16* h, int N, int K) {
  auto g = make_tensor(make_gmem_ptr(h), make_layout(make_shape(N, K), make_stride(Int<1>{}, int64_t(N))));
  return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, g, SmemLayoutB{}(_, _, Int<0>{}), Int<kClusterM>{});
}
using TmaA = decltype(make_tma_a(nullptr, 0, 0));
using TmaB = decltype(make_tma_b(nullptr, 0, 0));
using TmaBMc = decltype(make_tma_b_mc(nullptr, 0, 0));

struct Params {
  TmaA tma_a;
  TmaB tma_b;
  TmaBMc tma_b_mc;  // read only by the cluster kernel
  const float* s;  // S[b * K + t] = F[t, b] r[t]
  float* d;
  int M, N, K;   // V, H, T
  int scale_on;  // 0: every scale is 1 (the negative control)
};

/// Two bf16 (low half: k, high half: k + 1) times their own float32 scales, rounded to bf16 once
/// each from the float32 product (cvt.rn.bf16x2 puts its first source in the high half).
__device__ __forceinline__ uint32_t scale_pair(uint32_t u, float s_lo, float s_hi) {
  const float lo = __uint_as_float(u << 16) * s_lo;
  const float hi = __uint_as_float(u & 0xffff0000u) * s_hi;
  uint32_t d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

/// Two bf16 times two powers of two (a bf16x2 pair): exact while the products stay normal.
__device__ __forceinline__ uint32_t mul_bf16x2(uint32_t a, uint32_t s) {
  uint32_t d;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(s));
  return d;
}

/// One 8-byte store of two adjacent floats (a plain float2 store came out as two 4-byte ones).
__device__ __forceinline__ void st_f32x2(float* ptr, float a, float b) {
  asm volatile("st.global.v2.f32 [%0], {%1, %2};" ::"l"(ptr), "f"(a), "f"(b));
}

/// Registers -> D (row-major, leading dimension ld): an 8-byte store a pair of adjacent columns
/// of one row (host-checked for every consumer thread).
template <class Acc, class Coords>
__device__ __forceinline__ void store_tile(const Acc& accum, const Coords& tCcC, float* dt, int ld) {
  CUTE_UNROLL
  for (int i = 0; i < size(accum); i += 2) {
    const auto rc = tCcC(i);
    st_f32x2(dt + size_t(get<0>(rc)) * ld + get<1>(rc), accum(i), accum(i + 1));
  }
}

/// The A fragment of one k-block (the same expression in the kernel and in check_layouts).
template <class ThrMma, class SA>
CUTE_HOST_DEVICE auto make_frag_a(ThrMma const& thr_mma, SA const& sA) {
  return thr_mma.partition_fragment_A(sA(_, _, 0));
}

template <int kCluster = 1, bool kPow2 = false, bool kSliced = false>
__global__ void __launch_bounds__(kThreads, 1) rs_weight_kernel(const __grid_constant__ Params p) {
  static_assert(kCluster == 1 || kCluster == kClusterM, "no cluster, or kClusterM CTAs along M");
  using Full = cutlass::arch::ClusterTransactionBarrier;
  using Empty = cutlass::arch::ClusterBarrier;
  __shared__ uint64_t full_bar[kStages], empty_bar[kStages];
  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (cast_smem_ptr_to_uint(smem_raw) & 1023)) & 1023);  // 128B swizzle: 1 KB aligned
  bf16* smem_a = reinterpret_cast<bf16*>(smem);
  bf16* smem_b = reinterpret_cast<bf16*>(smem + kBytesA);
  float* smem_s = reinterpret_cast<float*>(smem + kBytesA + kBytesB);  // [stage][warpgroup][64 tokens]

  const int m_tiles = p.M / kBM, n_tiles = p.N / kBN, k_blocks = p.K / kBK;
  // A cluster walks cluster tiles: kCluster adjacent vocabulary tiles (CTA rank r takes the r-th)
  // of one H tile, so the cluster's CTAs share every hidden stage. Without a cluster a cluster
  // tile is a tile.
  const int rank = kCluster == 1 ? 0 : int(cute::block_rank_in_cluster());
  const int first_tile = blockIdx.x / kCluster, tile_step = gridDim.x / kCluster;
  const int c_tiles = (m_tiles / kCluster) * n_tiles;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Full::init(&full_bar[s], 1);  // the producer's arrive_and_expect_tx
      // Empty: without a cluster every consumer thread arrives after its wgmma wait; with one, a
      // lane of every consumer warp of every CTA of the cluster (each producer writes its hidden
      // slice into all of them, so it waits until all of them released the stage)
      Empty::init(&empty_bar[s], kCluster == 1 ? kConsumerThreads : kCluster * kConsumerThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (kCluster == 1) {
    __syncthreads();  // the last CTA-wide sync: producer warps may leave early below
  } else {
    cute::cluster_sync();  // every CTA's barriers are initialized before any multicast or remote arrive
  }

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    // ---------------------------------------------------------------- producer
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (threadIdx.x == 0) {
      prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      if constexpr (kCluster == 1) {
        prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
      } else {
        prefetch_tma_descriptor(p.tma_b_mc.get_tma_descriptor());
      }
      Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.M, p.K));  // (M, K) coordinates
      Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.N, p.K));  // (N, K)
      Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});  // (BM, BK, stage)
      Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});  // (BN, BK, stage)
      auto cta_a = p.tma_a.get_slice(0);
      // with a cluster: this CTA's slice of hidden, multicast to every CTA of the cluster
      auto cta_b = [&] {
        if constexpr (kCluster == 1) return p.tma_b.get_slice(0);
        else return p.tma_b_mc.get_slice(rank);
      }();
      Tensor tAsA = cta_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, stage)
      Tensor tBsB = cta_b.partition_D(sB);
      uint32_t c = 0;  // k-blocks issued by this CTA, across tiles
      for (int t = first_tile; t < c_tiles; t += tile_step) {
        const int nt = t % n_tiles, mt = (t / n_tiles) * kCluster + rank;
        Tensor tAgA = cta_a.partition_S(local_tile(mA, Shape<Int<kBM>, Int<kBK>>{}, make_coord(mt, _)));  // (TMA,TMA_M,TMA_K,k)
        Tensor tBgB = cta_b.partition_S(local_tile(mB, Shape<Int<kBN>, Int<kBK>>{}, make_coord(nt, _)));
        // the scale rows of the two warpgroups' 192-blocks
        const float* s0 = p.s + size_t((mt * kBM) / kGroup) * p.K;
        const float* s1 = p.s + size_t((mt * kBM + kSlice) / kGroup) * p.K;
#pragma unroll 1
        for (int kb = 0; kb < k_blocks; ++kb, ++c) {
          const int s = c % kStages;
          Empty::wait(&empty_bar[s], ((c / kStages) & 1) ^ 1);  // a fresh barrier passes parity 1
          // the whole stage lands here: this CTA's E tile and scales, every CTA's hidden slice
          Full::arrive_and_expect_tx(&full_bar[s], kTxBytes);
          copy(p.tma_a.with(full_bar[s]), tAgA(_, _, _, kb), tAsA(_, _, _, s));
          if constexpr (kCluster == 1) {
            copy(p.tma_b.with(full_bar[s]), tBgB(_, _, _, kb), tBsB(_, _, _, s));
          } else {
            constexpr uint16_t kAllCtas = (1u << kCluster) - 1;
            copy(p.tma_b_mc.with(full_bar[s], kAllCtas), tBgB(_, _, _, kb), tBsB(_, _, _, s));
          }
          float* ds = smem_s + s * 2 * kBK;
          SM90_BULK_COPY_G2S::copy(s0 + kb * kBK, &full_bar[s], ds, kBK * 4);
          SM90_BULK_COPY_G2S::copy(s1 + kb * kBK, &full_bar[s], ds + kBK, kBK * 4);
        }
      }
    }
    if constexpr (kCluster == 1) {
      return;  // every load issued is consumed: the consumers keep the CTA (and its smem) alive
    } else {
      // the CTA stays until the cluster's last remote arrive on its barriers
      __syncwarp();
      cute::cluster_sync();
      return;
    }
  }

  // ------------------------------------------------------------------ consumers
  cutlass::arch::warpgroup_reg_alloc<232>();
  const int ct = threadIdx.x - 128;  // 0..255: thread in the tiled MMA (warpgroup ct / 128 -> rows 64 (ct / 128) + ...)
  const int cw = ct / 128;           // consumer warpgroup: its 64-row slice, its scale slice

  TiledMma mma;
  auto thr_mma = mma.get_slice(ct);
  Tensor sA = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem_a), SmemLayoutA{}));
  Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});  // position-dependent: the descriptors
  Tensor tCsB = thr_mma.partition_B(sB);                          // (MMA, MMA_N = 1, MMA_K = 4, stage)
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);                    // smem descriptors
  Tensor tCrA0 = make_frag_a(thr_mma, sA);                        // (MMA = 8, MMA_M = 1, MMA_K = 4) bf16
  Tensor tCrA1 = make_frag_a(thr_mma, sA);
  Tensor accum = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});  // (MMA = 128, 1, 1) float
  static_assert(size(decltype(tCrA0){}) == 32 && size(decltype(accum){}) == 128);
  static_assert(size<2>(decltype(tCrA0){}) == kBK / 16);

  auto s2r = make_tiled_copy_A(S2RCopyAtomA{}, mma);
  auto thr_s2r = s2r.get_thread_slice(ct);
  Tensor tXsA = thr_s2r.partition_S(sA);   // (CPY, CPY_M, CPY_K, stage)
  Tensor tXrA0 = thr_s2r.retile_D(tCrA0);  // the same registers as tCrA0, in the copy's shape
  Tensor tXrA1 = thr_s2r.retile_D(tCrA1);
  CUTE_STATIC_ASSERT_V(size<1>(tXsA) == size<1>(tXrA0));
  CUTE_STATIC_ASSERT_V(size<2>(tXsA) == size<2>(tXrA0));
  CUTE_STATIC_ASSERT_V(size<2>(tCrA0) == size<2>(tCsB));

  // The thread's first k (host-checked: register j holds k = c0 + 16 (j / 4) + 8 ((j / 2) & 1)
  // and k + 1, c0 even).
  Tensor tCcA = thr_mma.partition_A(make_identity_tensor(Shape<Int<kBM>, Int<kBK>>{}));
  const int c0 = get<1>(tCcA(0));
  Tensor tCcC = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));

  // scale the freshly loaded fragment of stage s: 16 registers, 2 tokens each; registers 4 j +
  // 2 h + {0, 1} (rows r0, r1) hold tokens c0 + 16 j + 8 h and + 1
  auto apply_scale_slice = [&](auto& frag, int s, int j) {
    Tensor u = recast<uint32_t>(frag);
    const float* ss = smem_s + (s * 2 + cw) * kBK + c0;
    {
      CUTE_UNROLL
      for (int h = 0; h < 2; ++h) {
        float2 sc = *reinterpret_cast<const float2*>(ss + 16 * j + 8 * h);
        if (!p.scale_on) sc = make_float2(1.0f, 1.0f);
        const int i = 4 * j + 2 * h;
        if constexpr (kPow2) {  // the scales are powers of two: exact in bf16, one multiply a register
          uint32_t s2;
          asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(s2) : "f"(sc.y), "f"(sc.x));
          u(i) = mul_bf16x2(u(i), s2);
          u(i + 1) = mul_bf16x2(u(i + 1), s2);
        } else {
          u(i) = scale_pair(u(i), sc.x, sc.y);
          u(i + 1) = scale_pair(u(i + 1), sc.x, sc.y);
        }
      }
    }
  };
  auto apply_scale = [&](auto& frag, int s) {
    CUTE_UNROLL
    for (int j = 0; j < kBK / 16; ++j) apply_scale_slice(frag, s, j);
  };

  // Releases stage s to the producers that write it: this CTA's, and with a cluster every CTA's
  // (one arrive a warp on each CTA's barrier, after every lane of the warp passed its wgmma wait).
  const int lane = threadIdx.x % 32;
  auto release = [&](int s) {
    if constexpr (kCluster == 1) {
      Empty::arrive(&empty_bar[s]);
    } else {
      __syncwarp();
      if (lane == 0) {
        CUTE_UNROLL
        for (int r = 0; r < kCluster; ++r) Empty::arrive(&empty_bar[s], r, 1);
      }
    }
  };

  uint32_t c = 0;  // k-blocks consumed by this CTA, across tiles (the producer's count)
  for (int t = first_tile; t < c_tiles; t += tile_step) {
    const int nt = t % n_tiles, mt = (t / n_tiles) * kCluster + rank;

    // the fragment of the next k-block: ldmatrix.trans, then scale
    auto prepare = [&](uint32_t cc, auto& frag, auto& frag_view) {
      const int s = cc % kStages;
      Full::wait(&full_bar[s], (cc / kStages) & 1);
      copy(s2r, tXsA(_, _, _, s), frag_view);
      apply_scale(frag, s);
      warpgroup_fence_operand(frag);
    };
    // one k-block: issue its wgmma group, retire the previous one, prepare the next fragment
    auto step = [&](int kb, auto& cur, auto& nxt, auto& nxt_view) {
      const int s = (c + kb) % kStages;
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int k = 0; k < size<2>(cur); ++k) {
        cute::gemm(mma, cur(_, _, k), tCrB(_, _, k, s), accum);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // group kb - 1 done: it read `nxt` and stage (c + kb - 1)'s hidden tile
      warpgroup_fence_operand(accum);
      if (kb > 0) release((c + kb - 1) % kStages);
      if (kb + 1 < k_blocks) prepare(c + kb + 1, nxt, nxt_view);
    };

    // kSliced: one k16 slice of the next k-block loaded and scaled after each slice's wgmma is
    // issued, so the wgmma of a slice waits only on its own four registers, not the k-block's 16
    auto prepare_slice = [&](uint32_t cc, int j, auto& frag, auto& frag_view) {
      const int s = cc % kStages;
      if (j == 0) Full::wait(&full_bar[s], (cc / kStages) & 1);
      copy(s2r, tXsA(_, _, j, s), frag_view(_, _, j));
      apply_scale_slice(frag, s, j);
      warpgroup_fence_operand(frag);
    };
    // one k-block as four commit groups, one a slice. Invariant: after committing slice j of
    // k-block kb at most 4 groups stay pending, which retires slice j of k-block kb - 1, the last
    // reader of `nxt`'s slice j (refilled right after) and, at j = 3, of stage kb - 1's hidden tile
    auto step_sliced = [&](int kb, auto& cur, auto& nxt, auto& nxt_view) {
      const int s = (c + kb) % kStages;
      CUTE_UNROLL
      for (int j = 0; j < size<2>(cur); ++j) {
        warpgroup_fence_operand(accum);
        warpgroup_arrive();
        cute::gemm(mma, cur(_, _, j), tCrB(_, _, j, s), accum);
        mma.accumulate_ = GMMA::ScaleOut::One;
        warpgroup_commit_batch();
        warpgroup_wait<size<2>(decltype(tCrA0){})>();
        warpgroup_fence_operand(accum);
        if (j == size<2>(cur) - 1 && kb > 0) release((c + kb - 1) % kStages);
        if (kb + 1 < k_blocks) prepare_slice(c + kb + 1, j, nxt, nxt_view);
      }
    };

    mma.accumulate_ = GMMA::ScaleOut::Zero;
    if constexpr (kSliced) {
      CUTE_UNROLL
      for (int j = 0; j < size<2>(tCrA0); ++j) prepare_slice(c, j, tCrA0, tXrA0);
#pragma unroll 1
      for (int kb = 0; kb < k_blocks; kb += 2) {
        step_sliced(kb, tCrA0, tCrA1, tXrA1);
        if (kb + 1 < k_blocks) step_sliced(kb + 1, tCrA1, tCrA0, tXrA0);
      }
    } else {
      prepare(c, tCrA0, tXrA0);
#pragma unroll 1
      for (int kb = 0; kb < k_blocks; kb += 2) {
        step(kb, tCrA0, tCrA1, tXrA1);
        if (kb + 1 < k_blocks) step(kb + 1, tCrA1, tCrA0, tXrA0);
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    release((c + k_blocks - 1) % kStages);
    c += k_blocks;

    // epilogue: registers -> D, float2 a pair of adjacent columns (host-checked)
    float* dt = p.d + size_t(mt) * kBM * p.N + size_t(nt) * kBN;
    store_tile(accum, tCcC, dt, p.N);
  }
  // the peers' consumers may still arrive on this CTA's empty barriers: stay until all are done
  if constexpr (kCluster > 1) cute::cluster_sync();
}

// ------------------------------------------------------------------------------------------------
// The staged form: the scale applied to the E stage in shared memory, the product shared-memory
// sourced (SS wgmma, as CUTLASS's plain kernel), so no wgmma waits on a register operand
// ------------------------------------------------------------------------------------------------

// Warps 1-3 of the producer warpgroup (warp 0 issues the loads) rewrite each landed E stage in
// place: A'(m, k) = bf16(float(E) * S) (float form) or E * F (pow2 form, one mul.rn.bf16x2 a
// register, exact). In the MN-major 128B-swizzled stage every 128-byte row is one token k of one
// 64-row half of the tile (row R = k + 64 (m / 64)); the swizzle permutes the 16-byte chunks of
// a row among themselves, so a chunk's token and half follow from its offset alone
// (check_stage_rows re-derives this from the layout on the host) and all 8 of its elements take
// one scale.
constexpr int kTransformThreads = 96;
constexpr int kChunks = kBM * kBK * 2 / 16;  // 16-byte chunks of a stage's E tile
static_assert(kBK == 64 && kBM == 2 * 64, "a 128-byte row is one token of one 64-row half");
using MmaAtomSS = SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>;
using TiledMmaSS = decltype(make_tiled_mma(MmaAtomSS{}, Layout<Shape<_2, _1, _1>>{}));

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

template <bool kPow2>
__device__ __forceinline__ uint4 scale_chunk(uint4 v, float sc) {
  if constexpr (kPow2) {
    uint32_t s2;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(s2) : "f"(sc), "f"(sc));
    return make_uint4(mul_bf16x2(v.x, s2), mul_bf16x2(v.y, s2), mul_bf16x2(v.z, s2), mul_bf16x2(v.w, s2));
  } else {
    return make_uint4(scale_pair(v.x, sc, sc), scale_pair(v.y, sc, sc), scale_pair(v.z, sc, sc),
                      scale_pair(v.w, sc, sc));
  }
}

template <bool kPow2>
__global__ void __launch_bounds__(kThreads, 1) ss_weight_kernel(const __grid_constant__ Params p) {
  using Full = cutlass::arch::ClusterTransactionBarrier;
  using Bar = cutlass::arch::ClusterBarrier;
  __shared__ uint64_t full_bar[kStages], scaled_bar[kStages], empty_bar[kStages];
  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (cast_smem_ptr_to_uint(smem_raw) & 1023)) & 1023);
  bf16* smem_a = reinterpret_cast<bf16*>(smem);
  bf16* smem_b = reinterpret_cast<bf16*>(smem + kBytesA);
  float* smem_s = reinterpret_cast<float*>(smem + kBytesA + kBytesB);  // [stage][half][64 tokens]

  const int m_tiles = p.M / kBM, n_tiles = p.N / kBN, k_blocks = p.K / kBK;
  const int tiles = m_tiles * n_tiles;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Full::init(&full_bar[s], 1);
      Bar::init(&scaled_bar[s], kTransformThreads);  // every transform thread, after its fence
      Bar::init(&empty_bar[s], kConsumerThreads);    // every consumer thread, after its wgmma wait
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if (threadIdx.x == 0) {
      // ------------------------------------------------------------ loads (as rs_weight_kernel)
      prefetch_tma_descriptor(p.tma_a.get_tma_descriptor());
      prefetch_tma_descriptor(p.tma_b.get_tma_descriptor());
      Tensor mA = p.tma_a.get_tma_tensor(make_shape(p.M, p.K));
      Tensor mB = p.tma_b.get_tma_tensor(make_shape(p.N, p.K));
      Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});
      Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});
      auto cta_a = p.tma_a.get_slice(0);
      auto cta_b = p.tma_b.get_slice(0);
      Tensor tAsA = cta_a.partition_D(sA);
      Tensor tBsB = cta_b.partition_D(sB);
      uint32_t c = 0;
      for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int nt = t % n_tiles, mt = t / n_tiles;
        Tensor tAgA = cta_a.partition_S(local_tile(mA, Shape<Int<kBM>, Int<kBK>>{}, make_coord(mt, _)));
        Tensor tBgB = cta_b.partition_S(local_tile(mB, Shape<Int<kBN>, Int<kBK>>{}, make_coord(nt, _)));
        const float* s0 = p.s + size_t((mt * kBM) / kGroup) * p.K;
        const float* s1 = p.s + size_t((mt * kBM + kSlice) / kGroup) * p.K;
#pragma unroll 1
        for (int kb = 0; kb < k_blocks; ++kb, ++c) {
          const int s = c % kStages;
          Bar::wait(&empty_bar[s], ((c / kStages) & 1) ^ 1);
          Full::arrive_and_expect_tx(&full_bar[s], kTxBytes);
          copy(p.tma_a.with(full_bar[s]), tAgA(_, _, _, kb), tAsA(_, _, _, s));
          copy(p.tma_b.with(full_bar[s]), tBgB(_, _, _, kb), tBsB(_, _, _, s));
          float* ds = smem_s + s * 2 * kBK;
          SM90_BULK_COPY_G2S::copy(s0 + kb * kBK, &full_bar[s], ds, kBK * 4);
          SM90_BULK_COPY_G2S::copy(s1 + kb * kBK, &full_bar[s], ds + kBK, kBK * 4);
        }
      }
    } else if (threadIdx.x >= 32) {
      // ------------------------------------------------------------ transform: scale in place
      const int tt = threadIdx.x - 32;
      const uint32_t a_base = cast_smem_ptr_to_uint(smem_a);
      const int stages_total = ((tiles - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x)) * k_blocks;
#pragma unroll 1
      for (int c = 0; c < stages_total; ++c) {
        const int s = c % kStages;
        Full::wait(&full_bar[s], (c / kStages) & 1);
        const uint32_t stage = a_base + s * (kBM * kBK * 2);
        const float* ss = smem_s + s * 2 * kBK;  // [half][token]: row R's scale is ss[R]
        constexpr int kIters = (kChunks + kTransformThreads - 1) / kTransformThreads;
        CUTE_UNROLL
        for (int i0 = 0; i0 < kIters; i0 += 4) {
          uint4 v[4];
          float sc[4];
          CUTE_UNROLL
          for (int u = 0; u < 4; ++u) {
            const int i = tt + kTransformThreads * (i0 + u);
            if (i0 + u < kIters && i < kChunks) {
              v[u] = ld_shared_v4(stage + 16 * i);
              sc[u] = p.scale_on ? ss[i / 8] : 1.0f;
            }
          }
          CUTE_UNROLL
          for (int u = 0; u < 4; ++u) {
            const int i = tt + kTransformThreads * (i0 + u);
            if (i0 + u < kIters && i < kChunks) st_shared_v4(stage + 16 * i, scale_chunk<kPow2>(v[u], sc[u]));
          }
        }
        cutlass::arch::fence_view_async_shared();  // the generic-proxy writes, before wgmma reads them
        Bar::arrive(&scaled_bar[s]);
      }
    }
    return;
  }

  // ------------------------------------------------------------------ consumers: SS wgmma
  cutlass::arch::warpgroup_reg_alloc<224>();
  const int ct = threadIdx.x - 128;
  TiledMmaSS mma;
  auto thr_mma = mma.get_slice(ct);
  Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));  // descriptors (MMA, 1, 4, stage)
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  Tensor accum = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
  static_assert(size(decltype(accum){}) == 128);
  Tensor tCcC = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));

  uint32_t c = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int nt = t % n_tiles, mt = t / n_tiles;
    mma.accumulate_ = GMMA::ScaleOut::Zero;
#pragma unroll 1
    for (int kb = 0; kb < k_blocks; ++kb) {
      const uint32_t cc = c + kb;
      const int s = cc % kStages;
      Bar::wait(&scaled_bar[s], (cc / kStages) & 1);
      warpgroup_fence_operand(accum);
      warpgroup_arrive();
      CUTE_UNROLL
      for (int k = 0; k < size<2>(tCrA); ++k) {
        cute::gemm(mma, tCrA(_, _, k, s), tCrB(_, _, k, s), accum);
        mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      warpgroup_wait<1>();  // k-block kb - 1's group done: its stage may be refilled
      warpgroup_fence_operand(accum);
      if (kb > 0) Bar::arrive(&empty_bar[(cc - 1) % kStages]);
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accum);
    Bar::arrive(&empty_bar[(c + k_blocks - 1) % kStages]);
    c += k_blocks;

    float* dt = p.d + size_t(mt) * kBM * p.N + size_t(nt) * kBN;
    store_tile(accum, tCcC, dt, p.N);
  }
}

/// Host check of the staged form's premise: in the TMA's view of a stage (the 128B swizzle on
/// byte offsets) element (m, k) lies in 128-byte row k + 64 (m / 64), and the SS consumers'
/// accumulator pairs are adjacent columns of one row (the epilogue's 8-byte stores).
bool check_stage_rows() {
  const SmemLayoutA tma_layout{};
  for (int m = 0; m < kBM; ++m)
    for (int k = 0; k < kBK; ++k) {
      const int byte = int(tma_layout.layout_a()(2 * int(tma_layout.layout_b()(m, k, 0))));
      if (byte / 128 != k + 64 * (m / 64) || byte < 0 || byte >= kBM * kBK * 2) return false;
    }
  TiledMmaSS mma;
  auto cC = make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{});
  for (int t = 0; t < kConsumerThreads; ++t) {
    auto tCcC = mma.get_slice(t).partition_C(cC);
    if (size(tCcC) != 128) return false;
    for (int i = 0; i < size(tCcC); i += 2)
      if (get<0>(tCcC(i + 1)) != get<0>(tCcC(i)) || get<1>(tCcC(i + 1)) != get<1>(tCcC(i)) + 1 ||
          get<1>(tCcC(i)) % 2 != 0)
        return false;
  }
  return true;
}

/// Host check of the layout facts the kernel relies on beyond CuTe's own construction, for every
/// consumer thread: the fragment storage is compact; 32-bit fragment register j holds row r0 (j
/// even) or r1 (j odd), both in the thread's warpgroup's 64-row slice, and the tokens k(j) =
/// c0 + 16 (j / 4) + 8 ((j / 2) & 1) (low half) and k(j) + 1 (high half), c0 even; ldmatrix.trans
/// delivers every register where the MMA expects it, reads each tile element once, and each of
/// its 16-byte reads is 8 consecutive, 8-aligned elements of the swizzled MN-major stage, which
/// is the layout the TMA writes; accumulator pairs are adjacent columns of one row of the
/// thread's slice. Besides CuTe's own account of the copy (partition_D against retile_D), the
/// register placement is re-derived from the PTX ISA alone: the wgmma m64nNk16 A fragment (lane
/// L of warp w holds a0..a7 at row 16 w + L / 4, + 8 for a2, a3, a6, a7, and k 2 (L % 4), + 1 for
/// odd a, + 8 for a4..a7, per k16 slice) and ldmatrix.x4.trans (lane 8 q + i addresses row i of
/// matrix q; lane L receives in register q element L / 4 of rows 2 (L % 4) and 2 (L % 4) + 1,
/// low half first), applied to the source rows CuTe assigns to each lane.
bool check_layouts() {
  TiledMma mma;
  auto cA = make_identity_tensor(Shape<Int<kBM>, Int<kBK>>{});
  auto cC = make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{});
  auto s2r = make_tiled_copy_A(S2RCopyAtomA{}, mma);
  auto sA = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr((bf16*)nullptr), SmemLayoutA{}));
  const auto smem_layout = sA.layout();  // element offsets, the 128B swizzle recast to elements
  // the ldmatrix view (element offsets, swizzle recast to elements) and the TMA's (the 128B
  // swizzle on byte offsets) put every element of a stage at the same address
  const SmemLayoutA tma_layout{};
  for (int m = 0; m < kBM; ++m)
    for (int k = 0; k < kBK; ++k)
      if (int(tma_layout.layout_a()(2 * int(tma_layout.layout_b()(m, k, 0)))) != 2 * int(smem_layout(m, k, 0)))
        return false;
  std::vector<int> src_hits(kBM * kBK, 0);
  // per thread, per ldmatrix call, the (m, k) of its 8 source elements: src_mk[t][call][v]
  constexpr int kCalls = 4;
  std::vector<std::array<std::array<std::pair<int, int>, 8>, kCalls>> src_mk(kConsumerThreads);
  for (int t = 0; t < kConsumerThreads; ++t) {
    auto src = s2r.get_thread_slice(t).partition_S(cA);  // (CPY, CPY_M, CPY_K)
    if (size<0>(src) != 8 || size<1>(src) * size<2>(src) != kCalls) return false;
    for (int a = 0; a < size<1>(src); ++a)
      for (int b = 0; b < size<2>(src); ++b)
        for (int v = 0; v < 8; ++v)
          src_mk[t][a + size<1>(src) * b][v] = {get<0>(src(v, a, b)), get<1>(src(v, a, b))};
  }
  for (int t = 0; t < kConsumerThreads; ++t) {
    auto thr = mma.get_slice(t);
    auto frag = make_frag_a(thr, sA);
    auto acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
    for (int i = 0; i < size(frag); ++i)
      if (frag.layout()(i) != i) return false;
    for (int i = 0; i < size(acc); ++i)
      if (acc.layout()(i) != i) return false;
    auto tCcA = thr.partition_A(cA);
    if (size(tCcA) != size(frag) || size(frag) != 32) return false;
    const int r0 = get<0>(tCcA(0)), r1 = get<0>(tCcA(2)), c0 = get<1>(tCcA(0));
    if (r0 / kSlice != t / 128 || r1 / kSlice != t / 128 || r0 == r1 || c0 % 2 != 0) return false;
    const int lane = t % 32, warp = (t % 128) / 32;
    for (int i = 0; i < size(tCcA); ++i) {
      const int j = i / 2;  // the 32-bit register
      if (get<0>(tCcA(i)) != ((j & 1) ? r1 : r0)) return false;
      if (get<1>(tCcA(i)) != c0 + 16 * (j / 4) + 8 * ((j / 2) & 1) + (i & 1)) return false;
      // the PTX ISA's A fragment: a_v of k16 slice i / 8
      const int v = i % 8;
      if (get<0>(tCcA(i)) != kSlice * (t / 128) + 16 * warp + lane / 4 + 8 * ((v / 2) & 1) ||
          get<1>(tCcA(i)) != 16 * (i / 8) + 2 * (lane % 4) + 8 * (v / 4) + (v & 1))
        return false;
    }
    // ldmatrix moves data between threads; what must agree is where the copy delivers each
    // destination register (its partition_D) and where the MMA expects it (retile_D of the
    // MMA's partition), and the sources must cover the tile once.
    auto thr_s2r = s2r.get_thread_slice(t);
    auto dst_copy = thr_s2r.partition_D(cA);
    auto dst_mma = thr_s2r.retile_D(tCcA);
    auto src = thr_s2r.partition_S(cA);  // (CPY, CPY_M, CPY_K)
    if (size(dst_copy) != size(dst_mma) || size(src) != size(dst_mma)) return false;
    for (int i = 0; i < size(dst_mma); ++i) {
      if (get<0>(dst_copy(i)) != get<0>(dst_mma(i)) || get<1>(dst_copy(i)) != get<1>(dst_mma(i))) return false;
      ++src_hits[get<0>(src(i)) * kBK + get<1>(src(i))];
    }
    // ldmatrix.x4.trans per the PTX ISA: register q of call (a, b) gets element lane / 4 of the
    // rows lanes 8 q + 2 (lane % 4) and + 1 of the warp address; the MMA wants dst_mma(2 q, a, b)
    // and dst_mma(2 q + 1, a, b) there (the copy's 8 values are its 4 registers, low half first)
    for (int a = 0; a < size<1>(src); ++a)
      for (int b = 0; b < size<2>(src); ++b)
        for (int q = 0; q < 4; ++q)
          for (int h = 0; h < 2; ++h) {
            const auto mk = src_mk[t - lane + 8 * q + 2 * (lane % 4) + h][a + size<1>(src) * b][lane / 4];
            const auto want = dst_mma(2 * q + h, a, b);
            if (mk.first != get<0>(want) || mk.second != get<1>(want)) return false;
          }
    // the sliced loop copies k16 slice b alone into the registers the MMA's slice b reads
    for (int a = 0; a < size<1>(src); ++a)
      for (int b = 0; b < size<2>(src); ++b)
        for (int v = 0; v < size<0>(src); ++v)
          if (get<1>(dst_mma(v, a, b)) / 16 != b) return false;
    // each ldmatrix source: 8 consecutive elements of the swizzled stage, 16-byte aligned
    for (int a = 0; a < size<1>(src); ++a)
      for (int b = 0; b < size<2>(src); ++b) {
        const int base = smem_layout(get<0>(src(0, a, b)), get<1>(src(0, a, b)), 0);
        if (base % 8 != 0) return false;
        for (int v = 1; v < 8; ++v)
          if (smem_layout(get<0>(src(v, a, b)), get<1>(src(v, a, b)), 0) != base + v) return false;
      }
    auto tCcC = thr.partition_C(cC);
    for (int i = 0; i < size(tCcC); i += 2)
      if (get<0>(tCcC(i + 1)) != get<0>(tCcC(i)) || get<1>(tCcC(i + 1)) != get<1>(tCcC(i)) + 1 ||
          get<1>(tCcC(i)) % 2 != 0 || get<0>(tCcC(i)) / kSlice != t / 128)
        return false;
  }
  return std::all_of(src_hits.begin(), src_hits.end(), [](int h) { return h == 1; });
}

/// Host check of the hidden multicast's split, in the terms CuTe builds it: a stage's hidden tile
/// is kBN / 64 TMA boxes (one a 64-wide H slab) and with kClusterM CTAs each box is cut along K
/// (tokens), so CTA r's copies start at (64 j, r kBK / kClusterM) for every slab j. Each CTA then
/// writes 1 / kClusterM of the stage into every CTA of the cluster, and every CTA's full barrier
/// expects the whole stage (kTxBytes). Catches a slice taken for the wrong rank or a split along H.
bool check_multicast() {
  const TmaBMc tma{};  // the split is in the type; no descriptor (no driver) needed
  constexpr int kBoxElems = 64 * kBK;
  static_assert(decltype(tma)::AtomNumVal::value == kBoxElems, "one TMA copy a 64-wide H slab");
  auto coords = make_identity_tensor(Shape<Int<kBN>, Int<kBK>>{});
  for (int r = 0; r < kClusterM; ++r) {
    auto src = tma.get_slice(r).partition_S(coords);
    auto dst = tma.get_slice(r).partition_D(coords);
    if (size(src) != kBN * kBK || size(dst) != size(src)) return false;
    for (int j = 0; j < kBN / 64; ++j) {
      const auto a = src(j * kBoxElems), b = dst(j * kBoxElems);
      if (get<0>(a) != 64 * j || get<1>(a) != r * kBK / kClusterM) return false;
      if (get<0>(b) != get<0>(a) || get<1>(b) != get<1>(a)) return false;
    }
  }
  return true;
}

/// The launcher: refuses (returns false, nothing launched) what the kernel does not handle.
/// kCluster = kClusterM: clusters of two CTAs along V sharing each hidden stage (V % 256).
template <int kCluster = 1, bool kPow2 = false, bool kSliced = false, bool kStaged = false>
struct RsWeight {
  static_assert(!kStaged || (kCluster == 1 && !kSliced), "the staged form has no cluster or sliced variant");
  Params p{};
  int grid = 0;
  static constexpr auto kernel = [] {
    if constexpr (kStaged) return ss_weight_kernel<kPow2>;
    else return rs_weight_kernel<kCluster, kPow2, kSliced>;
  }();
  // D (V x H) = (E * F * r)^T hidden; e: T x V, s: ceil(V / 192) x T, hidden: T x H
  bool init(int V, int H, int T, const bf16* e, const float* s, const bf16* hidden, float* d, bool scale_on) {
    if (V <= 0 || H <= 0 || T <= 0 || V % (kBM * kCluster) || H % kBN || T % kBK) return false;
    if ((reinterpret_cast<uintptr_t>(e) | reinterpret_cast<uintptr_t>(hidden)) % 128 ||
        reinterpret_cast<uintptr_t>(d) % 8 || reinterpret_cast<uintptr_t>(s) % 16)
      return false;
    if (size_t(V / kBM) * (H / kBN) > size_t(1) << 30) return false;
    p.tma_a = make_tma_a(e, V, T);
    p.tma_b = make_tma_b(hidden, H, T);
    p.tma_b_mc = make_tma_b_mc(hidden, H, T);
    p.s = s;
    p.d = d;
    p.M = V;
    p.N = H;
    p.K = T;
    p.scale_on = scale_on;
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) return false;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes) != cudaSuccess)
      return false;
    const int c_tiles = (V / kBM / kCluster) * (H / kBN);
    if constexpr (kCluster == 1) {
      grid = std::min(sms, c_tiles);
    } else {
      // as many clusters as can be resident at once (a cluster's CTAs share a GPC), one per
      // cluster tile at most
      cudaLaunchConfig_t cfg = config(nullptr);
      cudaLaunchAttribute attr = cluster_attr();
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      cfg.gridDim = dim3(kCluster * c_tiles);
      int clusters = 0;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters <= 0) return false;
      grid = kCluster * std::min(clusters, c_tiles);
    }
    return true;
  }
  bool run(cudaStream_t s) {
    if constexpr (kCluster == 1) {
      kernel<<<grid, kThreads, kSmemBytes, s>>>(p);
    } else {
      cudaLaunchConfig_t cfg = config(s);
      cudaLaunchAttribute attr = cluster_attr();
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      if (cudaLaunchKernelEx(&cfg, kernel, p) != cudaSuccess) return false;
    }
    return cudaGetLastError() == cudaSuccess;
  }

 private:
  cudaLaunchConfig_t config(cudaStream_t s) const {
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = kSmemBytes;
    cfg.stream = s;
    return cfg;
  }
  static cudaLaunchAttribute cluster_attr() {
    cudaLaunchAttribute a{};
    a.id = cudaLaunchAttributeClusterDimension;
    a.val.clusterDim.x = kCluster;
    a.val.clusterDim.y = 1;
    a.val.clusterDim.z = 1;
    return a;
  }
};

}  // namespace rw

// ------------------------------------------------------------------------------------------------
// References: CUTLASS's plain SS cooperative kernel and cuBLASLt, on the prescaled A'
// ------------------------------------------------------------------------------------------------

/// A row- or column-major (rows, cols, batch) stride whose dynamic leading mode is ld (the
/// batch mode's: batch).
template <class Stride>
Stride with_ld(int64_t ld, int64_t batch) {
  Stride s{};
  if constexpr (!is_static<remove_cvref_t<decltype(get<0>(s))>>::value) get<0>(s) = ld;
  if constexpr (!is_static<remove_cvref_t<decltype(get<1>(s))>>::value) get<1>(s) = ld;
  get<2>(s) = batch;
  return s;
}

using TileMNK = Shape<_128, _256, _64>;
using ClusterMNK = Shape<_1, _1, _1>;
using KSched = cg::KernelTmaWarpSpecializedCooperative;
using Epi = typename cutlass::epilogue::collective::CollectiveBuilder<
    cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileMNK, ClusterMNK,
    cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, RM, 4, float, RM, 4,
    cutlass::epilogue::TmaWarpSpecializedCooperative>::CollectiveOp;

cutlass::KernelHardwareInfo hw_info() {
  cutlass::KernelHardwareInfo hw;
  hw.device_id = 0;
  hw.sm_count = cutlass::KernelHardwareInfo::query_device_multiprocessor_count(0);
  return hw;
}

/// Checks the arguments and the workspace and initializes `gemm` for them.
template <class Gemm>
bool prepare(Gemm& gemm, const typename Gemm::Arguments& args, void* ws, size_t wsb, cudaStream_t s) {
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) > wsb) return false;
  return gemm.initialize(args, ws, s) == cutlass::Status::kSuccess;
}

// CUTLASS's plain product of the same tile and schedule (A = A'^T MN-major, B = hidden MN-major,
// both in shared memory), on the prescaled operand.
struct Plain {
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, CM, 8, bf16, RM, 8, float, TileMNK, ClusterMNK,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KSched>::CollectiveOp;
  using GK = cg::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;
  Gemm gemm;
  // D (V x H, row-major) = pre^T (pre: T x V row-major) hidden (T x H row-major)
  bool init(int V, int H, int T, const bf16* pre, const bf16* hidden, float* d, void* ws, size_t wsb,
            cudaStream_t s) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {V, H, T, 1},
                                  {pre, with_ld<typename GK::StrideA>(V, int64_t(V) * T), hidden,
                                   with_ld<typename GK::StrideB>(H, int64_t(T) * H)},
                                  {{1.0f, 0.0f}, nullptr, with_ld<typename GK::StrideC>(H, int64_t(V) * H), d,
                                   with_ld<typename GK::StrideD>(H, int64_t(V) * H)},
                                  hw_info()};
    return prepare(gemm, args, ws, wsb, s);
  }
  bool run(cudaStream_t s) { return gemm.run(s) == cutlass::Status::kSuccess; }
};

/// cuBLASLt's first heuristic candidate for D (V x H, float32, row-major) = pre^T hidden (pre:
/// T x V, hidden: T x H, both row-major), bf16 in, float32 compute: the grad_weight product.
struct Lt {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulHeuristicResult_t algo{};
  bool ok = false;
  Lt(cublasLtHandle_t handle, int V, int H, int T, size_t wsb) : h(handle) {
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    // column-major view: D^T (H x V) = hidden^T (H x T, op N) . pre (V x T stored, op T)
    const cublasOperation_t tb = CUBLAS_OP_T;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, H, T, H);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, V, T, V);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, H, V, H);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, op, la, lb, ld, ld, pref, 1, &algo, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    ok = found > 0;
  }
  bool run(const bf16* pre, const bf16* hidden, float* d, void* ws, size_t wsb, cudaStream_t s) {
    const float alpha = 1, beta = 0;
    return cublasLtMatmul(h, op, &alpha, hidden, la, pre, lb, &beta, d, ld, d, ld, &algo.algo, ws, wsb, s) ==
           CUBLAS_STATUS_SUCCESS;
  }
};

// ------------------------------------------------------------------------------------------------
// Data, checks, timing
// ------------------------------------------------------------------------------------------------

__device__ uint32_t mix(size_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return x;
}

// E (T x V): 2^(z log2 e - k) in (2^-12, 1]; F ((V / 192) x T): 2^-j, j in [0, 40); r (T): [0.5, 2)
// 2^-u, u in [0, 10); hidden (T x H): small random. E F r >= 2^-61 stays a normal bf16.
__global__ void fill(bf16* e, bf16* f, float* r, bf16* hid, int T, int V, int H, int blocks) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t i0 = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (size_t i = i0; i < size_t(T) * blocks; i += stride) f[i] = bf16(exp2f(-float(mix(i, 7u) % 40u)));
  for (size_t i = i0; i < size_t(T); i += stride) {
    const uint32_t x = mix(i, 11u);
    r[i] = (0.5f + 1.5f * float(x & 0xffff) / 65536.0f) * exp2f(-float((x >> 16) % 10u));
  }
  for (size_t i = i0; i < size_t(T) * H; i += stride) hid[i] = bf16(((mix(i, 3u) & 0xffff) / 32768.0f - 1.0f) * 0.02f);
  for (size_t i = i0; i < size_t(T) * V; i += stride) e[i] = bf16(exp2f(-12.0f * (mix(i, 5u) & 0xffff) / 65536.0f));
}

/// The kernel's scales: S[b * T + t] = F[b * T + t] r[t] in float32 (what the merge would write).
__global__ void make_scales(const bf16* f, const float* r, float* s, int T, int blocks) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * blocks; i += stride)
    s[i] = float(f[i]) * r[i % T];
}

/// The pow2 variant's pass over the hidden states: hidden'[t, :] = bf16(r[t] float(hidden[t, :])).
__global__ void scale_rows(const bf16* hid, const float* r, bf16* out, int T, int H) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(T) * H; i += stride)
    out[i] = bf16(float(hid[i]) * r[i / H]);
}

/// The prescale pass: A'[t, v] = bf16(float(E[t, v]) * (float(F[t, v / 192]) * r[t])), 8 elements
/// (one 192-block: 8 divides 192) a thread. Grid (ceil(V / 8 / 256), T).
__global__ void prescale(const bf16* e, const bf16* f, const float* r, bf16* pre, int T, int V) {
  const int chunk = blockIdx.x * blockDim.x + threadIdx.x, t = blockIdx.y;
  if (chunk >= V / 8) return;
  const int v0 = chunk * 8;
  const float s = float(f[size_t(v0 / kGroup) * T + t]) * r[t];
  const size_t i = size_t(t) * V + v0;
  alignas(16) bf16 x[8];
  *reinterpret_cast<uint4*>(x) = *reinterpret_cast<const uint4*>(e + i);
  CUTE_UNROLL
  for (int j = 0; j < 8; ++j) x[j] = bf16(float(x[j]) * s);
  *reinterpret_cast<uint4*>(pre + i) = *reinterpret_cast<const uint4*>(x);
}

__global__ void fill_const(float* x, int n, float v) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) x[i] = v;
}

__global__ void max_abs_diff(const float* a, const float* b, size_t n, float* out) {
  float w = 0, m = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const float dd = fabsf(a[i] - b[i]);
    w = dd != dd ? __int_as_float(0x7f800000) : fmaxf(w, dd);  // a NaN in ours (or the reference) is +inf
    m = fmaxf(m, fabsf(b[i]));
  }
  atomicMax(reinterpret_cast<int*>(out), __float_as_int(w));
  atomicMax(reinterpret_cast<int*>(out) + 1, __float_as_int(m));
}

float rel_diff(const float* d, const float* ref, size_t n, float* scratch) {
  CK(cudaMemset(scratch, 0, 8));
  max_abs_diff<<<1024, 256>>>(d, ref, n, scratch);
  float dm[2];
  CK(cudaMemcpy(dm, scratch, 8, cudaMemcpyDeviceToHost));
  return dm[0] / std::max(dm[1], 1e-30f);
}

template <class F>
float time_it(F f, cudaStream_t s, int reps = 10) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < 2; ++i) f();
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
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return t[t.size() / 2];
}

/// A checked run waited for with a deadline: a kernel that never finishes (an mbarrier or
/// transaction-count mistake: neither kernel has run before) is named, and the process ends
/// without waiting for the device (which would hang too).
void sync_or_die(cudaStream_t s, const char* what, double seconds = 20.0) {
  const auto t0 = std::chrono::steady_clock::now();
  for (;;) {
    const cudaError_t e = cudaStreamQuery(s);
    if (e == cudaSuccess) break;
    if (e != cudaErrorNotReady) {
      printf("%s: %s\n", what, cudaGetErrorString(e));
      fflush(stdout);
      std::_Exit(3);
    }
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > seconds) {
      printf("%s: not finished after %.0f s (a hang?); giving up\n", what, seconds);
      fflush(stdout);
      std::_Exit(3);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  CK(cudaGetLastError());
}

float median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "";
  const bool profile = which == "profile", staged = which == "staged" || profile;
  const bool with_cluster = which == "cluster" || profile, pow2 = which == "pow2" || staged;
  if (!which.empty() && !with_cluster && !pow2) {
    printf("usage: rs_weight [cluster|profile|pow2|staged]: the kernel, or the kernel and its cluster variant; profile: "
           "every variant's checked runs at 4096 tokens and no timing (for ncu); pow2: the kernel and its pow2 variants; "
           "staged: those and the staged forms (float and pow2)\n");
    return 2;
  }
  if (!rw::check_layouts()) {
    printf("rs_weight: a fragment layout is not what the kernel assumes; nothing launched\n");
    return 1;
  }
  if (!rw::check_stage_rows()) {
    printf("rs_weight: a stage's 128-byte rows are not one token of one 64-row half; nothing launched\n");
    return 1;
  }
  if (!rw::check_multicast()) {
    printf("rs_weight: the hidden multicast's slices do not start where the kernel assumes; nothing launched\n");
    return 1;
  }
  printf("rs_weight: layout check passed (all %d consumer threads: ldmatrix.trans -> wgmma fragment, "
         "token pairs per register, each element read once, epilogue pairs)\n",
         rw::kConsumerThreads);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    printf("no GPU: nothing launched\n");
    return 0;
  }
  cudaFuncAttributes fa;
  CK(cudaFuncGetAttributes(&fa, rw::rs_weight_kernel<1>));
  printf("rs_weight kernel: %d registers at launch (consumers raise theirs to 232), %zu B local memory\n",
         fa.numRegs, fa.localSizeBytes);
  CK(cudaFuncGetAttributes(&fa, rw::rs_weight_kernel<rw::kClusterM>));
  printf("its cluster variant: %d registers at launch, %zu B local memory\n\n", fa.numRegs, fa.localSizeBytes);

  constexpr int V = 128256, H = 4096;
  std::vector<int> token_counts = {4096, 8192, 2048};
  if (profile) token_counts.resize(1);
  const int blocks = (V + kGroup - 1) / kGroup;
  const int t_max = *std::max_element(token_counts.begin(), token_counts.end());
  bf16 *e, *f, *hid, *pre, *pre2 = nullptr, *hid2 = nullptr;
  float *r, *sc, *d0, *d1, *d2, *scratch, *ones = nullptr, *sc2 = nullptr, *d3 = nullptr;
  CK(cudaMalloc(&e, size_t(t_max) * V * 2));
  CK(cudaMalloc(&pre, size_t(t_max) * V * 2));
  CK(cudaMalloc(&hid, size_t(t_max) * H * 2));
  CK(cudaMalloc(&f, size_t(t_max) * blocks * 2));
  CK(cudaMalloc(&sc, size_t(t_max) * blocks * 4));
  CK(cudaMalloc(&r, size_t(t_max) * 4));
  CK(cudaMalloc(&d0, size_t(V) * H * 4));
  CK(cudaMalloc(&d1, size_t(V) * H * 4));
  CK(cudaMalloc(&d2, size_t(V) * H * 4));
  CK(cudaMalloc(&scratch, 8));
  if (pow2) {  // the pow2 variant's operands: E F (exact), r hidden, its scales F, its output
    CK(cudaMalloc(&pre2, size_t(t_max) * V * 2));
    CK(cudaMalloc(&hid2, size_t(t_max) * H * 2));
    CK(cudaMalloc(&ones, size_t(t_max) * 4));
    CK(cudaMalloc(&sc2, size_t(t_max) * blocks * 4));
    CK(cudaMalloc(&d3, size_t(V) * H * 4));
  }
  const size_t wsb = size_t(64) << 20;
  void *ws, *ws_plain;
  CK(cudaMalloc(&ws, wsb));
  CK(cudaMalloc(&ws_plain, wsb));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasLtHandle_t h;
  cublasLtCreate(&h);
  printf("| tokens x V x H | prescale pass E,F,r -> A' (ms) | cuBLASLt on A' (ms) | CUTLASS plain on A' (ms, x cuBLASLt) "
         "| rs_weight (ms, x cuBLASLt, x (prescale + cuBLASLt)) | rs_weight vs cuBLASLt max rel diff "
         "| vs float64 (16 outputs) | control: scales forced to 1, vs cuBLASLt |%s\n"
         "|---|---|---|---|---|---|---|---|%s\n",
         with_cluster ? " cluster 2x1, hidden multicast (ms, x cuBLASLt, x rs_weight) | its max rel diff vs cuBLASLt "
                        "| vs float64 | its control |"
                      : "",
         with_cluster ? "---|---|---|---|" : "");
  if (pow2)
    printf("pow2 columns (after the table's): the pass r hidden (ms) | cuBLASLt on E F, r hidden (ms) | rs_weight pow2 "
           "(ms, x that cuBLASLt, x rs_weight) | its max rel diff vs that cuBLASLt | vs float64 | its control | the same "
           "with the cluster 2x1 (ms, x that cuBLASLt) | diff | float64 | control | the same sliced (ms, x that "
           "cuBLASLt) | diff | float64 | control\n");
  if (staged)
    printf("staged columns (last): the staged form, float scales (ms, x cuBLASLt on A', x (prescale + cuBLASLt)) | its "
           "diff vs cuBLASLt on A' | float64 | control | the staged pow2 form (ms, x cuBLASLt on E F, r hidden) | diff | "
           "float64 | control\n");
  printf("\n");
  for (const int T : token_counts) {
    fill<<<2048, 256>>>(e, f, r, hid, T, V, H, blocks);
    make_scales<<<1024, 256>>>(f, r, sc, T, blocks);
    const dim3 pgrid((V / 8 + 255) / 256, T);
    auto run_prescale = [&] { prescale<<<pgrid, 256, 0, s>>>(e, f, r, pre, T, V); };
    run_prescale();
    CK(cudaDeviceSynchronize());
    CK(cudaGetLastError());
    Lt lt(h, V, H, T, wsb);
    rw::RsWeight<1> scaled, control;
    rw::RsWeight<rw::kClusterM> clustered, control_c;
    Plain plain;
    const bool lt_ok = lt.ok && lt.run(pre, hid, d0, ws, wsb, s);
    CK(cudaMemsetAsync(d1, 0x7f, size_t(V) * H * 4, s));  // poisoned: an unwritten D cannot pass
    const bool sc_ok = scaled.init(V, H, T, e, sc, hid, d1, true) && scaled.run(s);
    sync_or_die(s, "rs_weight");
    if (!lt_ok || !sc_ok) {
      printf("| %dx%dx%d | | %s | | %s | | | |\n", T, V, H, lt_ok ? "ok" : "cuBLASLt failed",
             sc_ok ? "ok" : "rs_weight refused the arguments");
      continue;
    }
    const float diff = rel_diff(d1, d0, size_t(V) * H, scratch);
    // float64 dot products at 16 sampled outputs, relative to the largest |reference| among them
    auto f64_err = [&](const float* d, const bf16* a_op, const bf16* b_op) {
      std::vector<bf16> hcol_a(T), hcol_b(T);
      float got = 0;
      double worst = 0, big = 0;
      for (int q = 0; q < 16; ++q) {
        const int v = (q * 2654435761u) % V, n = (q * 40503u + 11) % H;
        CK(cudaMemcpy2D(hcol_a.data(), 2, a_op + v, size_t(V) * 2, 2, T, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy2D(hcol_b.data(), 2, b_op + n, size_t(H) * 2, 2, T, cudaMemcpyDeviceToHost));
        double ref = 0;
        for (int k = 0; k < T; ++k) ref += double(float(hcol_a[k])) * double(float(hcol_b[k]));
        CK(cudaMemcpy(&got, d + size_t(v) * H + n, 4, cudaMemcpyDeviceToHost));
        const double err = std::abs(double(got) - ref);
        worst = err == err ? std::max(worst, err) : INFINITY;  // a NaN output fails
        big = std::max(big, std::abs(ref));
      }
      return worst / std::max(big, 1e-300);
    };
    const double f64 = f64_err(d1, pre, hid);
    // the negative control (scales forced to 1)
    float ctl_diff = -1;
    CK(cudaMemsetAsync(d2, 0x7f, size_t(V) * H * 4, s));
    if (control.init(V, H, T, e, sc, hid, d2, false) && control.run(s)) {
      sync_or_die(s, "rs_weight, scales forced to 1");
      ctl_diff = rel_diff(d2, d0, size_t(V) * H, scratch);
    }
    CK(cudaGetLastError());
    // A variant checked alike: its output poisoned first (0x7f7f7f7f = 3.4e38), run, compared with
    // the reference in d0 and with float64 on its operands (a_op, b_op), then its control (scales
    // forced to 1) into d2. False where it refused the arguments.
    auto check_variant = [&](auto& kernel, auto& control_k, const float* scales, const bf16* b, float* out,
                             const bf16* a_op, const char* what, float& vdiff, double& vf64, float& vctl) {
      CK(cudaMemsetAsync(out, 0x7f, size_t(V) * H * 4, s));
      if (!(kernel.init(V, H, T, e, scales, b, out, true) && kernel.run(s))) return false;
      sync_or_die(s, what);
      vdiff = rel_diff(out, d0, size_t(V) * H, scratch);
      vf64 = f64_err(out, a_op, b);
      CK(cudaMemsetAsync(d2, 0x7f, size_t(V) * H * 4, s));
      if (control_k.init(V, H, T, e, scales, b, d2, false) && control_k.run(s)) {
        sync_or_die(s, what);
        vctl = rel_diff(d2, d0, size_t(V) * H, scratch);
      }
      return true;
    };
    // the cluster variant
    bool cl_ok = false;
    float cl_diff = -1, cl_ctl = -1;
    double cl_f64 = -1;
    if (with_cluster) {
      cl_ok = check_variant(clustered, control_c, sc, hid, d1, pre, "rs_weight cluster 2x1", cl_diff, cl_f64, cl_ctl);
    }

    // the staged form, float scales: the same A' as the prescale pass, in shared memory
    rw::RsWeight<1, false, false, true> stf, stfctl;
    bool stf_ok = false;
    float stf_diff = -1, stf_ctl = -1;
    double stf_f64 = -1;
    if (staged) stf_ok = check_variant(stf, stfctl, sc, hid, d1, pre, "staged", stf_diff, stf_f64, stf_ctl);

    // the pow2 variant: r on the hidden rows (one rounding there), F on E in the loop (exact)
    rw::RsWeight<1, true> p2k, p2ctl;
    bool p2_ok = false;
    float p2_diff = -1, p2_ctl = -1;
    double p2_f64 = -1;
    const int rgrid = 1024;
    auto run_rows = [&] { scale_rows<<<rgrid, 256, 0, s>>>(hid, r, hid2, T, H); };
    if (pow2) {
      fill_const<<<64, 256, 0, s>>>(ones, T, 1.0f);
      make_scales<<<1024, 256, 0, s>>>(f, ones, sc2, T, blocks);
      prescale<<<pgrid, 256, 0, s>>>(e, f, ones, pre2, T, V);
      run_rows();
      const bool ref_ok = lt.run(pre2, hid2, d0, ws, wsb, s);  // d0 is the pow2 reference from here on
      p2_ok = ref_ok && check_variant(p2k, p2ctl, sc2, hid2, d3, pre2, "rs_weight pow2", p2_diff, p2_f64, p2_ctl);
    }
    // ... and with the cluster (two CTAs along V sharing each r-hidden stage by multicast)
    rw::RsWeight<rw::kClusterM, true> p2c, p2cctl;
    bool p2c_ok = false;
    float p2c_diff = -1, p2c_ctl = -1;
    double p2c_f64 = -1;
    if (p2_ok) {
      p2c_ok = check_variant(p2c, p2cctl, sc2, hid2, d3, pre2, "rs_weight pow2 cluster 2x1", p2c_diff, p2c_f64, p2c_ctl);
    }
    // ... and sliced (each k16 slice of the next k-block loaded and scaled after one wgmma)
    rw::RsWeight<1, true, true> p2s, p2sctl;
    bool p2s_ok = false;
    float p2s_diff = -1, p2s_ctl = -1;
    double p2s_f64 = -1;
    if (p2_ok) {
      p2s_ok = check_variant(p2s, p2sctl, sc2, hid2, d3, pre2, "rs_weight pow2 sliced", p2s_diff, p2s_f64, p2s_ctl);
    }

    rw::RsWeight<1, true, false, true> stp, stpctl;
    bool stp_ok = false;
    float stp_diff = -1, stp_ctl = -1;
    double stp_f64 = -1;
    if (p2_ok && staged) {
      stp_ok = check_variant(stp, stpctl, sc2, hid2, d3, pre2, "staged pow2", stp_diff, stp_f64, stp_ctl);
    }

    if (profile) {  // the checked runs are what ncu profiles; CUTLASS's plain kernel once beside them
      Plain plain_once;
      if (plain_once.init(V, H, T, pre, hid, d2, ws_plain, wsb, s) && plain_once.run(s)) sync_or_die(s, "CUTLASS plain");
      continue;
    }
    std::vector<float> r0, r1, r2, r3, r4, r5, r6, r7, r8, r9, r10, r11;
    const bool plain_ok = plain.init(V, H, T, pre, hid, d2, ws_plain, wsb, s);
    for (int round = 0; round < 5; ++round) {
      r3.push_back(time_it(run_prescale, s));
      r0.push_back(time_it([&] { lt.run(pre, hid, d2, ws, wsb, s); }, s));
      if (plain_ok) r1.push_back(time_it([&] { plain.run(s); }, s));
      r2.push_back(time_it([&] { scaled.run(s); }, s));
      if (cl_ok) r4.push_back(time_it([&] { clustered.run(s); }, s));
      if (p2_ok) {
        r5.push_back(time_it([&] { p2k.run(s); }, s));
        r6.push_back(time_it(run_rows, s));
        r7.push_back(time_it([&] { lt.run(pre2, hid2, d2, ws, wsb, s); }, s));
      }
      if (p2c_ok) r8.push_back(time_it([&] { p2c.run(s); }, s));
      if (p2s_ok) r9.push_back(time_it([&] { p2s.run(s); }, s));
      if (stf_ok) r10.push_back(time_it([&] { stf.run(s); }, s));
      if (stp_ok) r11.push_back(time_it([&] { stp.run(s); }, s));
    }
    CK(cudaGetLastError());
    const float m0 = median(r0), m2 = median(r2), m3 = median(r3);
    char plain_s[64] = "refused";
    if (plain_ok) snprintf(plain_s, sizeof plain_s, "%.3f, %.3f", median(r1), median(r1) / m0);
    printf("| %dx%dx%d | %.3f | %.3f | %s | %.3f, %.3f, %.3f | %.1e | %.1e | %.1e |", T, V, H, m3, m0, plain_s, m2,
           m2 / m0, m2 / (m0 + m3), diff, f64, ctl_diff);
    if (cl_ok)
      printf(" %.3f, %.3f, %.3f | %.1e | %.1e | %.1e |", median(r4), median(r4) / m0, median(r4) / m2, cl_diff, cl_f64,
             cl_ctl);
    else if (with_cluster)
      printf(" refused | | | |");
    if (p2_ok)
      printf(" pow2: %.3f | %.3f | %.3f, %.3f, %.3f | %.1e | %.1e | %.1e |", median(r6), median(r7), median(r5),
             median(r5) / median(r7), median(r5) / m2, p2_diff, p2_f64, p2_ctl);
    if (p2c_ok)
      printf(" pow2 cluster 2x1: %.3f, %.3f | %.1e | %.1e | %.1e |", median(r8), median(r8) / median(r7), p2c_diff,
             p2c_f64, p2c_ctl);
    else if (pow2)
      printf(" pow2 refused |");
    if (p2s_ok)
      printf(" pow2 sliced: %.3f, %.3f | %.1e | %.1e | %.1e |", median(r9), median(r9) / median(r7), p2s_diff, p2s_f64,
             p2s_ctl);
    if (stf_ok)
      printf(" staged: %.3f, %.3f, %.3f | %.1e | %.1e | %.1e |", median(r10), median(r10) / m0, median(r10) / (m0 + m3),
             stf_diff, stf_f64, stf_ctl);
    else if (staged)
      printf(" staged refused |");
    if (stp_ok)
      printf(" staged pow2: %.3f, %.3f | %.1e | %.1e | %.1e |", median(r11), median(r11) / median(r7), stp_diff, stp_f64,
             stp_ctl);
    printf("\n");
    fflush(stdout);
  }
  return 0;
}
