// Experiment: grad_hidden = diag(r) (E * F) W with the scale riding our own register-sourced
// WGMMA main loop, so the prescale pass (and its bf16 buffer) disappears. E (rows x V, bf16,
// vocabulary-contiguous, values in [0, 1]) is what the logits product's scaled-exp epilogue
// stores; F holds one power of two per (row, 192-wide vocabulary tile), F[m + M * (k / 192)]
// (docs/architecture.md, "The third linear design"). probe.cu measured CUTLASS's stock
// mixed-input collective 1.66-2.04x slower than cuBLASLt on the prescaled operand, while CUTLASS's
// plain smem-sourced (SS) cooperative 128 x 256 kernel ran at 1.06-1.10x; this kernel aims at the
// plain SS speed. D (M x N, float32, row-major) = (E * F) W; r is applied elsewhere.
//
// The kernel (ours: our own __global__ and main loop, CuTe building blocks only):
// - Persistent, warp-specialized, sm_90a: grid = min(#SMs, #tiles), 384 threads, CTA tile
//   128 x 256 x 64. Warpgroup 0 is the producer (setmaxnreg 40): one thread issues the TMA loads
//   of the E tile (128 x 64, K-major, 128B swizzle) and the W tile (64 x 256, MN-major, 128B
//   swizzle) into a ring of 4 stages (4 x 48 KB = 192 KB; a fifth, 240 KB, would not fit the
//   227 KB of dynamic smem). Warpgroups 1 and 2 consume (setmaxnreg 232, for every variant:
//   the third A buffer's 16 registers a thread fit in it without spills).
// - Tile raster (tile_coord, the same call in producer and consumers; CTA b takes tiles b,
//   b + grid, ...). Plain: m-fastest over all M tiles (t -> m = t % (M/128), n = t / (M/128)),
//   so the CTAs in flight share W's column slabs. Grouped (kGrouped, runtime group height G in M
//   tiles): the M tiles are cut into groups of G (the last one gm = min(G, M/128 - first) high);
//   with P = G * (N/256), group g = t / P holds first = g * G and within = t % P, and
//   t -> m = first + within % gm, n = within / gm, so the CTAs in flight span about G M tiles by
//   grid / G N tiles and share both E's row slabs and W's column slabs. Both are bijections of
//   [0, tiles) onto the M x N tiles; check_raster enumerates each raster for each shape on the
//   host before any launch (main) and again in init, which refuses a raster that is not one.
// - Schedule: cooperative. Both consumer warpgroups work on the same 128 x 256 tile, 64 rows each
//   (a 64 x 256 float32 accumulator = 128 registers a thread), and share every smem stage. A
//   ping-pong warpgroup owning a whole 128 x 256 tile would need 256 accumulator registers; one
//   owning a 64 x 256 tile would need a B stage of its own, halving the smem reuse of W per FLOP.
//   Ping-pong's gain, hiding the epilogue, is worth nothing here: with K = 128256 a tile's main
//   loop runs ~2000 k-blocks and its epilogue is one 64 KB store per warpgroup.
// - Per k-block (64 of K) a consumer thread ldmatrix-es its A fragment (64 rows x 64 k of its
//   warpgroup: 16 x 32-bit registers) from the swizzled stage into registers (SM75_U32x4_LDSM_N,
//   laid out by make_tiled_copy_A over the tiled MMA and written through retile_D of the MMA's
//   fragment, so each register lands where the wgmma expects it; check_layouts re-checks that on
//   the host before any launch), multiplies it by the row's scale with packed mul.rn.bf16x2
//   (every register holds two k of one row; a k-block lies inside one 192-group, so one scale
//   per row per k-block; the host checks which of the thread's two rows each register holds),
//   then issues 4 wgmma m64n256k16 with A from registers and B from smem descriptors as one
//   commit group.
// - kABufs = 2 or 3 A register buffers, used round robin: the ldmatrix + scale of k-block i + 1
//   runs while the wgmma groups of k-blocks i - kABufs + 2 .. i are in flight (2 buffers: group
//   i; 3 buffers: groups i - 1 and i). Invariant: at most kABufs - 1 groups are pending when a
//   buffer is written; warpgroup_wait<kABufs - 1> right after committing group i retires group
//   i - kABufs + 1, which is the last reader of the buffer about to be refilled and of stage
//   (i - kABufs + 1)'s W tile, so that is where that stage is released (every consumer thread
//   arrives on its empty barrier: count 256); after a tile's wait<0> the last kABufs - 1 stages
//   are released. The E tile is read by ldmatrix synchronously, before then. Three buffers keep
//   up to 3 stages held by the consumers, so with 4 stages the producer's TMA for k-block i + 1
//   can start only one k-block before it is needed (two with two buffers); k_blocks is a
//   multiple of 3 (K % 192 == 0), so the 3-buffer loop has no remainder. Stage and phase come
//   from one k-block counter that runs on across tiles, identical in producer and consumers
//   (stage = c % 4, full-barrier parity = (c / 4) & 1, the producer waits on the empty barrier
//   with the opposite parity).
// - Scales: read from global memory (__ldg, F is a few MB and L2-resident) into registers one
//   192-group ahead, so the L2 latency hides behind three k-blocks of wgmma. Staging through smem
//   would need another producer copy and barrier to save a 2-byte load per row every 3 k-blocks.
// - E * F is exact in bf16: F is a power of two and, with E >= 2^-12 and F >= 2^-39 here, the
//   product stays normal; mul.rn.bf16x2 then equals bf16(float(E) * float(F)), the prescaled
//   operand the references get. (A product below 2^-126 would be subnormal; not exercised.)
// - Epilogue: wgmma wait 0, release the last stage(s), float2 stores of the accumulator straight
//   to global memory (no smem). The producer already streams the next tile's stages meanwhile.
// - Cluster (kCluster = 2): thread-block clusters of two CTAs along M (the published Hopper
//   recipes' cluster 2 x 1). A cluster walks cluster tiles (two adjacent M tiles of one N tile;
//   CTA rank r takes the r-th), so both CTAs need the same W tile every k-block: each loads half
//   of it (CuTe cuts each 64-wide N box along K) with SM90_TMA_LOAD_MULTICAST into both CTAs'
//   stage, halving W's L2-to-SM traffic (a stage per CTA: 16 KB of E + 16 KB of W from L2 instead
//   of 16 + 32). Each CTA's full barrier still expects the whole stage (its E and both W halves
//   complete on it). A producer writes into both CTAs, so it may refill a stage only when both
//   CTAs' consumers released it: each consumer warp, after its wgmma wait, arrives (one lane) on
//   the empty barrier of every CTA of the cluster (count 2 x 8 warps). The CTAs sync as a cluster
//   after the barriers' init (no multicast or remote arrive before the peer's barriers exist)
//   and before exit (a peer's last remote arrives land in this CTA's shared memory), so the
//   producer warpgroup stays to the end instead of leaving early. Grid: 2 x the clusters
//   cudaOccupancyMaxActiveClusters allows, launched with cudaLaunchKernelEx. M % 256.
// - Variants: rs_loop_kernel<kScale, kABufs, kGrouped, kCluster>; <true, 2, false, 1> is the base kernel.
//   <kScale = false> compiles the scale out (E W: what the RS loop alone costs); kABufs = 3
//   keeps two wgmma groups in flight while the third buffer is loaded and scaled; kGrouped walks
//   the grouped raster with Params::group_m (timed at G = 8 and 16). A runtime flag (scale_on =
//   0) forces every scale to 1, the negative control of the check.
// - Staged (ss_loop_kernel<kGrouped>, the "staged" variants): E * F formed in shared memory by
//   the producer warpgroup's three idle warps, the product SS, so the consumers issue only the
//   wgmma and barrier instructions cuBLAS's loop does (the register-sourced loop draws a lower
//   clock from its twice as many issued instructions). F's 128 scales of a k-block ride the
//   stage (a 256-byte bulk copy; M % 8 keeps it 16-byte aligned). Exact, and slower than the
//   register-sourced loop at every shape (docs/performance.md: the in-place rewrite adds a third
//   to the shared-memory traffic a k-block already needs). The control variant passes the stages
//   on unscaled (kTouch = false): the staged loop's cost without the rewrite.
// The host refuses (before any launch, so the kernel never waits on a load that was not
// issued) M % 128, N % 256, K % 192, misaligned pointers and a grouped raster without a
// positive group height.
//
// Checked first, for every variant (outputs poisoned before each checked run): its product
// against cuBLASLt's (on the prescaled E * F, or on E for the scale-free builds; max |diff| /
// max |ref|; only float32 summation order differs) and 16 sampled outputs against float64 dot
// products; for the scaled ones also the control (scale forced to 1: must be far off). Timed:
// interleaved rounds (5 x 10 reps, medians of medians, CUDA events, 2 warm-ups) of cuBLASLt on
// E * F, CUTLASS's plain SS cooperative 128 x 256 kernel on E * F (the same-tile reference, from
// probe.cu), and every variant. The table keeps the base kernel's columns and check columns and
// adds one timing column a variant plus the worst of the other variants' checks; a second table
// lists every variant's checks.
//
// The base kernel ran once on an H200 (docs/performance.md, "The scaled grad_hidden on a main
// loop of our own"): exact, 1.04-1.12x cuBLASLt on the prescaled operand.
// Build (the include dir is the one CMake unpacks from the pinned CUTLASS wheel,
// e.g. build-sm90/_deps/cutlass-4.2.0.0/cutlass_library/source/include; add -Xptxas -v for the
// register and spill counts; no -lcuda: CUTLASS reaches cuTensorMapEncodeTiled through
// cudaGetDriverEntryPoint):
//   nvcc -std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -DNDEBUG -I<cutlass include dir> \
//     dev/scaled_gemm/rs_loop.cu -o build-probe/rs_loop -lcublasLt
// Run (GPU): build-probe/rs_loop [all|plain|cluster|profile|staged]; a table row a shape, then a
// check row a shape and variant. "plain" leaves out the cluster variants and "cluster" keeps only
// them, "staged" keeps the staged ones and grouped G=8 (each beside the base kernel), so a first run of the cluster kernels cannot cost the other results: a
// checked run that does not finish within 20 s is named and ends the process. "profile" runs
// every kernel's checked runs at the first shape and times nothing: the run to put under ncu
// (dev/scaled_gemm/ncu_summary.py).
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
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
// rs_loop: the kernel
// ------------------------------------------------------------------------------------------------
namespace rs {

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kKPerGroup = kGroup / kBK;  // k-blocks a scale group spans
static_assert(kGroup % kBK == 0, "a k-block must lie inside one scale group");
constexpr int kThreads = 384;           // producer warpgroup + 2 consumer warpgroups
constexpr int kConsumerThreads = 256;

using SmemLayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16>{},
                                           make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
// MN-major atoms are 64 (N) x 8 (K): fill K first, so a stage is 4 TMA boxes of 64 N x 64 K
using SmemLayoutB = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16>{},
                                           make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{}), Step<_2, _1, _3>{}));
using MmaAtom = SM90_64x256x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>;
static_assert(is_same_v<MmaAtom, decltype(GMMA::rs_op_selector<bf16, bf16, float, Shape<_128, _256, _64>,
                                                                GMMA::Major::K, GMMA::Major::MN>())>);
// 2 warpgroups along M: each owns 64 rows of the 128 x 256 tile
using TiledMma = decltype(make_tiled_mma(MmaAtom{}, Layout<Shape<_2, _1, _1>>{}));
using S2RCopyAtomA = Copy_Atom<SM75_U32x4_LDSM_N, bf16>;

constexpr int kBytesA = cosize_v<SmemLayoutA> * 2, kBytesB = cosize_v<SmemLayoutB> * 2;
constexpr uint32_t kTxBytes = (kBM * kBK + kBN * kBK) * 2;  // one stage's TMA bytes
static_assert(kBytesA == kStages * kBM * kBK * 2 && kBytesB == kStages * kBN * kBK * 2);
constexpr int kSmemBytes = kBytesA + kBytesB + 1024;  // + room to align the base to 1024 B

inline auto make_tma_a(const bf16* e, int M, int K) {
  auto g = make_tensor(make_gmem_ptr(e), make_layout(make_shape(M, K), make_stride(int64_t(K), Int<1>{})));
  return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutA{}(_, _, Int<0>{}));
}
inline auto make_tma_b(const bf16* w, int N, int K) {
  auto g = make_tensor(make_gmem_ptr(w), make_layout(make_shape(N, K), make_stride(Int<1>{}, int64_t(N))));
  return make_tma_copy(SM90_TMA_LOAD{}, g, SmemLayoutB{}(_, _, Int<0>{}));
}
// The cluster variants' W: each of the kClusterM CTAs of a cluster (same N tile, adjacent M tiles)
// loads 1 / kClusterM of the stage's W tile and multicasts it to all of them.
constexpr int kClusterM = 2;
inline auto make_tma_b_mc(const bf16* w, int N, int K) {
  auto g = make_tensor(make_gmem_ptr(w), make_layout(make_shape(N, K), make_stride(Int<1>{}, int64_t(N))));
  return make_tma_copy(SM90_TMA_LOAD_MULTICAST{}, g, SmemLayoutB{}(_, _, Int<0>{}), Int<kClusterM>{});
}
using TmaA = decltype(make_tma_a(nullptr, 0, 0));
using TmaB = decltype(make_tma_b(nullptr, 0, 0));
using TmaBMc = decltype(make_tma_b_mc(nullptr, 0, 0));

struct Params {
  TmaA tma_a;
  TmaB tma_b;
  TmaBMc tma_b_mc;    // read only by the cluster kernels
  const uint16_t* f;  // F's bf16 bits, F[m + M * g]
  float* d;
  int M, N, K;
  int scale_on;  // 0: every scale is 1 (the negative control)
  int group_m;   // the grouped raster's group height in M tiles (read only by kGrouped kernels)
};

/// Tile t's (M tile, N tile). Plain: m-fastest over all M tiles. Grouped: the M tiles are cut into
/// groups of `group_m` (the last one may be shorter: gm rows); group g holds tiles
/// [g * group_m * n_tiles, ...) and walks them m-fastest inside the group, so consecutive tiles
/// (the CTAs in flight) cover about gm M tiles x (grid / gm) N tiles instead of all M tiles x
/// (grid / m_tiles) N tiles. A bijection onto [0, m_tiles) x [0, n_tiles) (host-checked for every
/// shape and group height before a launch: check_raster); the producer and the consumers call it
/// with the same arguments.
template <bool kGrouped>
__host__ __device__ __forceinline__ void tile_coord(int t, int m_tiles, int n_tiles, int group_m, int& mt, int& nt) {
  if constexpr (!kGrouped) {
    mt = t % m_tiles;
    nt = t / m_tiles;
  } else {
    const int per_group = group_m * n_tiles;
    const int g = t / per_group, within = t - g * per_group;
    const int first_m = g * group_m;
    const int gm = m_tiles - first_m < group_m ? m_tiles - first_m : group_m;
    mt = first_m + within % gm;
    nt = within / gm;
  }
}

/// Both bf16 halves of a 32-bit register times the same power of two (both halves of `s`).
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

/// The scale of row `row` in group `g` in both halves of a register.
__device__ __forceinline__ uint32_t load_scale(const Params& p, int row, int g) {
  if (!p.scale_on) return 0x3f803f80u;  // 1.0, 1.0
  const uint32_t u = __ldg(p.f + row + size_t(p.M) * g);
  return u | (u << 16);
}

template <bool kScale, int kABufs = 2, bool kGrouped = false, int kCluster = 1>
__global__ void __launch_bounds__(kThreads, 1) rs_loop_kernel(const __grid_constant__ Params p) {
  static_assert(kABufs == 2 || kABufs == 3, "two or three A register buffers");
  static_assert(kCluster == 1 || kCluster == kClusterM, "no cluster, or kClusterM CTAs along M");
  using Full = cutlass::arch::ClusterTransactionBarrier;
  using Empty = cutlass::arch::ClusterBarrier;
  __shared__ uint64_t full_bar[kStages], empty_bar[kStages];
  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (cast_smem_ptr_to_uint(smem_raw) & 1023)) & 1023);  // 128B swizzle: 1 KB aligned
  bf16* smem_a = reinterpret_cast<bf16*>(smem);
  bf16* smem_b = reinterpret_cast<bf16*>(smem + kBytesA);

  const int m_tiles = p.M / kBM, n_tiles = p.N / kBN, k_blocks = p.K / kBK, groups = p.K / kGroup;
  // A cluster walks cluster tiles: kCluster adjacent M tiles (CTA rank r takes the r-th) of one N
  // tile, so the cluster's CTAs share every W stage. Without a cluster a cluster tile is a tile.
  const int rank = kCluster == 1 ? 0 : int(cute::block_rank_in_cluster());
  const int first_tile = blockIdx.x / kCluster, tile_step = gridDim.x / kCluster;
  const int c_tiles = (m_tiles / kCluster) * n_tiles;

  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Full::init(&full_bar[s], 1);  // the producer's arrive_and_expect_tx
      // Empty: without a cluster every consumer thread arrives after its wgmma wait; with one, a
      // lane of every consumer warp of every CTA of the cluster (each producer writes its W slice
      // into all of them, so it waits until all of them released the stage)
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
      // with a cluster: this CTA's slice of W, multicast to every CTA of the cluster
      auto cta_b = [&] {
        if constexpr (kCluster == 1) return p.tma_b.get_slice(0);
        else return p.tma_b_mc.get_slice(rank);
      }();
      Tensor tAsA = cta_a.partition_D(sA);  // (TMA, TMA_M, TMA_K, stage)
      Tensor tBsB = cta_b.partition_D(sB);
      uint32_t c = 0;  // k-blocks issued by this CTA, across tiles
      for (int t = first_tile; t < c_tiles; t += tile_step) {
        int mc, nt;
        tile_coord<kGrouped>(t, m_tiles / kCluster, n_tiles, p.group_m, mc, nt);
        const int mt = mc * kCluster + rank;
        Tensor tAgA = cta_a.partition_S(local_tile(mA, Shape<Int<kBM>, Int<kBK>>{}, make_coord(mt, _)));  // (TMA,TMA_M,TMA_K,k)
        Tensor tBgB = cta_b.partition_S(local_tile(mB, Shape<Int<kBN>, Int<kBK>>{}, make_coord(nt, _)));
#pragma unroll 1
        for (int kb = 0; kb < k_blocks; ++kb, ++c) {
          const int s = c % kStages;
          Empty::wait(&empty_bar[s], ((c / kStages) & 1) ^ 1);  // a fresh barrier passes parity 1
          // the whole stage lands here: this CTA's A and every CTA's W slice
          Full::arrive_and_expect_tx(&full_bar[s], kTxBytes);
          copy(p.tma_a.with(full_bar[s]), tAgA(_, _, _, kb), tAsA(_, _, _, s));
          if constexpr (kCluster == 1) {
            copy(p.tma_b.with(full_bar[s]), tBgB(_, _, _, kb), tBsB(_, _, _, s));
          } else {
            constexpr uint16_t kAllCtas = (1u << kCluster) - 1;
            copy(p.tma_b_mc.with(full_bar[s], kAllCtas), tBgB(_, _, _, kb), tBsB(_, _, _, s));
          }
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

  TiledMma mma;
  auto thr_mma = mma.get_slice(ct);
  Tensor sA = as_position_independent_swizzle_tensor(make_tensor(make_smem_ptr(smem_a), SmemLayoutA{}));
  Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});  // position-dependent: the descriptors
  Tensor tCsB = thr_mma.partition_B(sB);                          // (MMA, MMA_N = 1, MMA_K = 4, stage)
  Tensor tCrB = thr_mma.make_fragment_B(tCsB);                    // smem descriptors
  Tensor tCrA0 = thr_mma.partition_fragment_A(sA(_, _, 0));      // (MMA = 8, MMA_M = 1, MMA_K = 4) bf16
  Tensor tCrA1 = thr_mma.partition_fragment_A(sA(_, _, 0));
  Tensor accum = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});  // (MMA = 128, 1, 1) float
  static_assert(size(decltype(tCrA0){}) == 32 && size(decltype(accum){}) == 128);

  auto s2r = make_tiled_copy_A(S2RCopyAtomA{}, mma);
  auto thr_s2r = s2r.get_thread_slice(ct);
  Tensor tXsA = thr_s2r.partition_S(sA);  // (CPY, CPY_M, CPY_K, stage)
  Tensor tXrA0 = thr_s2r.retile_D(tCrA0);  // the same registers as tCrA0, in the copy's shape
  Tensor tXrA1 = thr_s2r.retile_D(tCrA1);
  CUTE_STATIC_ASSERT_V(size<1>(tXsA) == size<1>(tXrA0));
  CUTE_STATIC_ASSERT_V(size<2>(tXsA) == size<2>(tXrA0));
  CUTE_STATIC_ASSERT_V(size<2>(tCrA0) == size<2>(tCsB));

  // The thread's two rows (in the tile): fragment registers 0, 2, 4, ... hold row r0, 1, 3, 5,
  // ... row r1 (host-checked: check_layouts).
  Tensor tCcA = thr_mma.partition_A(make_identity_tensor(Shape<Int<kBM>, Int<kBK>>{}));
  const int r0 = get<0>(tCcA(0)), r1 = get<0>(tCcA(2));
  Tensor tCcC = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));

  // scale the freshly loaded fragment: 16 registers of two bf16 each
  auto apply_scale = [&](auto& frag, uint32_t s0, uint32_t s1) {
    Tensor u = recast<uint32_t>(frag);
    CUTE_UNROLL
    for (int i = 0; i < size(u); ++i) u(i) = mul_bf16x2(u(i), (i & 1) ? s1 : s0);
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
    int mc, nt;
    tile_coord<kGrouped>(t, m_tiles / kCluster, n_tiles, p.group_m, mc, nt);
    const int mt = mc * kCluster + rank;
    const int row0 = mt * kBM + r0, row1 = mt * kBM + r1;  // rows of E, F, D

    // scales of the group of the next fragment to prepare (s0, s1) and of the group after (n0, n1)
    uint32_t s0 = 0, s1 = 0, n0 = 0, n1 = 0;
    int g_ahead = 1, left = kKPerGroup;  // group of (n0, n1); k-blocks left in the current group
    if constexpr (kScale) {
      s0 = load_scale(p, row0, 0);
      s1 = load_scale(p, row1, 0);
      if (groups > 1) {
        n0 = load_scale(p, row0, 1);
        n1 = load_scale(p, row1, 1);
      }
    }
    // the fragment of the next k-block: ldmatrix, then scale (the group bookkeeping first)
    auto prepare = [&](uint32_t cc, auto& frag, auto& frag_view) {
      const int s = cc % kStages;
      Full::wait(&full_bar[s], (cc / kStages) & 1);
      copy(s2r, tXsA(_, _, _, s), frag_view);
      if constexpr (kScale) {
        if (left == 0) {  // entering the next group
          s0 = n0;
          s1 = n1;
          left = kKPerGroup;
          if (++g_ahead < groups) {
            n0 = load_scale(p, row0, g_ahead);
            n1 = load_scale(p, row1, g_ahead);
          }
        }
        --left;
        apply_scale(frag, s0, s1);
      }
      warpgroup_fence_operand(frag);
    };
    // one k-block: issue its wgmma group, retire the one kABufs - 1 before it, prepare the next
    // fragment
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
      // group kb - (kABufs - 1) done: it read `nxt` and stage (c + kb - (kABufs - 1))'s W tile
      warpgroup_wait<kABufs - 1>();
      warpgroup_fence_operand(accum);
      if (kb >= kABufs - 1) release((c + kb - (kABufs - 1)) % kStages);
      if (kb + 1 < k_blocks) prepare(c + kb + 1, nxt, nxt_view);
    };

    mma.accumulate_ = GMMA::ScaleOut::Zero;
    prepare(c, tCrA0, tXrA0);
    if constexpr (kABufs == 2) {
#pragma unroll 1
      for (int kb = 0; kb < k_blocks; kb += 2) {
        step(kb, tCrA0, tCrA1, tXrA1);
        if (kb + 1 < k_blocks) step(kb + 1, tCrA1, tCrA0, tXrA0);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      release((c + k_blocks - 1) % kStages);
    } else {
      // k_blocks is a multiple of kKPerGroup = 3 (the host refuses K % 192): no remainder
      static_assert(kKPerGroup % 3 == 0);
      Tensor tCrA2 = thr_mma.partition_fragment_A(sA(_, _, 0));
      Tensor tXrA2 = thr_s2r.retile_D(tCrA2);
#pragma unroll 1
      for (int kb = 0; kb < k_blocks; kb += 3) {
        step(kb, tCrA0, tCrA1, tXrA1);
        step(kb + 1, tCrA1, tCrA2, tXrA2);
        step(kb + 2, tCrA2, tCrA0, tXrA0);
      }
      warpgroup_wait<0>();
      warpgroup_fence_operand(accum);
      release((c + k_blocks - 2) % kStages);  // the last two k-blocks' stages
      release((c + k_blocks - 1) % kStages);
    }
    c += k_blocks;

    // epilogue: registers -> D, float2 a pair of adjacent columns (host-checked)
    float* dt = p.d + size_t(mt) * kBM * p.N + size_t(nt) * kBN;
    store_tile(accum, tCcC, dt, p.N);
  }
  // the peers' consumers may still arrive on this CTA's empty barriers: stay until all are done
  if constexpr (kCluster > 1) cute::cluster_sync();
}

// ------------------------------------------------------------------------------------------------
// The staged form: E * F formed in shared memory, the product SS (as CUTLASS's plain kernel)
// ------------------------------------------------------------------------------------------------

// Warps 1-3 of the producer warpgroup (warp 0 issues the loads) rewrite each landed E stage in
// place with one mul.rn.bf16x2 a register (exact: F is a power of two), fence the generic-proxy
// writes for the async proxy and arrive on the stage's `scaled` barrier, which the consumers
// wait on; the consumers' loop is then a plain SS loop (no ldmatrix, no multiply, no register
// operand). In the K-major 128B-swizzled stage each 128-byte row is the 64 k of one row m (the
// swizzle permutes the 16-byte chunks within a row; check_stage_rows re-derives it), and a
// k-block lies inside one 192-group, so a 16-byte chunk's 8 elements share the scale of row
// i / 8. The producer stages the tile's 128 scales of the k-block's group (256 bytes, F is
// m-contiguous within a group) with the stage.
constexpr int kTransformThreads = 96;
constexpr int kChunks = kBM * kBK * 2 / 16;
static_assert(kBK == 64, "a 128-byte row is one row's k-block");
using MmaAtomSS = SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>;
using TiledMmaSS = decltype(make_tiled_mma(MmaAtomSS{}, Layout<Shape<_2, _1, _1>>{}));
constexpr int kBytesF = kStages * kBM * 2;
constexpr int kSmemBytesSS = kBytesA + kBytesB + kBytesF + 1024;
static_assert(kSmemBytesSS <= 227 * 1024);
constexpr uint32_t kTxBytesSS = kTxBytes + kBM * 2;

__device__ __forceinline__ uint4 ld_shared_v4(uint32_t addr) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t addr, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// kTouch = false: the transform warps only pass each stage on (wait, fence, arrive), leaving E
// unscaled: the staged loop's own cost (the extra barrier hop, the SS loop) without the rewrite.
template <bool kGrouped, bool kTouch = true>
__global__ void __launch_bounds__(kThreads, 1) ss_loop_kernel(const __grid_constant__ Params p) {
  using Full = cutlass::arch::ClusterTransactionBarrier;
  using Bar = cutlass::arch::ClusterBarrier;
  __shared__ uint64_t full_bar[kStages], scaled_bar[kStages], empty_bar[kStages];
  extern __shared__ char smem_raw[];
  char* smem = smem_raw + ((1024 - (cast_smem_ptr_to_uint(smem_raw) & 1023)) & 1023);
  bf16* smem_a = reinterpret_cast<bf16*>(smem);
  bf16* smem_b = reinterpret_cast<bf16*>(smem + kBytesA);
  uint16_t* smem_f = reinterpret_cast<uint16_t*>(smem + kBytesA + kBytesB);  // [stage][128 rows]

  const int m_tiles = p.M / kBM, n_tiles = p.N / kBN, k_blocks = p.K / kBK;
  const int tiles = m_tiles * n_tiles;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      Full::init(&full_bar[s], 1);
      Bar::init(&scaled_bar[s], kTransformThreads);
      Bar::init(&empty_bar[s], kConsumerThreads);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();

  const int wg = threadIdx.x / 128;
  if (wg == 0) {
    cutlass::arch::warpgroup_reg_dealloc<56>();
    if (threadIdx.x == 0) {
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
        int mt, nt;
        tile_coord<kGrouped>(t, m_tiles, n_tiles, p.group_m, mt, nt);
        Tensor tAgA = cta_a.partition_S(local_tile(mA, Shape<Int<kBM>, Int<kBK>>{}, make_coord(mt, _)));
        Tensor tBgB = cta_b.partition_S(local_tile(mB, Shape<Int<kBN>, Int<kBK>>{}, make_coord(nt, _)));
#pragma unroll 1
        for (int kb = 0; kb < k_blocks; ++kb, ++c) {
          const int s = c % kStages;
          Bar::wait(&empty_bar[s], ((c / kStages) & 1) ^ 1);
          Full::arrive_and_expect_tx(&full_bar[s], kTxBytesSS);
          copy(p.tma_a.with(full_bar[s]), tAgA(_, _, _, kb), tAsA(_, _, _, s));
          copy(p.tma_b.with(full_bar[s]), tBgB(_, _, _, kb), tBsB(_, _, _, s));
          const uint16_t* fg = p.f + size_t(p.M) * ((kb * kBK) / kGroup) + size_t(mt) * kBM;
          SM90_BULK_COPY_G2S::copy(fg, &full_bar[s], smem_f + s * kBM, kBM * 2);
        }
      }
    } else if (threadIdx.x >= 32) {
      const int tt = threadIdx.x - 32;
      const uint32_t a_base = cast_smem_ptr_to_uint(smem_a);
      const int stages_total = ((tiles - int(blockIdx.x) + int(gridDim.x) - 1) / int(gridDim.x)) * k_blocks;
      constexpr int kIters = (kChunks + kTransformThreads - 1) / kTransformThreads;
#pragma unroll 1
      for (int c = 0; c < stages_total; ++c) {
        const int s = c % kStages;
        Full::wait(&full_bar[s], (c / kStages) & 1);
        const uint32_t stage = a_base + s * (kBM * kBK * 2);
        const uint16_t* fs = smem_f + s * kBM;
        CUTE_UNROLL
        for (int i0 = 0; i0 < (kTouch ? kIters : 0); i0 += 4) {
          uint4 v[4];
          uint32_t sc[4];
          CUTE_UNROLL
          for (int u = 0; u < 4; ++u) {
            const int i = tt + kTransformThreads * (i0 + u);
            if (i0 + u < kIters && i < kChunks) {
              v[u] = ld_shared_v4(stage + 16 * i);
              const uint32_t f = p.scale_on ? fs[i / 8] : 0x3f80u;
              sc[u] = f | (f << 16);
            }
          }
          CUTE_UNROLL
          for (int u = 0; u < 4; ++u) {
            const int i = tt + kTransformThreads * (i0 + u);
            if (i0 + u < kIters && i < kChunks)
              st_shared_v4(stage + 16 * i, make_uint4(mul_bf16x2(v[u].x, sc[u]), mul_bf16x2(v[u].y, sc[u]),
                                                      mul_bf16x2(v[u].z, sc[u]), mul_bf16x2(v[u].w, sc[u])));
          }
        }
        cutlass::arch::fence_view_async_shared();
        Bar::arrive(&scaled_bar[s]);
      }
    }
    return;
  }

  cutlass::arch::warpgroup_reg_alloc<224>();
  const int ct = threadIdx.x - 128;
  TiledMmaSS mma;
  auto thr_mma = mma.get_slice(ct);
  Tensor sA = make_tensor(make_smem_ptr(smem_a), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(smem_b), SmemLayoutB{});
  Tensor tCrA = thr_mma.make_fragment_A(thr_mma.partition_A(sA));
  Tensor tCrB = thr_mma.make_fragment_B(thr_mma.partition_B(sB));
  Tensor accum = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
  Tensor tCcC = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));
  uint32_t c = 0;
  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    int mt, nt;
    tile_coord<kGrouped>(t, m_tiles, n_tiles, p.group_m, mt, nt);
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
      warpgroup_wait<1>();
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
/// byte offsets) element (m, k) lies in 128-byte row m; the SS consumers' accumulator pairs are
/// adjacent columns of one row.
bool check_stage_rows() {
  const SmemLayoutA tma_layout{};
  for (int m = 0; m < kBM; ++m)
    for (int k = 0; k < kBK; ++k) {
      const int byte = int(tma_layout.layout_a()(2 * int(tma_layout.layout_b()(m, k, 0))));
      if (byte / 128 != m || byte < 0 || byte >= kBM * kBK * 2) return false;
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

/// Host check of the layout facts the kernel relies on beyond CuTe's own construction: the
/// fragment storage is compact, 32-bit fragment register i (two adjacent k) holds row r0 (i
/// even) or r1 (i odd), ldmatrix delivers every register where the MMA expects it and reads
/// each tile element once, and accumulator pairs are adjacent columns of one row.
bool check_layouts() {
  TiledMma mma;
  auto cA = make_identity_tensor(Shape<Int<kBM>, Int<kBK>>{});
  auto cC = make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{});
  auto s2r = make_tiled_copy_A(S2RCopyAtomA{}, mma);
  std::vector<int> src_hits(kBM * kBK, 0);
  for (int t = 0; t < kConsumerThreads; ++t) {
    auto thr = mma.get_slice(t);
    auto frag = thr.partition_fragment_A(make_tensor(make_smem_ptr((bf16*)nullptr), SmemLayoutA{})(_, _, 0));
    auto acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
    for (int i = 0; i < size(frag); ++i)
      if (frag.layout()(i) != i) return false;
    for (int i = 0; i < size(acc); ++i)
      if (acc.layout()(i) != i) return false;
    auto tCcA = thr.partition_A(cA);
    if (size(tCcA) != size(frag)) return false;
    const int r0 = get<0>(tCcA(0)), r1 = get<0>(tCcA(2));
    if (r0 / 64 != t / 128 || r1 / 64 != t / 128 || r0 == r1) return false;
    for (int i = 0; i < size(tCcA); ++i) {
      if (get<0>(tCcA(i)) != (((i / 2) & 1) ? r1 : r0)) return false;
      if (i % 2 == 1 && get<1>(tCcA(i)) != get<1>(tCcA(i - 1)) + 1) return false;
    }
    // ldmatrix moves data between threads; what must agree is where the copy delivers each
    // destination register (its partition_D) and where the MMA expects it (retile_D of the
    // MMA's partition), and the sources must cover the tile once.
    auto thr_s2r = s2r.get_thread_slice(t);
    auto dst_copy = thr_s2r.partition_D(cA);
    auto dst_mma = thr_s2r.retile_D(tCcA);
    auto src = thr_s2r.partition_S(cA);
    if (size(dst_copy) != size(dst_mma) || size(src) != size(dst_mma)) return false;
    for (int i = 0; i < size(dst_mma); ++i) {
      if (get<0>(dst_copy(i)) != get<0>(dst_mma(i)) || get<1>(dst_copy(i)) != get<1>(dst_mma(i))) return false;
      ++src_hits[get<0>(src(i)) * kBK + get<1>(src(i))];
    }
    auto tCcC = thr.partition_C(cC);
    for (int i = 0; i < size(tCcC); i += 2)
      if (get<0>(tCcC(i + 1)) != get<0>(tCcC(i)) || get<1>(tCcC(i + 1)) != get<1>(tCcC(i)) + 1 ||
          get<1>(tCcC(i)) % 2 != 0 || get<0>(tCcC(i)) / 64 != t / 128)
        return false;
  }
  return std::all_of(src_hits.begin(), src_hits.end(), [](int h) { return h == 1; });
}

/// Host check of the tile raster: every tile index in [0, tiles) maps to an (M tile, N tile) in
/// range, and each of the m_tiles x n_tiles tiles is hit exactly once.
template <bool kGrouped>
bool check_raster(int m_tiles, int n_tiles, int group_m) {
  if (m_tiles <= 0 || n_tiles <= 0 || (kGrouped && group_m <= 0)) return false;
  std::vector<int> hits(size_t(m_tiles) * n_tiles, 0);
  for (int t = 0; t < m_tiles * n_tiles; ++t) {
    int mt = -1, nt = -1;
    tile_coord<kGrouped>(t, m_tiles, n_tiles, group_m, mt, nt);
    if (mt < 0 || mt >= m_tiles || nt < 0 || nt >= n_tiles) return false;
    ++hits[size_t(nt) * m_tiles + mt];
  }
  return std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; });
}

/// The launcher: refuses (returns false, nothing launched) what the kernel does not handle,
/// including a raster that is not a bijection for this shape.
template <bool kScale, int kABufs = 2, bool kGrouped = false, int kCluster = 1, bool kStaged = false>
struct RsLoop {
  static_assert(!kStaged || kCluster == 1, "the staged form has no cluster variant");
  Params p{};
  int grid = 0;
  static constexpr auto kernel = [] {
    if constexpr (kStaged) return ss_loop_kernel<kGrouped, kScale>;
    else return rs_loop_kernel<kScale, kABufs, kGrouped, kCluster>;
  }();
  static constexpr int kSmem = kStaged ? kSmemBytesSS : kSmemBytes;
  bool init(int M, int N, int K, const bf16* e, const bf16* f, const bf16* w, float* d, bool scale_on,
            int group_m = 0) {
    if (M <= 0 || N <= 0 || K <= 0 || M % (kBM * kCluster) || N % kBN || K % kGroup) return false;
    if ((reinterpret_cast<uintptr_t>(e) | reinterpret_cast<uintptr_t>(w)) % 128 ||
        reinterpret_cast<uintptr_t>(d) % 8 || reinterpret_cast<uintptr_t>(f) % (kStaged ? 16 : 2) ||
        (kStaged && M % 8))
      return false;
    if (size_t(M / kBM) * (N / kBN) > size_t(1) << 30) return false;
    if (kGrouped && (group_m <= 0 || size_t(group_m) * (N / kBN) > size_t(1) << 30)) return false;
    if (!check_raster<kGrouped>(M / kBM / kCluster, N / kBN, group_m)) return false;
    p.tma_a = make_tma_a(e, M, K);
    p.tma_b = make_tma_b(w, N, K);
    p.tma_b_mc = make_tma_b_mc(w, N, K);
    p.f = reinterpret_cast<const uint16_t*>(f);
    p.d = d;
    p.M = M;
    p.N = N;
    p.K = K;
    p.scale_on = scale_on;
    p.group_m = group_m;
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0) != cudaSuccess || sms <= 0) return false;
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess)
      return false;
    const int c_tiles = (M / kBM / kCluster) * (N / kBN);
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
      kernel<<<grid, kThreads, kSmem, s>>>(p);
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
    cfg.dynamicSmemBytes = kSmem;
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

/// Host check of the W multicast's split, in the terms CuTe builds it: a stage's W tile is
/// kBN / 64 TMA boxes (one a 64-wide N slab) and with kClusterM CTAs each box is cut along K, so
/// CTA r's copies start at (64 j, r kBK / kClusterM) for every slab j. Each CTA then writes
/// 1 / kClusterM of the stage into every CTA of the cluster, and every CTA's full barrier expects
/// the whole stage (kTxBytes). Catches a slice taken for the wrong rank or a split along N.
bool check_multicast() {
  const TmaBMc tma{};  // the split is in the type; no descriptor (no driver) needed
  constexpr int kBoxElems = 64 * kBK;
  static_assert(decltype(tma)::AtomNumVal::value == kBoxElems, "one TMA copy a 64-wide N slab");
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

}  // namespace rs

// ------------------------------------------------------------------------------------------------
// References (from probe.cu): CUTLASS's plain SS cooperative kernel and cuBLASLt
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

/// The float32 row-major D (M x N) of the kernel's epilogue, no C.
template <class GK>
typename GK::EpilogueArguments epilogue_args(int M, int N, float* d) {
  return {{1.0f, 0.0f}, nullptr, with_ld<typename GK::StrideC>(N, int64_t(M) * N), d,
          with_ld<typename GK::StrideD>(N, int64_t(M) * N)};
}

/// Checks the arguments and the workspace and initializes `gemm` for them.
template <class Gemm>
bool prepare(Gemm& gemm, const typename Gemm::Arguments& args, void* ws, size_t wsb, cudaStream_t s) {
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) return false;
  if (Gemm::get_workspace_size(args) > wsb) return false;
  return gemm.initialize(args, ws, s) == cutlass::Status::kSuccess;
}

// CUTLASS's plain product of the same tile and schedule (A K-major, B MN-major, both in shared
// memory), on the prescaled operand.
struct Plain {
  using Main = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, bf16, RM, 8, bf16, RM, 8, float, TileMNK, ClusterMNK,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epi::SharedStorage))>,
      KSched>::CollectiveOp;
  using GK = cg::kernel::GemmUniversal<Shape<int, int, int, int>, Main, Epi>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<GK>;
  Gemm gemm;
  bool init(int M, int N, int K, const bf16* a, const bf16* w, float* d, void* ws, size_t wsb, cudaStream_t s) {
    typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                  {M, N, K, 1},
                                  {a, with_ld<typename GK::StrideA>(K, int64_t(M) * K), w,
                                   with_ld<typename GK::StrideB>(N, int64_t(K) * N)},
                                  epilogue_args<GK>(M, N, d),
                                  hw_info()};
    return prepare(gemm, args, ws, wsb, s);
  }
  bool run(cudaStream_t s) { return gemm.run(s) == cutlass::Status::kSuccess; }
};

/// cuBLASLt's first heuristic candidate for D (M x N, float32, row-major) = A (M x K, row-major)
/// . B (K x N, row-major), bf16 in, float32 compute: the library's grad_hidden product.
struct Lt {
  cublasLtHandle_t h;
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t la, lb, ld;
  cublasLtMatmulHeuristicResult_t algo{};
  bool ok = false;
  Lt(cublasLtHandle_t handle, int M, int N, int K, size_t wsb) : h(handle) {
    cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    // column-major view: D^T (N x M) = B^T (N x K) . A^T (K x M), both op N
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, N, K, N);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, K, M, K);
    cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, N, M, N);
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof(wsb));
    int found = 0;
    cublasLtMatmulAlgoGetHeuristic(h, op, lb, la, ld, ld, pref, 1, &algo, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    ok = found > 0;
  }
  bool run(const bf16* a, const bf16* b, float* d, void* ws, size_t wsb, cudaStream_t s) {
    const float alpha = 1, beta = 0;
    return cublasLtMatmul(h, op, &alpha, b, lb, a, la, &beta, d, ld, d, ld, &algo.algo, ws, wsb, s) ==
           CUBLAS_STATUS_SUCCESS;
  }
};

// ------------------------------------------------------------------------------------------------
// Data, checks, timing (as in probe.cu)
// ------------------------------------------------------------------------------------------------

__device__ uint32_t mix(size_t i, uint32_t seed) {
  uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
  x ^= x >> 13;
  x *= 0x5bd1e995u;
  x ^= x >> 15;
  return x;
}

// E: what the epilogue stores, 2^(z log2 e - k) in (2^-12, 1]; F: 2^-j, j in [0, 40); W: small
// random. E * F >= 2^-51 stays a normal bf16.
__global__ void fill(bf16* e, bf16* f, bf16* w, int M, int K, int N, int groups) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  const size_t t = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
  for (size_t i = t; i < size_t(M) * groups; i += stride) f[i] = bf16(exp2f(-float(mix(i, 7u) % 40u)));
  for (size_t i = t; i < size_t(K) * N; i += stride) w[i] = bf16(((mix(i, 3u) & 0xffff) / 32768.0f - 1.0f) * 0.02f);
  for (size_t i = t; i < size_t(M) * K; i += stride) e[i] = bf16(exp2f(-12.0f * (mix(i, 5u) & 0xffff) / 65536.0f));
}

/// The prescaled operand E * F (exact in bf16: F is a power of two).
__global__ void prescale(const bf16* e, const bf16* f, bf16* pre, int M, int K) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < size_t(M) * K; i += stride) {
    const size_t m = i / K, g = (i % K) / kGroup;
    pre[i] = bf16(float(e[i]) * float(f[m + size_t(M) * g]));
  }
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
/// transaction-count mistake in a variant that has not run before) is named, and the process ends
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

// ------------------------------------------------------------------------------------------------
// The variants behind one interface, so that main() checks and times each alike
// ------------------------------------------------------------------------------------------------

struct AnyRs {
  virtual ~AnyRs() = default;
  virtual bool init(int M, int N, int K, const bf16* e, const bf16* f, const bf16* w, float* d, bool scale_on) = 0;
  virtual bool run(cudaStream_t s) = 0;
};

template <bool kScale, int kABufs, bool kGrouped, int kCluster, bool kStaged = false>
struct RsVariant : AnyRs {
  rs::RsLoop<kScale, kABufs, kGrouped, kCluster, kStaged> k;
  int group_m;
  explicit RsVariant(int g) : group_m(g) {}
  bool init(int M, int N, int K, const bf16* e, const bf16* f, const bf16* w, float* d, bool scale_on) override {
    return k.init(M, N, K, e, f, w, d, scale_on, group_m);
  }
  bool run(cudaStream_t s) override { return k.run(s); }
};

struct Variant {
  const char* name;  // its column
  bool scaled;       // (E * F) W; false: E W (scale compiled out), checked against cuBLASLt on E
  bool grouped;
  int group_m;         // the grouped raster's group height (cluster tiles); 0: plain m-fastest
  int cluster;         // CTAs a cluster along M (1: no cluster); the raster walks cluster tiles
  const void* kernel;  // for cudaFuncGetAttributes
  std::function<std::unique_ptr<AnyRs>()> make;
};

template <bool kScale, int kABufs, bool kGrouped, int kCluster = 1>
Variant variant(const char* name, int group_m = 0) {
  return {name,
          kScale,
          kGrouped,
          kGrouped ? group_m : 0,
          kCluster,
          reinterpret_cast<const void*>(rs::rs_loop_kernel<kScale, kABufs, kGrouped, kCluster>),
          [group_m] { return std::unique_ptr<AnyRs>(new RsVariant<kScale, kABufs, kGrouped, kCluster>(group_m)); }};
}

template <bool kGrouped, bool kTouch = true>
Variant staged_variant(const char* name, int group_m = 0) {
  return {name,
          kTouch,
          kGrouped,
          kGrouped ? group_m : 0,
          1,
          reinterpret_cast<const void*>(rs::ss_loop_kernel<kGrouped, kTouch>),
          [group_m] { return std::unique_ptr<AnyRs>(new RsVariant<kTouch, 2, kGrouped, 1, true>(group_m)); }};
}

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "all";
  if (which != "all" && which != "plain" && which != "cluster" && which != "profile" && which != "staged") {
    printf("usage: rs_loop [all|plain|cluster|profile|staged]: every variant, those without a cluster, the cluster "
           "ones, or the grouped and staged ones (each with the base kernel's two columns); profile: every variant's "
           "checked runs at the first shape and no timing (for ncu: each kernel launched a few times, not hundreds)\n");
    return 2;
  }
  const bool profile = which == "profile";
  if (!rs::check_layouts()) {
    printf("rs_loop: a fragment layout is not what the kernel assumes; nothing launched\n");
    return 1;
  }
  if (!rs::check_stage_rows()) {
    printf("rs_loop: a stage's 128-byte rows are not one row's k-block; nothing launched\n");
    return 1;
  }
  if (!rs::check_multicast()) {
    printf("rs_loop: the W multicast's slices do not cover a stage once; nothing launched\n");
    return 1;
  }
  // [0] and [1] are the original kernel and its scale-free build (the first columns); the rest are
  // the variants: 3 A register buffers, the grouped raster (G = 8 and 16 M tiles), both
  std::vector<Variant> vars = {
      variant<true, 2, false>("rs_loop"),
      variant<false, 2, false>("rs_loop, scale compiled out, on E"),
      variant<true, 3, false>("3 A buffers"),
      variant<true, 2, true>("grouped G=8", 8),
      variant<true, 3, true>("3 A buffers + grouped G=8", 8),
      variant<true, 2, true>("grouped G=16", 16),
      variant<true, 3, true>("3 A buffers + grouped G=16", 16),
      variant<false, 3, false>("3 A buffers, scale compiled out"),
      variant<false, 2, true>("grouped G=8, scale compiled out", 8),
      variant<false, 3, true>("3 A buffers + grouped G=8, scale compiled out", 8),
      variant<true, 2, false, rs::kClusterM>("cluster 2x1, W multicast"),
      variant<true, 3, false, rs::kClusterM>("cluster 2x1 + 3 A buffers"),
      variant<true, 2, true, rs::kClusterM>("cluster 2x1 + grouped G=4 (8 M tiles)", 4),
      variant<false, 2, false, rs::kClusterM>("cluster 2x1, scale compiled out"),
      staged_variant<false>("staged (E F in smem, SS)"),
      staged_variant<true>("staged + grouped G=8", 8),
      staged_variant<false, false>("staged, stages passed on unscaled, on E"),
  };
  // the base kernel's two columns stay in every selection
  auto is_staged = [](const Variant& v) { return std::string(v.name).rfind("staged", 0) == 0; };
  vars.erase(std::remove_if(vars.begin() + 2, vars.end(),
                            [&](const Variant& v) {
                              if (which == "staged") return !is_staged(v) && v.name != std::string("grouped G=8");
                              return which == (v.cluster > 1 ? "plain" : "cluster");
                            }),
             vars.end());
  for (const auto& v : vars) {
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, v.kernel));
    printf("%s: %d registers at launch (consumers raise theirs to 232), %zu B local memory\n", v.name, fa.numRegs,
           fa.localSizeBytes);
  }

  struct Shape3 {
    int M, N, K;  // rows (tokens), hidden, vocabulary
  };
  std::vector<Shape3> shapes = {{4096, 4096, 128256}, {8192, 4096, 128256}, {2048, 4096, 128256}};
  if (profile) shapes.resize(1);
  // every raster of every shape must be a bijection before anything is launched (init re-checks)
  bool raster_ok = true;
  for (auto c : shapes) {
    printf("tile raster %dx%dx%d (%d x %d tiles):", c.M, c.N, c.K, c.M / rs::kBM, c.N / rs::kBN);
    for (size_t i = 0; i < vars.size(); ++i) {
      bool seen = false;  // each distinct raster once
      for (size_t j = 0; j < i; ++j)
        seen |= vars[j].grouped == vars[i].grouped && vars[j].group_m == vars[i].group_m &&
                vars[j].cluster == vars[i].cluster;
      if (seen) continue;
      const int mt = c.M / rs::kBM / vars[i].cluster, nt = c.N / rs::kBN;  // cluster tiles
      const bool ok = (c.M / rs::kBM) % vars[i].cluster == 0 &&
                      (vars[i].grouped ? rs::check_raster<true>(mt, nt, vars[i].group_m)
                                       : rs::check_raster<false>(mt, nt, 0));
      raster_ok &= ok;
      const char* in = vars[i].cluster > 1 ? " over cluster tiles" : "";
      if (vars[i].grouped)
        printf(" grouped G=%d%s %s;", vars[i].group_m, in, ok ? "bijective" : "NOT BIJECTIVE");
      else
        printf(" m-fastest%s %s;", in, ok ? "bijective" : "NOT BIJECTIVE");
    }
    printf("\n");
  }
  printf("\n");
  if (!raster_ok) {
    printf("rs_loop: a tile raster is not a bijection; nothing launched\n");
    return 1;
  }

  size_t e_el = 0, w_el = 0, d_el = 0, f_el = 0;
  for (auto c : shapes) {
    e_el = std::max(e_el, size_t(c.M) * c.K);
    w_el = std::max(w_el, size_t(c.K) * c.N);
    d_el = std::max(d_el, size_t(c.M) * c.N);
    f_el = std::max(f_el, size_t(c.M) * ((c.K + kGroup - 1) / kGroup));
  }
  bf16 *e, *f, *w, *pre;
  float *d0, *d1, *d2, *d3, *scratch;
  CK(cudaMalloc(&e, e_el * 2));
  CK(cudaMalloc(&pre, e_el * 2));
  CK(cudaMalloc(&w, w_el * 2));
  CK(cudaMalloc(&f, f_el * 2));
  CK(cudaMalloc(&d0, d_el * 4));
  CK(cudaMalloc(&d1, d_el * 4));
  CK(cudaMalloc(&d2, d_el * 4));
  CK(cudaMalloc(&d3, d_el * 4));
  CK(cudaMalloc(&scratch, 8));
  const size_t wsb = size_t(64) << 20;
  void *ws, *ws_plain;
  CK(cudaMalloc(&ws, wsb));
  CK(cudaMalloc(&ws_plain, wsb));
  cudaStream_t s;
  CK(cudaStreamCreate(&s));
  cublasLtHandle_t h;
  cublasLtCreate(&h);
  printf("| rows x H x V | cuBLASLt on E*F (ms) | CUTLASS plain on E*F (ms, x cuBLASLt) | rs_loop (ms, x cuBLASLt) "
         "| rs_loop, scale compiled out, on E (ms, x cuBLASLt) |");
  for (size_t i = 2; i < vars.size(); ++i) printf(" %s (ms, x cuBLASLt) |", vars[i].name);
  printf(" rs_loop vs cuBLASLt max rel diff | vs float64 (16 outputs) | control: scales forced to 1, vs cuBLASLt "
         "| scale-free variant vs cuBLASLt on E | other variants: worst max rel diff vs cuBLASLt, worst vs float64, "
         "smallest control |\n|");
  for (size_t i = 0; i < 5 + (vars.size() - 2) + 5; ++i) printf("---|");
  printf("\n");
  fflush(stdout);
  std::vector<std::string> check_rows;  // the per-variant checks, printed after the timing table
  for (auto c : shapes) {
    const int groups = c.K / kGroup;
    fill<<<2048, 256>>>(e, f, w, c.M, c.K, c.N, groups);
    prescale<<<2048, 256>>>(e, f, pre, c.M, c.K);
    CK(cudaDeviceSynchronize());
    Lt lt(h, c.M, c.N, c.K, wsb);
    std::vector<std::unique_ptr<AnyRs>> k(vars.size());
    for (size_t i = 0; i < vars.size(); ++i) k[i] = vars[i].make();
    Plain plain;
    // the references: cuBLASLt on E * F (d0) and on E (d3)
    const bool lt_ok = lt.ok && lt.run(pre, w, d0, ws, wsb, s) && lt.run(e, w, d3, ws, wsb, s);
    // outputs are poisoned (0x7f7f7f7f = 3.4e38) before each checked run, so a variant that leaves
    // (part of) D unwritten cannot pass on an earlier variant's result
    const size_t n_out = size_t(c.M) * c.N;
    CK(cudaMemsetAsync(d1, 0x7f, n_out * 4, s));
    const bool sc_ok = k[0]->init(c.M, c.N, c.K, e, f, w, d1, true) && k[0]->run(s);
    sync_or_die(s, vars[0].name);
    if (!lt_ok || !sc_ok) {
      printf("| %dx%dx%d | %s | | %s |", c.M, c.N, c.K, lt_ok ? "ok" : "cuBLASLt failed",
             sc_ok ? "ok" : "rs_loop refused the arguments");
      for (size_t i = 0; i < 1 + (vars.size() - 2) + 5; ++i) printf(" |");
      printf("\n");
      continue;
    }
    // float64 dot products at 16 sampled outputs of (E * F) W and of E W, relative to the
    // largest |reference| among them
    int sm[16], sn[16];
    double ref_pre[16], ref_e[16], big_pre = 0, big_e = 0;
    {
      std::vector<bf16> hpre(c.K), he(c.K), hcol(c.K);
      for (int q = 0; q < 16; ++q) {
        sm[q] = (q * 2654435761u) % c.M;
        sn[q] = (q * 40503u + 11) % c.N;
        CK(cudaMemcpy(hpre.data(), pre + size_t(sm[q]) * c.K, size_t(c.K) * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(he.data(), e + size_t(sm[q]) * c.K, size_t(c.K) * 2, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy2D(hcol.data(), 2, w + sn[q], size_t(c.N) * 2, 2, c.K, cudaMemcpyDeviceToHost));
        double rp = 0, re = 0;
        for (int kk = 0; kk < c.K; ++kk) {
          rp += double(float(hpre[kk])) * double(float(hcol[kk]));
          re += double(float(he[kk])) * double(float(hcol[kk]));
        }
        ref_pre[q] = rp;
        ref_e[q] = re;
        big_pre = std::max(big_pre, std::abs(rp));
        big_e = std::max(big_e, std::abs(re));
      }
    }
    auto f64_err = [&](const float* d, bool scaled) {
      double worst = 0;
      for (int q = 0; q < 16; ++q) {
        float got = 0;
        CK(cudaMemcpy(&got, d + size_t(sm[q]) * c.N + sn[q], 4, cudaMemcpyDeviceToHost));
        const double err = std::abs(double(got) - (scaled ? ref_pre[q] : ref_e[q]));
        worst = err == err ? std::max(worst, err) : INFINITY;  // a NaN output fails
      }
      return worst / std::max(scaled ? big_pre : big_e, 1e-300);
    };
    // every variant: its output against cuBLASLt's and the float64 samples; the scaled ones also
    // through the negative control (scales forced to 1: must be far off)
    std::vector<char> ok(vars.size(), 0);
    std::vector<float> diff(vars.size(), -1), ctl(vars.size(), -1);
    std::vector<double> f64(vars.size(), -1);
    for (size_t i = 0; i < vars.size(); ++i) {
      if (i > 0) CK(cudaMemsetAsync(d1, 0x7f, n_out * 4, s));
      ok[i] = i == 0 || (k[i]->init(c.M, c.N, c.K, e, f, w, d1, true) && k[i]->run(s));
      char row[256];
      if (!ok[i]) {
        snprintf(row, sizeof row, "| %dx%dx%d | %s | refused | | |", c.M, c.N, c.K, vars[i].name);
        check_rows.push_back(row);
        continue;
      }
      sync_or_die(s, vars[i].name);
      diff[i] = rel_diff(d1, vars[i].scaled ? d0 : d3, n_out, scratch);
      f64[i] = f64_err(d1, vars[i].scaled);
      if (vars[i].scaled) {
        auto control = vars[i].make();
        CK(cudaMemsetAsync(d2, 0x7f, n_out * 4, s));
        if (control->init(c.M, c.N, c.K, e, f, w, d2, false) && control->run(s)) {
          sync_or_die(s, vars[i].name);
          ctl[i] = rel_diff(d2, d0, n_out, scratch);
        }
      }
      CK(cudaGetLastError());
      char ctl_s[32] = "n/a (scale compiled out)";
      if (vars[i].scaled) snprintf(ctl_s, sizeof ctl_s, "%.1e", ctl[i]);
      snprintf(row, sizeof row, "| %dx%dx%d | %s | %.1e | %.1e | %s |", c.M, c.N, c.K, vars[i].name, diff[i], f64[i],
               ctl_s);
      check_rows.push_back(row);
    }

    if (profile) {  // the references' and the variants' checked runs are what ncu profiles
      Plain plain_once;
      if (plain_once.init(c.M, c.N, c.K, pre, w, d2, ws_plain, wsb, s) && plain_once.run(s)) sync_or_die(s, "CUTLASS plain");
      continue;
    }
    // timing: interleaved rounds over cuBLASLt, CUTLASS's plain kernel and every variant
    std::vector<float> r0, r1;
    std::vector<std::vector<float>> rv(vars.size());
    const bool plain_ok = plain.init(c.M, c.N, c.K, pre, w, d2, ws_plain, wsb, s);
    for (int round = 0; round < 5; ++round) {
      r0.push_back(time_it([&] { lt.run(pre, w, d2, ws, wsb, s); }, s));
      if (plain_ok) r1.push_back(time_it([&] { plain.run(s); }, s));
      for (size_t i = 0; i < vars.size(); ++i)
        if (ok[i]) rv[i].push_back(time_it([&] { k[i]->run(s); }, s));
    }
    CK(cudaGetLastError());
    const float m0 = median(r0);
    char plain_s[64] = "refused";
    if (plain_ok) snprintf(plain_s, sizeof plain_s, "%.3f, %.3f", median(r1), median(r1) / m0);
    printf("| %dx%dx%d | %.3f | %s |", c.M, c.N, c.K, m0, plain_s);
    for (size_t i = 0; i < vars.size(); ++i) {
      if (ok[i])
        printf(" %.3f, %.3f |", median(rv[i]), median(rv[i]) / m0);
      else
        printf(" refused |");
    }
    float worst_diff = 0, min_ctl = 1e30f;
    double worst_f64 = 0;
    for (size_t i = 2; i < vars.size(); ++i) {
      if (!ok[i]) continue;
      worst_diff = std::max(worst_diff, diff[i]);
      worst_f64 = std::max(worst_f64, f64[i]);
      if (vars[i].scaled) min_ctl = std::min(min_ctl, ctl[i]);
    }
    char ns_s[32] = "refused";
    if (ok[1]) snprintf(ns_s, sizeof ns_s, "%.1e", diff[1]);
    printf(" %.1e | %.1e | %.1e | %s | %.1e, %.1e, %.1e |\n", diff[0], f64[0], ctl[0], ns_s, worst_diff, worst_f64,
           min_ctl);
    fflush(stdout);
  }
  printf("\n| rows x H x V | variant | max rel diff vs cuBLASLt (on E*F; on E if the scale is compiled out) "
         "| vs float64 (16 outputs) | control: scales forced to 1, vs cuBLASLt |\n|---|---|---|---|---|\n");
  for (const auto& r : check_rows) printf("%s\n", r.c_str());
  return 0;
}
