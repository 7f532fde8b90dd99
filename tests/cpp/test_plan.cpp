// The GPU launcher's planner (src/cuda/plan.h) on the CPU: which passes a call runs, the row
// kernel's shape, the stream kernel's split, variant and grid, the workspace layout, and how
// PlanChoices steer them. Pure functions: no GPU needed, so these run in every build.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "cuda/ce/plan.h"
#include "cuda/linear/algo_choice.h"
#include "cuda/linear/window_plan.h"
#include "cuda/sizes.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Job;
using fusedce::Options;
using fusedce::Reduction;
using fusedce::cuda::CePlan;
using fusedce::cuda::CeShape;
using fusedce::cuda::DeviceFacts;
using fusedce::cuda::PlanChoices;
using Force = PlanChoices::Force;

// An H200 (132 SMs, 50 MB of L2) and an A100 (no sm_90 kernels).
DeviceFacts h200() {
  DeviceFacts d;
  d.sms = 132;
  d.l2_bytes = 50 << 20;
  d.warp = 32;
  d.sm90 = true;
  return d;
}
DeviceFacts a100() {
  DeviceFacts d;
  d.sms = 108;
  d.l2_bytes = 40 << 20;
  d.warp = 32;
  d.sm90 = false;
  return d;
}

CePlan plan(Job job, int64_t N, int64_t V, DType d, const Options& o = {}, const DeviceFacts& dev = h200(),
            const PlanChoices& c = {}, bool lse_out = true) {
  return fusedce::cuda::plan_ce(CeShape{job, N, V, d, lse_out}, o, dev, c);
}

int64_t chunks_of(int64_t V, DType d) {
  const int vec = fusedce::cuda::vec_of(d);
  return (fusedce::cuda::row_segments(V, vec - 1, vec) + fusedce::cuda::kChunkSegs - 1) / fusedce::cuda::kChunkSegs;
}

TEST(Plan, WorkspacePiecesAreAlignedDisjointAndServeFewerRows) {
  Options all;
  all.return_metrics = true;
  for (Job job : {Job::kForward, Job::kBackward, Job::kForwardBackward}) {
    for (int64_t N : {int64_t(0), int64_t(1), int64_t(7), int64_t(1024), int64_t(1025), int64_t(100000)}) {
      SCOPED_TRACE("job " + std::to_string(int(job)) + " N=" + std::to_string(N));
      const auto w = fusedce::cuda::plan_workspace(job, N, all);
      std::vector<size_t> starts = {w.batch, w.row_loss, w.row_entropy, w.row_correct, w.row_lse, w.partials,
                                    w.counters, w.block_sums};
      for (size_t s : starts) EXPECT_EQ(s % fusedce::cuda::kWorkspaceAlign, 0u);
      // Pieces in order (a piece of no rows takes no bytes), none past the total.
      size_t last = 0;
      for (size_t s : starts) {
        if (s == 0) continue;
        EXPECT_GE(s, last);
        EXPECT_LE(s, w.total);
        last = s;
      }
      // The size asked for N rows serves any call with fewer.
      for (int64_t M : {int64_t(0), N / 2, N}) EXPECT_LE(fusedce::cuda::plan_workspace(job, M, all).total, w.total);
    }
  }
  EXPECT_EQ(fusedce::cuda::plan_workspace(Job::kRescale, 100, all).total, 0u);
  Options none;
  none.reduction = Reduction::kNone;
  EXPECT_EQ(fusedce::cuda::plan_workspace(Job::kForward, 100, none).row_loss, 0u);  // the output holds the rows
}

TEST(Plan, RowShapeCoversTheRowInWholeWarps) {
  for (const DeviceFacts& dev : {h200(), a100()}) {
    for (int64_t seg : {int64_t(1), int64_t(2), int64_t(33), int64_t(1024), int64_t(1025), int64_t(16032),
                        int64_t(32768), int64_t(1) << 22, int64_t(1) << 28}) {
      for (bool merge : {false, true}) {
        SCOPED_TRACE("segments " + std::to_string(seg) + (merge ? " merge" : "") + (dev.sm90 ? " sm90" : ""));
        const auto r = fusedce::cuda::plan_rows(seg, merge, dev);
        EXPECT_TRUE(r.items == 1 || r.items == 4);
        EXPECT_EQ(r.threads % dev.warp, 0);
        EXPECT_GE(r.threads, dev.warp);
        EXPECT_LE(r.threads, fusedce::cuda::max_row_threads(r.items));
        EXPECT_GE(int64_t(r.threads) * r.items * r.cluster * r.pieces, seg);
        EXPECT_EQ(r.cluster & (r.cluster - 1), 0) << "a power of two";
        // A cluster merges statistics only with sm_90, and only when asked to.
        EXPECT_EQ(r.hw_cluster, merge && r.cluster > 1);
        if (merge) {
          EXPECT_LE(r.cluster, dev.sm90 ? 16 : 1);
        }
      }
    }
  }
}

TEST(Plan, StreamSplitCoversEveryChunkOnceAndFitsTheWorkspace) {
  for (int64_t rows : {int64_t(1), int64_t(3), int64_t(64), int64_t(131), int64_t(1024), int64_t(1025), int64_t(8192)}) {
    for (int64_t chunks : {int64_t(1), int64_t(2), int64_t(7), int64_t(16), int64_t(64), int64_t(65), int64_t(500)}) {
      for (bool grad : {false, true}) {
        for (int forced : {0, 1, 3, 1 << 20}) {
          SCOPED_TRACE("rows " + std::to_string(rows) + " chunks " + std::to_string(chunks) + (grad ? " grad" : "") +
                       " forced " + std::to_string(forced));
          const int64_t seg = chunks * fusedce::cuda::kChunkSegs;
          const auto s = fusedce::cuda::plan_stream_split(rows, seg, 132, grad, forced);
          EXPECT_GE(int64_t(s.splits) * s.chunks_per_split, chunks);
          EXPECT_LT(int64_t(s.splits - 1) * s.chunks_per_split, chunks) << "no empty split";
          EXPECT_LE(s.splits, fusedce::cuda::kMaxSplits);
          EXPECT_LE(s.grid, 132);
          EXPECT_LE(s.grid, rows * s.splits);
          // Split rows only where the workspace has their partials, and (with the gradient) only
          // when whole rows would leave SMs idle.
          if (rows > fusedce::cuda::kSplitRowsMax || (grad && rows >= 132)) {
            EXPECT_EQ(s.splits, 1);
          }
          if (forced > 0 && rows <= fusedce::cuda::kSplitRowsMax && !(grad && rows >= 132)) {
            EXPECT_EQ(s.chunks_per_split, std::max<int64_t>(std::min<int64_t>(forced, chunks),
                                                            (chunks + fusedce::cuda::kMaxSplits - 1) / fusedce::cuda::kMaxSplits));
          }
        }
      }
    }
  }
  // Few long rows, forward: every SM gets work.
  const auto few = fusedce::cuda::plan_stream_split(4, 16 * fusedce::cuda::kChunkSegs * 8, 132, false, 0);
  EXPECT_GT(few.splits, 1);
  EXPECT_GT(few.grid, 100);
}

TEST(Plan, ManyRowsForwardIsOneStreamLaunchThatFinishesTheCall) {
  const CePlan p = plan(Job::kForward, 8192, 128256, DType::kBFloat16);
  EXPECT_TRUE(p.stream);
  EXPECT_EQ(p.sp.splits, 1);
  EXPECT_EQ(p.sp.chunks_per_split, chunks_of(128256, DType::kBFloat16));
  EXPECT_EQ(p.sp.grid, 132);
  EXPECT_TRUE(p.sp.finish);
  EXPECT_FALSE(p.prepare);
  EXPECT_TRUE(p.count_rows) << "the mean's rows are counted where the sums are formed";
  EXPECT_FALSE(p.split_merge);
  EXPECT_FALSE(p.row_pass);
  EXPECT_FALSE(p.finalize);
  EXPECT_FALSE(p.sp.grad);
  EXPECT_EQ(p.sp.opts, fusedce::cuda::kStreamPlain);
  EXPECT_EQ(p.sp.groups, 1) << "long rows: one group";
  EXPECT_TRUE(p.sp.async_reduce);
}

TEST(Plan, ShortRowsTakeTwoConsumerGroups) {
  ASSERT_LE(chunks_of(32000, DType::kBFloat16), 2);
  EXPECT_EQ(plan(Job::kForward, 16384, 32000, DType::kBFloat16).sp.groups, 2);
  EXPECT_EQ(plan(Job::kForwardBackward, 16384, 32000, DType::kBFloat16).sp.groups, 2);
  EXPECT_EQ(plan(Job::kForward, 16384, 50257, DType::kBFloat16).sp.groups, 1);
  PlanChoices one;
  one.groups = 1;
  EXPECT_EQ(plan(Job::kForward, 16384, 32000, DType::kBFloat16, {}, h200(), one).sp.groups, 1);
  PlanChoices two;
  two.groups = 2;
  EXPECT_EQ(plan(Job::kForward, 8192, 128256, DType::kBFloat16, {}, h200(), two).sp.groups, 2);
}

TEST(Plan, GradientMeanCountsItsDenominatorInTheKernelWithoutAPreparePass) {
  const CePlan p = plan(Job::kForwardBackward, 8192, 128256, DType::kBFloat16);
  EXPECT_TRUE(p.sp.grad);
  EXPECT_TRUE(p.sp.count_den);
  EXPECT_FALSE(p.prepare);
  EXPECT_FALSE(p.count_rows);
  // Too many rows for every block to read every target: the prepare pass counts them.
  const CePlan big = plan(Job::kForwardBackward, 40000, 32000, DType::kBFloat16);
  EXPECT_FALSE(big.sp.count_den);
  EXPECT_TRUE(big.prepare);
  // Class weights and the target check need the prepare pass.
  Options weighted;
  float w[4] = {1, 2, 3, 4};
  weighted.class_weight = fusedce::vector(w, DType::kFloat32, 4);
  const CePlan pw = plan(Job::kForwardBackward, 64, 4, DType::kFloat32, weighted);
  EXPECT_TRUE(pw.prepare);
  EXPECT_FALSE(pw.sp.count_den);
  Options check;
  check.check_targets = true;
  EXPECT_TRUE(plan(Job::kForward, 64, 1000, DType::kFloat32, check).prepare);
  // Sums need no denominator: no prepare pass, no counting.
  Options sum;
  sum.reduction = Reduction::kSum;
  const CePlan ps = plan(Job::kForwardBackward, 8192, 128256, DType::kBFloat16, sum);
  EXPECT_FALSE(ps.prepare);
  EXPECT_FALSE(ps.sp.count_den);
  EXPECT_FALSE(ps.count_rows);
}

TEST(Plan, FewRowsSplitAndTakeTheirGradientInARowPass) {
  const CePlan p = plan(Job::kForwardBackward, 16, 262144, DType::kBFloat16, {}, h200(), {}, /*lse_out=*/false);
  ASSERT_TRUE(p.stream);
  EXPECT_GT(p.sp.splits, 1);
  EXPECT_FALSE(p.sp.grad);
  EXPECT_TRUE(p.sp.lse_to_workspace) << "the row pass reads the merged lse from the workspace";
  EXPECT_TRUE(p.row_pass);
  EXPECT_FALSE(p.row_forward);
  EXPECT_TRUE(p.row_grad);
  EXPECT_FALSE(p.row.hw_cluster) << "a gradient pass merges nothing";
  EXPECT_FALSE(p.split_merge) << "the last split merges";
  EXPECT_FALSE(p.finalize);
  EXPECT_FALSE(plan(Job::kForwardBackward, 16, 262144, DType::kBFloat16).sp.lse_to_workspace);
  // Without the kernel's own finish: the split-merge pass forms the sums, no finalize after it.
  PlanChoices separate;
  separate.stream_finish = false;
  const CePlan q = plan(Job::kForward, 16, 262144, DType::kBFloat16, {}, h200(), separate);
  EXPECT_FALSE(q.sp.finish);
  EXPECT_TRUE(q.split_merge);
  EXPECT_FALSE(q.finalize);
  const CePlan r = plan(Job::kForward, 8192, 128256, DType::kBFloat16, {}, h200(), separate);
  EXPECT_FALSE(r.split_merge);
  EXPECT_TRUE(r.finalize);
}

TEST(Plan, RowsThatOverflowL2AreHalvedOverClustersWhenTheDeviceHasRoom) {
  // 132 rows of 512 KB in flight: 66 MB > 50 MB of L2.
  CePlan p = plan(Job::kForwardBackward, 4096, 262144, DType::kBFloat16);
  ASSERT_TRUE(p.sp.want_halves);
  EXPECT_EQ(p.sp.groups, 1);
  EXPECT_TRUE(p.sp.grad_backwards);
  CePlan none = p;
  fusedce::cuda::settle_halves(none, 4096, 0, h200());
  EXPECT_EQ(none.sp.halves, 1) << "no cluster fits: whole rows";
  EXPECT_EQ(none.sp.grid, p.sp.grid);
  const int64_t chunks = p.sp.chunks_per_split;
  fusedce::cuda::settle_halves(p, 4096, 66, h200());
  EXPECT_EQ(p.sp.halves, 2);
  EXPECT_EQ(p.sp.grid, 132);
  EXPECT_EQ(p.sp.chunks_per_split, (chunks + 1) / 2);
  EXPECT_FALSE(p.sp.grad_backwards) << "half rows fit the L2: forward order";
  // Rows that fit: no halves; forward jobs: never; kOn / kOff choices override.
  EXPECT_FALSE(plan(Job::kForwardBackward, 8192, 128256, DType::kBFloat16).sp.want_halves);
  EXPECT_FALSE(plan(Job::kForward, 4096, 262144, DType::kBFloat16).sp.want_halves);
  PlanChoices on, off;
  on.halves = Force::kOn;
  off.halves = Force::kOff;
  EXPECT_TRUE(plan(Job::kForwardBackward, 8192, 128256, DType::kBFloat16, {}, h200(), on).sp.want_halves);
  EXPECT_FALSE(plan(Job::kForwardBackward, 4096, 262144, DType::kBFloat16, {}, h200(), off).sp.want_halves);
  // A row of one chunk has no halves.
  EXPECT_FALSE(plan(Job::kForwardBackward, 8192, 1000, DType::kBFloat16, {}, h200(), on).sp.want_halves);
}

TEST(Plan, OptionsPickTheStreamKernelsVariant) {
  Options smooth, cap, neg, metrics;
  smooth.label_smoothing = 0.1f;
  cap.softcap = 30.0f;
  neg.logit_scale = -1.0f;
  metrics.return_metrics = true;
  EXPECT_EQ(plan(Job::kForward, 4096, 32000, DType::kBFloat16).sp.opts, fusedce::cuda::kStreamPlain);
  EXPECT_EQ(plan(Job::kForward, 4096, 32000, DType::kBFloat16, smooth).sp.opts, fusedce::cuda::kStreamOptions);
  EXPECT_EQ(plan(Job::kForward, 4096, 32000, DType::kBFloat16, metrics).sp.opts, fusedce::cuda::kStreamOptions);
  EXPECT_EQ(plan(Job::kForward, 4096, 32000, DType::kBFloat16, cap).sp.opts, fusedce::cuda::kStreamGeneral);
  EXPECT_EQ(plan(Job::kForward, 4096, 32000, DType::kBFloat16, neg).sp.opts, fusedce::cuda::kStreamGeneral);
  EXPECT_FALSE(plan(Job::kForward, 4096, 32000, DType::kBFloat16).extras);
  Options z;
  z.z_loss = 1e-4f;
  EXPECT_FALSE(plan(Job::kForward, 4096, 32000, DType::kBFloat16, z).extras) << "z-loss needs nothing per element";
  PlanChoices sync;
  sync.async_reduce = false;
  EXPECT_FALSE(plan(Job::kForward, 4096, 32000, DType::kBFloat16, {}, h200(), sync).sp.async_reduce);
}

TEST(Plan, WithoutTheStreamKernelTheRowKernelRunsTheJob) {
  PlanChoices no_stream;
  no_stream.stream = Force::kOff;
  for (const DeviceFacts& dev : {a100(), h200()}) {
    for (Job job : {Job::kForward, Job::kForwardBackward, Job::kBackward}) {
      SCOPED_TRACE("job " + std::to_string(int(job)) + (dev.sm90 ? " sm90" : ""));
      const CePlan p = plan(job, 4096, 128256, DType::kBFloat16, {}, dev, no_stream);
      EXPECT_FALSE(p.stream);
      EXPECT_TRUE(p.row_pass);
      EXPECT_EQ(p.row_forward, job != Job::kBackward);
      EXPECT_EQ(p.row_grad, job != Job::kForward);
      EXPECT_EQ(p.finalize, job != Job::kBackward);
      EXPECT_EQ(p.prepare, job != Job::kForward) << "the gradient's mean needs its denominator first";
    }
  }
  // Backward jobs never take the stream kernel.
  EXPECT_FALSE(plan(Job::kBackward, 4096, 128256, DType::kBFloat16).stream);
  // No rows: no row work, only the finalize pass (a mean of nothing).
  const CePlan empty = plan(Job::kForward, 0, 1000, DType::kFloat32);
  EXPECT_FALSE(empty.stream);
  EXPECT_FALSE(empty.row_pass);
  EXPECT_TRUE(empty.finalize);
}

TEST(Plan, RescaleCoversEveryRowWithAPersistentGrid) {
  for (int64_t rows : {int64_t(1), int64_t(100), int64_t(100000)}) {
    for (int64_t V : {int64_t(1), int64_t(1000), int64_t(262144)}) {
      const auto r = fusedce::cuda::plan_rescale(rows, V, DType::kBFloat16, 132);
      const int64_t seg = fusedce::cuda::row_segments(V, 7, 8);
      EXPECT_GE(int64_t(r.chunks_per_row) * fusedce::cuda::kRescaleThreads * fusedce::cuda::kRescaleItems, seg);
      EXPECT_LE(r.grid, int64_t(132) * fusedce::cuda::kRescaleBlocksPerSm);
      EXPECT_LE(r.grid, rows * r.chunks_per_row);
      EXPECT_GE(r.grid, 1);
    }
  }
}

// The launcher's decisions written out once more as one straight function, independently of the
// planner's pieces (no PlanChoices: the production plan), so that the planner's defaults are
// checked against a second derivation over the shapes the tests and benchmarks run: the same
// passes, split, grid, variant, groups, halves, sweep order and row shape. `clusters`: the
// 2-block clusters the chosen kernel fits (the launcher's occupancy query).
struct StraightPlan {
  bool stream = false, prepare = false, count_rows = false, count_den = false, finish = false;
  int splits = 1, chunks_per_split = 0, grid = 0, groups = 1, halves = 1, opts = 0;
  bool kernel_grad = false, grad_backwards = false, split_merge = false, row_pass = false, finalize = false;
  fusedce::cuda::RowShape row;
};

fusedce::cuda::RowShape straight_rows(int64_t segments, bool merge, bool sm90) {
  fusedce::cuda::RowShape r;
  r.items = segments <= 1024 ? 1 : 4;
  r.hw_cluster = merge;
  const int max_threads = 1024;
  const int max_cluster = !merge ? (1 << 20) : (sm90 ? 16 : 1);
  const int64_t threads_needed = (segments + r.items - 1) / r.items;
  int cluster = 1;
  while (cluster < max_cluster && threads_needed > int64_t(256) * cluster) cluster *= 2;
  const int64_t per_block = (threads_needed + cluster - 1) / cluster;
  if (per_block <= max_threads) {
    r.cluster = cluster;
    r.threads = static_cast<int>(std::max<int64_t>(32, (per_block + 31) / 32 * 32));
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

StraightPlan straight_plan(Job job, int64_t N, int64_t V, DType dtype, const Options& o, const DeviceFacts& dev,
                           int clusters) {
  using namespace fusedce::cuda;
  StraightPlan s;
  const bool forward = job != Job::kBackward, grad = job != Job::kForward;
  const bool mean = o.reduction == Reduction::kMean, weighted = o.class_weight.data != nullptr;
  const int vec = dtype == DType::kFloat32 ? 4 : 8;
  const int64_t segments = (V + vec - 1 + vec - 1) / vec;
  s.stream = N > 0 && dev.sm90 && forward;
  const int nchunks = static_cast<int>((segments + kChunkSegs - 1) / kChunkSegs);
  if (s.stream) {
    int per = nchunks;
    if (N <= 1024 && (!grad || N < dev.sms)) {
      int64_t best = INT64_MAX;
      for (int c = std::max(1, (nchunks + 63) / 64); c <= nchunks; ++c) {
        const int64_t cost = (N * ((nchunks + c - 1) / c) + dev.sms - 1) / dev.sms * (c + 1);
        if (cost < best) {
          best = cost;
          per = c;
        }
      }
    }
    s.chunks_per_split = per;
    s.splits = (nchunks + per - 1) / per;
    s.grid = static_cast<int>(std::min<int64_t>(N * s.splits, dev.sms));
  }
  s.finish = s.stream && dev.sms <= 1024;
  s.count_den = s.finish && grad && mean && s.splits == 1 && !weighted && !o.check_targets && N <= 32768;
  s.prepare = (mean && grad && !s.count_den) || weighted || o.check_targets;
  s.count_rows = mean && !s.prepare && !s.count_den;
  const bool metrics = forward && o.return_metrics;
  const bool extras = o.softcap > 0.0f || o.label_smoothing != 0.0f || metrics || weighted || o.logit_scale < 0.0f;
  bool finalized = false;
  if (s.stream) {
    s.opts = !extras ? 0 : (o.softcap > 0.0f || o.logit_scale < 0.0f) ? 2 : 1;
    const int64_t row_bytes = V * (dtype == DType::kFloat32 ? 4 : 2);
    const bool want_halves =
        grad && s.splits == 1 && s.chunks_per_split >= 2 && int64_t(dev.sms) * row_bytes > int64_t(dev.l2_bytes);
    s.groups = s.splits == 1 && !want_halves ? (s.chunks_per_split <= 2 ? 2 : 1) : 1;
    s.kernel_grad = grad && s.splits == 1;
    if (want_halves && clusters > 0) {
      s.halves = 2;
      s.chunks_per_split = (s.chunks_per_split + 1) / 2;
      s.grid = 2 * static_cast<int>(std::min<int64_t>(N, clusters));
    }
    s.grad_backwards = int64_t(dev.sms) * row_bytes / s.halves > int64_t(dev.l2_bytes);
    s.split_merge = s.splits > 1 && !s.finish;
    finalized = s.finish || s.splits > 1;
    if (grad && s.splits > 1) {
      s.row_pass = true;
      s.row = straight_rows(segments, false, dev.sm90);
    }
  } else if (N > 0) {
    s.row_pass = true;
    s.row = straight_rows(segments, forward, dev.sm90);
  }
  s.finalize = !finalized && forward && (o.reduction != Reduction::kNone || o.return_metrics);
  return s;
}

TEST(Plan, DefaultsMatchAStraightDerivationOverTheTestedShapes) {
  float weights[1] = {1.0f};
  Options all, none, weighted, negative, smooth;
  all.label_smoothing = 0.1f;
  all.z_loss = 1e-3f;
  all.softcap = 25.0f;
  all.return_metrics = true;
  none.reduction = Reduction::kNone;
  weighted.class_weight = fusedce::vector(weights, DType::kFloat32, 1);
  negative.logit_scale = -0.5f;
  smooth.label_smoothing = 0.05f;
  smooth.return_metrics = true;
  smooth.reduction = Reduction::kSum;
  const int64_t rows[] = {0, 1, 3, 40, 131, 132, 140, 150, 257, 300, 555, 700, 1024, 1025, 1100, 2000, 4096, 8192, 16384};
  const int64_t vocab[] = {1,     5,     7,      127,    1024,   4099,   8000,   16387,  24001,
                           32000, 32003, 50257,  61081,  65537,  128256, 131071, 262144, 262147};
  int checked = 0;
  for (const DeviceFacts& dev : {h200(), a100()}) {
    for (const int clusters : {0, 66}) {
      for (const Job job : {Job::kForward, Job::kForwardBackward, Job::kBackward}) {
        for (const DType d : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
          for (const Options& o : {Options{}, all, none, weighted, negative, smooth}) {
            for (const int64_t N : rows) {
              for (const int64_t V : vocab) {
                const StraightPlan want = straight_plan(job, N, V, d, o, dev, clusters);
                CePlan got = plan(job, N, V, d, o, dev);
                fusedce::cuda::settle_halves(got, N, clusters, dev);
                SCOPED_TRACE("job " + std::to_string(int(job)) + " N=" + std::to_string(N) + " V=" +
                             std::to_string(V) + " dtype " + std::to_string(int(d)) + " clusters " +
                             std::to_string(clusters) + " sm90 " + std::to_string(dev.sm90));
                ASSERT_EQ(got.stream, want.stream);
                ASSERT_EQ(got.prepare, want.prepare);
                ASSERT_EQ(got.count_rows, want.count_rows);
                ASSERT_EQ(got.split_merge, want.split_merge);
                ASSERT_EQ(got.finalize, want.finalize);
                ASSERT_EQ(got.row_pass, want.row_pass);
                if (want.row_pass) {
                  ASSERT_EQ(got.row.items, want.row.items);
                  ASSERT_EQ(got.row.threads, want.row.threads);
                  ASSERT_EQ(got.row.cluster, want.row.cluster);
                  ASSERT_EQ(got.row.pieces, want.row.pieces);
                  ASSERT_EQ(got.row.hw_cluster, want.row.hw_cluster);
                }
                if (!want.stream) continue;
                ASSERT_EQ(got.sp.splits, want.splits);
                ASSERT_EQ(got.sp.chunks_per_split, want.chunks_per_split);
                ASSERT_EQ(got.sp.grid, want.grid);
                ASSERT_EQ(got.sp.opts, want.opts);
                ASSERT_EQ(got.sp.grad, want.kernel_grad);
                ASSERT_EQ(got.sp.groups, want.groups);
                ASSERT_EQ(got.sp.halves, want.halves);
                ASSERT_EQ(got.sp.grad_backwards, want.grad_backwards);
                ASSERT_TRUE(got.sp.async_reduce);
                ASSERT_EQ(got.sp.finish, want.finish);
                ASSERT_EQ(got.sp.count_den, want.count_den);
                ++checked;
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace fusedce_test

// ---- cuBLASLt candidate choice of the linear products (src/cuda/linear/algo_choice.h) ----------

namespace fusedce_test {
namespace {

using fusedce::cuda::AlgoTraits;
using fusedce::cuda::choose_algorithm;
using fusedce::cuda::GemmRole;
using fusedce::cuda::kLtTile176x128;
using fusedce::cuda::kLtTile256x128;

// A heuristic list as an H200 gave it for the logits product at 4096 x 4096 x 128256: the
// preferred 176 x 128 / option 2 candidate sixth.
const std::vector<AlgoTraits> kLogitsList = {{248, 7, 1, 0}, {24, 7, 1, 0}, {23, 4, 1, 0}, {209, 4, 1, 0},
                                             {31, 7, 1, 0},  {201, 2, 1, 0}, {197, 2, 1, 0}, {32, 4, 1, 0}};

TEST(AlgoChoice, HopperTakesTheRolesPreferredCandidate) {
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 9, 0, kLogitsList.data(), 8), 5);
  // grad_weight prefers 256 x 128 with option 7: the second entry of the same list.
  EXPECT_EQ(choose_algorithm(GemmRole::kGradWeight, 9, 0, kLogitsList.data(), 8), 1);
  static_assert(kLtTile176x128 == 201 && kLtTile256x128 == 24, "the ids of the list above");
}

TEST(AlgoChoice, FirstCandidateOtherwise) {
  // No role, grad_hidden, another architecture, or a list without a preferred candidate.
  EXPECT_EQ(choose_algorithm(GemmRole::kAny, 9, 0, kLogitsList.data(), 8), 0);
  EXPECT_EQ(choose_algorithm(GemmRole::kGradHidden, 9, 0, kLogitsList.data(), 8), 0);
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 8, 0, kLogitsList.data(), 8), 0);
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 10, 0, kLogitsList.data(), 8), 0);
  // The list's first five: no 176 x 128 / option 2, so the logits' second preference, 256 x 128 / 7.
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 9, 0, kLogitsList.data(), 5), 1);
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 9, 0, kLogitsList.data(), 1), 0);  // neither
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 9, 0, kLogitsList.data(), 0), 0);
}

TEST(AlgoChoice, NeverASplitKOrReducingCandidate) {
  // The preferred tile and option, but summed in split-K parts (other bits): passed over.
  std::vector<AlgoTraits> list = {{248, 7, 1, 0}, {201, 2, 4, 1}, {201, 2, 1, 2}, {201, 2, 1, 0}};
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 9, 0, list.data(), 4), 3);
  list.pop_back();
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 9, 0, list.data(), 3), 0);
  // The second preference, after the first's only entry is a split-K one.
  list.push_back({24, 7, 1, 0});
  EXPECT_EQ(choose_algorithm(GemmRole::kLogits, 9, 0, list.data(), 4), 3);
}

// The linear form's window plan (cuda/linear/window_plan.h): bf16 on Hopper with the options
// whose gradient is a per-row factor (z-loss's included) or a stored per-entry one (the
// soft-cap's) or a rank-one term (label smoothing's, without the soft-cap), never elsewhere; label
// smoothing with the soft-cap, low_memory, an H the TMA cannot address or wider than
// kWindowMaxHidden keeps the logits path; any V takes it. And the
// window itself: offset 0 inside +-64 powers of two, the tile's own outside.
TEST(WindowPlan, TakesTheCallsWhoseGradientIsARowFactor) {
  using fusedce::cuda::window_eligible;
  using fusedce::cuda::window_offset;
  using fusedce::cuda::window_tiles;
  Options plain;
  EXPECT_TRUE(window_eligible(2048, 128256, DType::kBFloat16, plain, false, true));
  EXPECT_TRUE(window_eligible(fusedce::cuda::kWindowMaxHidden, 151936, DType::kBFloat16, plain, false, true));
  EXPECT_FALSE(window_eligible(fusedce::cuda::kWindowMaxHidden + 8, 151936, DType::kBFloat16, plain, false, true))
      << "past the widest hidden size the logits path stays";
  EXPECT_FALSE(window_eligible(4096, 128256, DType::kBFloat16, plain, false, true));
  Options rows = plain;  // every per-row-factor option at once
  rows.logit_scale = -0.8f;
  rows.reduction = Reduction::kNone;
  rows.return_metrics = true;
  rows.ignore_index = 7;
  EXPECT_TRUE(window_eligible(64, 2, DType::kBFloat16, rows, false, true));
  EXPECT_FALSE(window_eligible(2048, 128256, DType::kBFloat16, plain, false, false)) << "no Hopper kernels";
  EXPECT_FALSE(window_eligible(2048, 128256, DType::kFloat16, plain, false, true));
  EXPECT_FALSE(window_eligible(2048, 128256, DType::kFloat32, plain, false, true));
  EXPECT_FALSE(window_eligible(2048, 128256, DType::kBFloat16, plain, true, true)) << "low_memory";
  EXPECT_FALSE(window_eligible(2052, 128256, DType::kBFloat16, plain, false, true)) << "H % 8";
  EXPECT_TRUE(window_eligible(2048, 128257, DType::kBFloat16, plain, false, true)) << "odd V";
  EXPECT_TRUE(window_eligible(64, 1, DType::kBFloat16, plain, false, true)) << "V = 1";
  Options o = plain;
  o.label_smoothing = 0.1f;
  EXPECT_TRUE(window_eligible(2048, 128256, DType::kBFloat16, o, false, true)) << "label smoothing: a rank-one term";
  o.z_loss = 1e-4f;
  o.logit_scale = 0.5f;
  EXPECT_TRUE(window_eligible(2048, 128256, DType::kBFloat16, o, false, true)) << "label smoothing, z-loss, scale";
  o.softcap = 30.0f;
  EXPECT_FALSE(window_eligible(2048, 128256, DType::kBFloat16, o, false, true)) << "label smoothing and the soft-cap";
  o = plain;
  o.softcap = 30.0f;
  EXPECT_TRUE(window_eligible(2048, 128256, DType::kBFloat16, o, false, true)) << "soft-cap: stored per entry";
  o = plain;
  o.z_loss = 1e-4f;
  EXPECT_TRUE(window_eligible(2048, 128256, DType::kBFloat16, o, false, true)) << "z-loss: a per-row factor";
  o = plain;
  o.logit_scale = INFINITY;
  EXPECT_FALSE(window_eligible(2048, 128256, DType::kBFloat16, o, false, true)) << "an infinite logit scale";

  EXPECT_EQ(window_offset(0.0f), 0.0f);
  EXPECT_EQ(window_offset(64.0f), 0.0f);
  EXPECT_EQ(window_offset(-64.0f), 0.0f);
  EXPECT_EQ(window_offset(65.0f), 65.0f);
  EXPECT_EQ(window_offset(-87.0f), -87.0f);
  EXPECT_EQ(window_tiles(1), 1);
  EXPECT_EQ(window_tiles(192), 1);
  EXPECT_EQ(window_tiles(193), 2);
  EXPECT_EQ(window_tiles(128256), 668);
  EXPECT_TRUE(fusedce::cuda::window_tile_order(4096).along_m);
  EXPECT_EQ(fusedce::cuda::window_tile_order(4096).swizzle, 1);
  EXPECT_EQ(fusedce::cuda::window_tile_order(8191).swizzle, 1);
  EXPECT_EQ(fusedce::cuda::window_tile_order(8192).swizzle, 8);
  // Groups that divide the row tiles: 68 of them (8704 rows) in 4s, 66 in 2s, 65 ungrouped.
  EXPECT_EQ(fusedce::cuda::window_tile_order(8704).swizzle, 4);
  EXPECT_EQ(fusedce::cuda::window_tile_order(8448).swizzle, 2);
  EXPECT_EQ(fusedce::cuda::window_tile_order(8320).swizzle, 1);
  EXPECT_EQ(fusedce::cuda::window_tile_order(8193).swizzle, 1) << "65 row tiles, the last one partial";
}

// The planner's choice among eligible calls: every option takes the window form, grad_bias
// among them, unless a test or benchmark asks for the logits path. The metrics never change the form (the contract keeps the loss and
// every gradient bit-identical with them on or off). A call the form cannot run never takes it,
// whatever is asked.
TEST(WindowPlan, ChoosesTheFormWhereItPays) {
  using fusedce::cuda::window_chosen;
  using fusedce::cuda::window_pays;
  using Form = fusedce::detail::LinearForm;
  Options plain;
  EXPECT_TRUE(window_pays(plain, false));
  Options merged = plain;  // what rides the merge and the products
  merged.label_smoothing = 0.1f;
  merged.z_loss = 1e-4f;
  merged.logit_scale = 0.9f;
  merged.reduction = Reduction::kNone;
  EXPECT_TRUE(window_pays(merged, false));
  Options capped = plain;
  capped.softcap = 30.0f;
  EXPECT_TRUE(window_pays(capped, false)) << "soft-cap";
  EXPECT_TRUE(window_pays(plain, true)) << "grad_bias";
  EXPECT_TRUE(window_pays(merged, true)) << "grad_bias";
  for (const Options& o : {plain, merged, capped}) {
    Options metrics = o;
    metrics.return_metrics = true;
    for (bool grad_bias : {false, true}) {
      EXPECT_EQ(window_pays(o, grad_bias), window_pays(metrics, grad_bias)) << "the metrics never decide the form";
    }
  }

  Options metrics = plain;
  metrics.return_metrics = true;
  EXPECT_TRUE(window_chosen(true, Form::kAuto, plain, false));
  EXPECT_TRUE(window_chosen(true, Form::kAuto, metrics, false));
  EXPECT_TRUE(window_chosen(true, Form::kAuto, plain, true)) << "grad_bias";
  EXPECT_FALSE(window_chosen(true, Form::kLogits, plain, true)) << "asked for the logits path";
  EXPECT_TRUE(window_chosen(true, Form::kWindow, metrics, true)) << "asked for";
  EXPECT_FALSE(window_chosen(true, Form::kLogits, plain, false)) << "asked for the logits path";
  EXPECT_FALSE(window_chosen(false, Form::kWindow, plain, false)) << "not eligible: never";
  EXPECT_FALSE(window_chosen(false, Form::kAuto, plain, false));
}

}  // namespace
}  // namespace fusedce_test
