// The cross-entropy launcher's decisions, as pure functions of the call's sizes and options, the
// device's facts and the caller's choices: which passes run, the row kernel's shape, the stream
// kernel's work split, grid and variant, and where each piece of the workspace lives. Plain C++
// (no GPU header): tested on the CPU (tests/cpp/test_plan.cpp); launch.cu only reads the device's
// facts, calls these and launches what they return.
//
// PlanChoices steer the plan for tests and benchmarks. Every field at its default gives the
// production plan; nothing here is read from the environment: a test or benchmark that wants a
// variant passes one to cuda::run explicitly, for that call only.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common/call.h"
#include "cuda/ce/shape.h"

namespace fusedce {
namespace cuda {

struct PlanChoices {
  enum class Force : int8_t { kAuto, kOn, kOff };
  /// kOff: the row kernel for forward jobs on sm_90 too (the path of GPUs before Hopper).
  Force stream = Force::kAuto;
  /// kOn: rows halved over 2-block clusters whenever the plan allows them (forward + gradient,
  /// whole rows of at least two chunks); kOff: never.
  Force halves = Force::kAuto;
  /// 1 or 2: that many consumer groups over whole rows (the plan's choice otherwise).
  int groups = 0;
  /// false: the stream kernel's synchronous row reduction for forward jobs over whole rows (the
  /// results are the same bits; racecheck can follow its barriers, not the asynchronous handoff).
  bool async_reduce = true;
  /// false: the prepare, split-merge and finalize passes around the stream kernel instead of its
  /// own finish.
  bool stream_finish = true;
  /// > 0: chunks per split for few rows (clamped to what the workspace allows).
  int split_chunks = 0;
};

/// What the plan needs to know of the device; the launcher reads it.
struct DeviceFacts {
  int sms = 0;
  int l2_bytes = 0;
  int warp = 32;       // threads a warp (a wavefront on AMD GPUs)
  bool sm90 = false;   // this build has the Hopper kernels and the device runs them (clusters, bulk copies)
};

/// Where each piece of the workspace lives (byte offsets; size 0 = not needed).
struct WorkspaceLayout {
  size_t batch = 0, row_loss = 0, row_entropy = 0, row_correct = 0, row_lse = 0, partials = 0, counters = 0,
         block_sums = 0, total = 0;
};

/// How a row is spread over threads: `cluster` blocks of `threads`, each thread holding `items`
/// 16-byte segments per piece, `pieces` pieces per block. `hw_cluster`: whether the blocks of a
/// row form a hardware cluster (they must when they merge statistics; a backward pass needs none).
struct RowShape {
  int items = 1, threads = 0, cluster = 1, pieces = 1;
  bool hw_cluster = false;
};

/// The stream kernel's launch: persistent blocks over work items (rows, or `splits` stretches of
/// `chunks_per_split` chunks of each row when there are few rows).
struct StreamPlan {
  int splits = 1, chunks_per_split = 0, grid = 0;
  StreamOpts opts = kStreamPlain;
  bool grad = false;          // the kernel forms the gradient (whole rows); split rows get a row pass
  int groups = 1;             // consumer groups over whole rows
  bool want_halves = false;   // 2-block clusters asked for (settle_halves: if the device has room)
  int halves = 1;
  bool grad_backwards = false;
  bool async_reduce = true;
  bool finish = false;        // the kernel finishes the call (finish.cuh)
  bool count_den = false;     // ... and counts the mean's denominator itself
  bool lse_to_workspace = false;  // split rows with the gradient and no lse output: lse in row_lse
  int64_t row_bytes = 0;      // a row's logits in bytes (for settle_halves)
};

/// One call's plan: the passes in their order (prepare, then the stream kernel or the row kernel,
/// then split-merge, a row pass for the gradient of split rows, finalize), each with its shape.
struct CePlan {
  WorkspaceLayout ws;
  int64_t segments = 0;   // 16-byte segments a row spans at the worst alignment
  bool prepare = false;   // the prepare pass (class weights, the target check, the gradient's 1 / denominator)
  bool count_rows = false;  // the mean's rows counted by the finalize pass (BatchParams::count_rows)
  bool extras = false;    // the row kernel's options variant (the plain one assumes logit_scale > 0)
  bool stream = false;    // the stream kernel runs
  StreamPlan sp;
  bool split_merge = false;  // the split-merge pass after the stream kernel
  bool row_pass = false;     // a row kernel launch: the whole job, or the gradient of split rows
  bool row_forward = false, row_grad = false;
  RowShape row;
  bool finalize = false;     // the finalize pass at the end
};

/// The sizes and options a plan depends on.
struct CeShape {
  Job job;
  int64_t rows, vocab;
  DType dtype;
  bool lse_out;  // the caller asked for lse
};

WorkspaceLayout plan_workspace(Job job, int64_t rows, const Options& o);
RowShape plan_rows(int64_t segments, bool merge, const DeviceFacts& dev);
/// The stream kernel's work split: whole rows per block, or (few rows) each row cut into splits.
StreamPlan plan_stream_split(int64_t rows, int64_t segments, int sms, bool grad, int forced_chunks);
CePlan plan_ce(const CeShape& shape, const Options& o, const DeviceFacts& dev, const PlanChoices& choices);
/// The halves the device can run: `clusters` 2-block clusters of the chosen kernel fit at once
/// (0: none; the rows stay whole). Fixes the grid and the gradient sweep's direction.
void settle_halves(CePlan& plan, int64_t rows, int clusters, const DeviceFacts& dev);

/// The rescale kernel's launch: blocks per row and the persistent grid.
struct RescalePlan {
  int chunks_per_row = 0;
  int64_t grid = 0;
};
RescalePlan plan_rescale(int64_t rows, int64_t cols, DType dtype, int sms);

/// Elements in a 16-byte segment.
inline int vec_of(DType d) { return d == DType::kFloat32 ? 4 : 8; }

/// One call of the GPU backend under explicit choices (the entry points pass the defaults).
Status run(const detail::CeCall& call, const PlanChoices& choices);

}  // namespace cuda
}  // namespace fusedce
