// Which of cuBLASLt's candidate algorithms a product of the linear path runs. Plain C++ (no CUDA
// headers), so it is tested on every machine.
//
// cuBLASLt's heuristic ranks its candidates by a model, and for two of the three products of a
// token chunk its first choice is not its fastest on Hopper: measured on an H200 at the linear
// issue's chunk shapes (bf16, dev/gemm_sweep, medians of five interleaved rounds), the logits
// product ran 1.5-5% faster on the candidate with 176 x 128 tiles (custom option 2) and the
// grad_weight product 1-6% faster on 256 x 128 (custom option 7) than on the first candidate;
// grad_hidden's first candidate was the fastest or within 1% at three of the four shapes. Every
// candidate there ran without split-K and gave the first one's bits, so the choice moves time,
// not results. The preference is a fixed table, a function of the product and the architecture
// only (never of timings), so a call's result stays the same bits from run to run.
#pragma once

#include <cstdint>

namespace fusedce {
namespace cuda {

/// The product a call makes, for the preference (kAny: cuBLASLt's first candidate).
enum class GemmRole : int32_t { kAny = 0, kLogits, kGradHidden, kGradWeight };

/// cuBLASLt's tile ids (cublasLtMatmulTile_t) the preference names; gemm.cpp checks them against
/// cuBLASLt's header.
constexpr int32_t kLtTile256x128 = 24;
constexpr int32_t kLtTile176x128 = 201;

/// What the choice reads of one candidate: its configuration in cuBLASLt's ids.
struct AlgoTraits {
  int32_t tile;       // CUBLASLT_ALGO_CONFIG_TILE_ID
  int32_t custom;     // CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION
  int32_t split_k;    // CUBLASLT_ALGO_CONFIG_SPLITK_NUM (1: none)
  int32_t reduction;  // CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME (0: none)
};

/// One preferred configuration: a tile and a custom option.
struct AlgoPreference {
  int32_t tile, custom;
};

/// The index among `n` candidates (the heuristic's order) to run: on compute capability 9.0 the
/// first candidate, in the role's order of preference, with a preferred tile and custom option and
/// no split-K; else 0. The logits product's second preference serves the product with a bias
/// epilogue, whose list lacks the first (there, 256 x 128 / option 7 ran 0-2.2% faster than the
/// first candidate where it was not the first candidate itself).
inline int choose_algorithm(GemmRole role, int sm_major, int sm_minor, const AlgoTraits* candidates, int n) {
  if (sm_major != 9 || sm_minor != 0) return 0;
  static constexpr AlgoPreference kLogits[] = {{kLtTile176x128, 2}, {kLtTile256x128, 7}};
  static constexpr AlgoPreference kGradWeight[] = {{kLtTile256x128, 7}};
  const AlgoPreference* prefs = nullptr;
  int count = 0;
  switch (role) {
    case GemmRole::kLogits: prefs = kLogits, count = 2; break;
    case GemmRole::kGradWeight: prefs = kGradWeight, count = 1; break;
    default: return 0;
  }
  for (int k = 0; k < count; ++k) {
    for (int i = 0; i < n; ++i) {
      const AlgoTraits& c = candidates[i];
      if (c.tile == prefs[k].tile && c.custom == prefs[k].custom && c.split_k == 1 && c.reduction == 0) return i;
    }
  }
  return 0;
}

}  // namespace cuda
}  // namespace fusedce
