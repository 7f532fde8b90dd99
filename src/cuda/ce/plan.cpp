// The cross-entropy launcher's plan (plan.h): pure functions, no device calls.
#include "cuda/ce/plan.h"

#include <algorithm>
#include <climits>

#include "cuda/ce/params.h"
#include "cuda/sizes.h"

namespace fusedce {
namespace cuda {
namespace {

// Blocks of about this many threads: several resident per SM (at <= 64 registers a thread), so
// one block's loads overlap another's reductions and barriers.
constexpr int kTargetThreads = 256;

/// A block's time is about its chunks plus a fixed cost per work item (pipeline start, the
/// row's reduction), here in chunks; the split is the one with the least time on the busiest SM.
constexpr int64_t kItemCostChunks = 1;

/// Rows halved over 2-block clusters when the rows in flight on all SMs would overflow L2: the
/// second sweep then re-reads half a row from L2 instead of memory. Rows that fit L2 lose by it
/// (the cluster's exchange costs more than the misses it saves).
bool use_halves(int sms, int64_t row_bytes, int l2_bytes, PlanChoices::Force force) {
  if (force != PlanChoices::Force::kAuto) return force == PlanChoices::Force::kOn;
  return int64_t(sms) * row_bytes > int64_t(l2_bytes);
}

/// Consumer groups (two groups of 8 warps, each folding its own rows) for rows of at most 2
/// chunks over whole rows: short rows pay per-row costs (set-up, warp and row folds) about as
/// large as their elements, which half the warps per row halve; long rows are bandwidth-bound,
/// and with the gradient two groups lose there. `forced` (1 or 2) overrides.
int stream_groups(int nchunks, int forced) {
  if (forced == 1 || forced == 2) return forced;
  return nchunks <= 2 ? 2 : 1;
}

/// The gradient sweep walks each row backwards when the rows in flight outgrow L2 (the chunks
/// loaded last, still in L2, come first); rows that fit keep the forward order.
bool grad_backwards(int sms, int64_t row_bytes, int halves, int l2_bytes) {
  return int64_t(sms) * row_bytes / halves > int64_t(l2_bytes);
}

}  // namespace

WorkspaceLayout plan_workspace(Job job, int64_t rows, const Options& o) {
  WorkspaceLayout w;
  size_t at = 0;
  w.batch = at;
  at += align_up(sizeof(BatchScalars));
  const bool forward = job == Job::kForward || job == Job::kForwardBackward;
  if (forward && o.reduction != Reduction::kNone) {
    w.row_loss = at;
    at += align_up(rows * sizeof(float));
  }
  if (forward && o.return_metrics) {
    w.row_entropy = at;
    at += align_up(rows * sizeof(float));
    w.row_correct = at;
    at += align_up(rows * sizeof(uint8_t));
  }
  if (job == Job::kForwardBackward) {  // lse for a separate gradient pass, when not asked for
    w.row_lse = at;
    at += align_up(rows * sizeof(float));
  }
  if (forward) {
    // Few rows: rows split over blocks (stream kernel). Reserved for up to kSplitRowsMax rows
    // even when `rows` is larger, so that the size asked for N rows serves every call with at
    // most N rows (a chunked caller sizes once for its largest chunk; its ragged last chunk may
    // be the one that splits).
    const size_t split_rows = static_cast<size_t>(std::min<int64_t>(rows, kSplitRowsMax));
    w.partials = at;
    at += align_up(split_rows * kMaxSplits * sizeof(RowPartial));
    // The stream kernel's own finish (finish.cuh): its counters and per-block sums.
    w.counters = at;
    at += align_up((split_rows + 1) * sizeof(unsigned long long));
    w.block_sums = at;
    at += align_up(kMaxFinishBlocks * sizeof(BatchSums));
  }
  w.total = job == Job::kRescale ? 0 : at;
  return w;
}

RowShape plan_rows(int64_t segments, bool merge, const DeviceFacts& dev) {
  RowShape r;
  r.items = segments <= 1024 ? 1 : 4;
  r.hw_cluster = merge;
  const int max_threads = max_row_threads(r.items);
  // Clusters need sm_90; 16 is the non-portable maximum Hopper allows.
  const int max_cluster = !merge ? (1 << 20) : (dev.sm90 ? 16 : 1);
  const int64_t threads_needed = (segments + r.items - 1) / r.items;
  int cluster = 1;
  while (cluster < max_cluster && threads_needed > int64_t(kTargetThreads) * cluster) cluster *= 2;
  const int64_t per_block = (threads_needed + cluster - 1) / cluster;
  if (per_block <= max_threads) {
    r.cluster = cluster;
    // Whole warps: the block reduction covers blockDim.x / warp warps.
    r.threads = static_cast<int>(std::max<int64_t>(dev.warp, (per_block + dev.warp - 1) / dev.warp * dev.warp));
    r.pieces = 1;
  } else {
    r.cluster = max_cluster;
    r.threads = max_threads;
    r.pieces = static_cast<int>((threads_needed + int64_t(max_cluster) * max_threads - 1) /
                                (int64_t(max_cluster) * max_threads));
  }
  if (r.cluster == 1) r.hw_cluster = false;
  return r;
}

StreamPlan plan_stream_split(int64_t rows, int64_t segments, int sms, bool grad, int forced_chunks) {
  StreamPlan s;
  const int nchunks = static_cast<int>((segments + kChunkSegs - 1) / kChunkSegs);
  int per = nchunks;  // chunks per split
  // With the gradient, a split row loses the fused second sweep (a separate gradient pass
  // follows): only worth it when whole rows would leave SMs idle.
  if (rows <= kSplitRowsMax && (!grad || rows < sms)) {
    int64_t best = INT64_MAX;
    for (int c = std::max(1, (nchunks + kMaxSplits - 1) / kMaxSplits); c <= nchunks; ++c) {
      const int64_t items = rows * ((nchunks + c - 1) / c);
      const int64_t waves = (items + sms - 1) / sms;
      const int64_t cost = waves * (c + kItemCostChunks);
      if (cost < best) {
        best = cost;
        per = c;
      }
    }
    if (forced_chunks > 0) per = std::max(std::min(forced_chunks, nchunks), (nchunks + kMaxSplits - 1) / kMaxSplits);
  }
  s.chunks_per_split = per;
  s.splits = (nchunks + per - 1) / per;
  s.grid = static_cast<int>(std::min<int64_t>(rows * s.splits, sms));
  return s;
}

CePlan plan_ce(const CeShape& shape, const Options& o, const DeviceFacts& dev, const PlanChoices& choices) {
  CePlan plan;
  const int64_t N = shape.rows;
  const bool forward = shape.job != Job::kBackward;
  const bool grad = shape.job != Job::kForward;
  const bool mean = o.reduction == Reduction::kMean;
  const bool weighted = o.class_weight.data != nullptr;
  plan.ws = plan_workspace(shape.job, N, o);
  // Planned for the worst row alignment, so one shape serves every row.
  const int vec = vec_of(shape.dtype);
  plan.segments = row_segments(shape.vocab, vec - 1, vec);
  // The plain kernels assume logit_scale > 0 (they take the max over raw logits).
  const bool metrics = forward && o.return_metrics;
  const bool softcap = o.softcap > 0.0f;
  plan.extras = softcap || o.label_smoothing != 0.0f || metrics || weighted || o.logit_scale < 0.0f;

  // The stream kernel (sm_90, forward jobs) and its work split, planned first: whether it
  // finishes the call itself decides which one-block passes run around it.
  plan.stream = N > 0 && dev.sm90 && forward && choices.stream != PlanChoices::Force::kOff;
  StreamPlan& sp = plan.sp;
  if (plan.stream) sp = plan_stream_split(N, plan.segments, dev.sms, grad, choices.split_chunks);
  // Its grid never has more blocks than the SMs (with or without halves).
  sp.finish = plan.stream && dev.sms <= kMaxFinishBlocks && choices.stream_finish;
  // The mean's 1 / denominator counted by every block of a stream kernel that forms the
  // gradient, for a batch small enough (no prepare pass).
  sp.count_den = sp.finish && grad && mean && sp.splits == 1 && !weighted && !o.check_targets && N <= kCountDenRowsMax;

  // The prepare pass: for class weights, the target check, and the gradient's 1 / denominator.
  // A forward's mean counts its rows in the finalize pass instead (one launch less).
  plan.prepare = (mean && grad && !sp.count_den) || weighted || o.check_targets;
  plan.count_rows = mean && !plan.prepare && !sp.count_den;

  bool finalized = false;  // the batch sums are formed by the stream kernel or the split-merge pass
  if (plan.stream) {
    sp.opts = !plan.extras ? kStreamPlain : (softcap || o.logit_scale < 0.0f) ? kStreamGeneral : kStreamOptions;
    sp.grad = grad && sp.splits == 1;
    sp.async_reduce = choices.async_reduce;
    sp.row_bytes = shape.vocab * static_cast<int64_t>(dtype_size(shape.dtype));
    sp.want_halves = grad && sp.splits == 1 && sp.chunks_per_split >= 2 &&
                     use_halves(dev.sms, sp.row_bytes, dev.l2_bytes, choices.halves);
    // Groups fold whole rows of one block: no splits, no halves.
    sp.groups = sp.splits == 1 && !sp.want_halves ? stream_groups(sp.chunks_per_split, choices.groups) : 1;
    sp.halves = 1;
    sp.grad_backwards = grad_backwards(dev.sms, sp.row_bytes, 1, dev.l2_bytes);
    sp.lse_to_workspace = sp.splits > 1 && grad && !shape.lse_out;
    // Split rows without the kernel's own finish: the split-merge pass folds the partials (and
    // forms the batch sums).
    plan.split_merge = sp.splits > 1 && !sp.finish;
    finalized = sp.finish || sp.splits > 1;
    if (grad && sp.splits > 1) {
      // Few rows, each split over blocks: the gradient in a second pass from the merged lse (the
      // rows are small enough to be re-read from L2).
      plan.row_pass = true;
      plan.row_forward = false;
      plan.row_grad = true;
      plan.row = plan_rows(plan.segments, false, dev);
    }
  } else if (N > 0) {
    plan.row_pass = true;
    plan.row_forward = forward;
    plan.row_grad = grad;
    plan.row = plan_rows(plan.segments, forward, dev);
  }
  plan.finalize = !finalized && forward && (o.reduction != Reduction::kNone || o.return_metrics);
  return plan;
}

void settle_halves(CePlan& plan, int64_t rows, int clusters, const DeviceFacts& dev) {
  StreamPlan& sp = plan.sp;
  if (!plan.stream || !sp.want_halves || clusters <= 0) return;
  sp.halves = 2;
  sp.chunks_per_split = (sp.chunks_per_split + 1) / 2;
  sp.grid = 2 * static_cast<int>(std::min<int64_t>(rows, clusters));
  sp.grad_backwards = grad_backwards(dev.sms, sp.row_bytes, 2, dev.l2_bytes);
}

RescalePlan plan_rescale(int64_t rows, int64_t cols, DType dtype, int sms) {
  RescalePlan r;
  const int64_t segments = row_segments(cols, vec_of(dtype) - 1, vec_of(dtype));
  const int64_t per_block = int64_t(kRescaleThreads) * kRescaleItems;
  r.chunks_per_row = static_cast<int>((segments + per_block - 1) / per_block);
  // Persistent blocks (kRescaleBlocksPerSm an SM) over the (row, chunk) items.
  r.grid = std::min<int64_t>(rows * r.chunks_per_row, int64_t(std::max(sms, 1)) * kRescaleBlocksPerSm);
  return r;
}

}  // namespace cuda
}  // namespace fusedce
