// The CUDA backend's host side: workspace layout, launch shapes, and the sequence of passes of
// each job (prepare -> row kernel -> finalize; on sm_90 the stream kernel, which finishes the call
// itself: usually one launch), all enqueued on the caller's stream with no host synchronisation
// (except the opt-in target check, which must read a result back).
#include "cuda/port.h"  // first: the platform's runtime header

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <sstream>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "common/call.h"
#include "common/constants.h"
#include "cuda/host_util.h"
#include "cuda/kernels.h"
#include "cuda/params.h"
#include "cuda/plan.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {
namespace {


/// Where each piece of the workspace lives (byte offsets; size 0 = not needed).
struct WorkspaceLayout {
  size_t batch = 0, row_loss = 0, row_entropy = 0, row_correct = 0, row_lse = 0, partials = 0, counters = 0,
         block_sums = 0, total = 0;
};

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
  if (forward && o.compute_metrics) {
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

/// How a row is spread over threads: `cluster` blocks of `threads`, each thread holding `items`
/// 16-byte segments per piece, `pieces` pieces per block. `hw_cluster`: whether the blocks of a
/// row form a hardware cluster (they must when they merge statistics; a backward pass needs none).
struct RowShape {
  int items, threads, cluster, pieces;
  bool hw_cluster;
};

// Blocks of about this many threads: several resident per SM (at <= 64 registers a thread), so
// one block's loads overlap another's reductions and barriers.
constexpr int kTargetThreads = 256;

RowShape plan_rows(int64_t segments, bool merge, int cc_major) {
  RowShape r;
  r.items = segments <= 1024 ? 1 : 4;
  r.hw_cluster = merge;
  const int max_threads = max_row_threads(r.items);
  // Clusters need sm_90; 16 is the non-portable maximum Hopper allows.
  const int max_cluster = !merge ? (1 << 20) : (kHopperFeatures && cc_major >= 9 ? 16 : 1);
  const int64_t threads_needed = (segments + r.items - 1) / r.items;
  int cluster = 1;
  while (cluster < max_cluster && threads_needed > int64_t(kTargetThreads) * cluster) cluster *= 2;
  const int64_t per_block = (threads_needed + cluster - 1) / cluster;
  if (per_block <= max_threads) {
    r.cluster = cluster;
    // Whole warps: the block reduction covers blockDim.x / kWarpSize warps.
    r.threads = static_cast<int>(std::max<int64_t>(kWarpSize, (per_block + kWarpSize - 1) / kWarpSize * kWarpSize));
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

/// The streaming kernel's work split: whole rows per block, or (few rows) each row cut into
/// `splits` stretches of `chunks_per_split` chunks so that every SM has work.
struct StreamPlan {
  int splits, chunks_per_split, grid;
};

/// A block's time is about its chunks plus a fixed cost per work item (pipeline start, the
/// row's reduction), here in chunks; the split is the one with the least time on the busiest SM.
constexpr int64_t kItemCostChunks = 1;

StreamPlan plan_stream(int64_t rows, int64_t segments, int sms, bool grad, int forced_chunks) {
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

/// Rows halved over 2-block clusters (StreamParams::halves) when the rows in flight on all SMs
/// would overflow L2: the second sweep then re-reads half a row from L2 instead of memory. Rows
/// that fit L2 lose by it (the cluster's exchange costs more than the misses it saves).
bool use_halves(int sms, int64_t row_bytes, int l2_bytes, PlanChoices::Force force) {
  if (force != PlanChoices::Force::kAuto) return force == PlanChoices::Force::kOn;
  return int64_t(sms) * row_bytes > int64_t(l2_bytes);
}

/// Consumer groups of the stream kernel (two groups of 8 warps, each folding its own rows) for
/// rows of at most 2 chunks over whole rows: short rows pay per-row costs (set-up, warp and row
/// folds) about as large as their elements, which half the warps per row halve; long rows are
/// bandwidth-bound, and with the gradient two groups lose there. `forced` (1 or 2) overrides.
int stream_groups(int nchunks, int forced) {
  if (forced == 1 || forced == 2) return forced;
  return nchunks <= 2 ? 2 : 1;
}

/// A tag for one call's counters in the workspace (finish.cuh, arrive_tagged): 40 bits of a
/// 64-bit mix (splitmix64) of a per-process count, so that stale words (earlier calls, other
/// tensors) match one with odds of 2^-40; never 0, the cleared value.
unsigned long long next_call_tag() {
  static std::atomic<unsigned long long> calls{0};
  unsigned long long x = calls.fetch_add(1, std::memory_order_relaxed) + 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  x ^= x >> 31;
  x &= (1ull << 40) - 1;
  return x != 0 ? x : 1;
}

#if FUSEDCE_PLATFORM_HIP
// No thread-block clusters on AMD GPUs: halves are never requested there (the stream kernel is
// sm_90 only).
int clusters_of_two(StreamKernel, int) { return 0; }
cudaError_t launch_in_clusters_of_two(StreamKernel, int, const StreamParams&, cudaStream_t) {
  return cudaErrorNotSupported;
}
#else
cudaLaunchConfig_t cluster_config(int grid, cudaStream_t stream, cudaLaunchAttribute* attr) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid), 1, 1);
  config.blockDim = dim3(kStreamThreads, 1, 1);
  config.dynamicSmemBytes = kStreamSmemBytes;
  config.stream = stream;
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 2;
  attr[0].val.clusterDim.y = 1;
  attr[0].val.clusterDim.z = 1;
  config.attrs = attr;
  config.numAttrs = 1;
  return config;
}

/// How many 2-block clusters of the stream kernel fit on the device at once (0 if none or on
/// error): the persistent grid's size.
int clusters_of_two(StreamKernel kernel, int device) {
  static std::mutex mu;
  static std::vector<std::pair<const void*, std::pair<int, int>>> known;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& k : known) {
    if (k.first == reinterpret_cast<const void*>(kernel) && k.second.first == device) return k.second.second;
  }
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t config = cluster_config(2, nullptr, attr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();
    clusters = 0;
  }
  known.push_back({reinterpret_cast<const void*>(kernel), {device, clusters}});
  return clusters;
}

cudaError_t launch_in_clusters_of_two(StreamKernel kernel, int grid, const StreamParams& sp, cudaStream_t stream) {
  cudaLaunchAttribute attr[1];
  const cudaLaunchConfig_t config = cluster_config(grid, stream, attr);
  return cudaLaunchKernelEx(&config, kernel, sp);
}
#endif

/// cudaFuncSetAttribute once per kernel and device: it costs microseconds of host time, which a
/// few-rows call (tens of microseconds of GPU time) would otherwise wait on.
cudaError_t allow_stream_smem(const void* kernel, int device) {
  static std::mutex mu;
  static std::vector<std::pair<const void*, int>> done;
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& d : done) {
    if (d.first == kernel && d.second == device) return cudaSuccess;
  }
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kStreamSmemBytes));
  if (e == cudaSuccess) done.emplace_back(kernel, device);
  return e;
}

int vec_of(DType d) { return d == DType::kFloat32 ? 4 : 8; }

StreamKernel select_stream_kernel(DType d, bool grad, StreamOpts opts, int groups) {
  switch (d) {
    case DType::kFloat32: return select_stream_kernel_f32(grad, opts, groups);
    case DType::kBFloat16: return select_stream_kernel_bf16(grad, opts, groups);
    default: return select_stream_kernel_f16(grad, opts, groups);
  }
}

RowKernel select_row_kernel(DType d, int items, bool forward, bool grad, bool extras) {
  switch (d) {
    case DType::kFloat32: return select_row_kernel_f32(items, forward, grad, extras);
    case DType::kBFloat16: return select_row_kernel_bf16(items, forward, grad, extras);
    default: return select_row_kernel_f16(items, forward, grad, extras);
  }
}

int device_cc_major(int index) {
  int major = 0;
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index);  // 0 on failure
  return major;
}

Status launch_row_kernel(RowKernel kernel, const RowShape& shape, const RowParams& params,
                         cudaStream_t stream) {
#if FUSEDCE_PLATFORM_HIP
  // No thread-block clusters on AMD GPUs (plan_rows never asks for one there): a plain launch.
  if (shape.hw_cluster) return Status(StatusCode::kUnsupported, "thread-block clusters need an sm_90 GPU");
  kernel<<<static_cast<unsigned>(params.rows * shape.cluster), shape.threads, 0, stream>>>(params);
  cudaError_t e = cudaGetLastError();
#else
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(params.rows * shape.cluster), 1, 1);
  config.blockDim = dim3(shape.threads, 1, 1);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  if (shape.hw_cluster) {
    if (shape.cluster > 8) {
      cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
      if (e != cudaSuccess) return device_error(e, "allowing clusters of 16 blocks");
    }
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = shape.cluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.attrs = attr;
    config.numAttrs = 1;
  }
  cudaError_t e = cudaLaunchKernelEx(&config, kernel, params);
#endif
  if (e != cudaSuccess) return device_error(e, "the row kernel launch");
  return Status::Ok();
}

Status run_rescale(const detail::CeCall& call, cudaStream_t stream) {
  const MatrixView& d = call.dlogits;
  if (d.rows == 0) return Status::Ok();
  RescaleParams p;
  p.dlogits = d.data;
  p.stride = d.row_stride;
  p.rows = d.rows;
  p.vocab = d.cols;
  p.grad_loss = static_cast<const float*>(call.grad_loss.data);
  p.grad_stride = call.grad_loss.stride;
  p.grad_scalar = call.grad_loss.size == 1 && d.rows != 1;
  const int64_t segments = row_segments(d.cols, vec_of(d.dtype) - 1, vec_of(d.dtype));
  const int64_t per_block = int64_t(kRescaleThreads) * kRescaleItems;
  p.chunks_per_row = static_cast<int>((segments + per_block - 1) / per_block);
  RescaleKernel k = d.dtype == DType::kFloat32    ? rescale_kernel_f32()
                    : d.dtype == DType::kBFloat16 ? rescale_kernel_bf16()
                                                  : rescale_kernel_f16();
  // Persistent blocks (kRescaleBlocksPerSm an SM) over the (row, chunk) items.
  int sms = 0;
  (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, call.device.index);
  const int64_t items = p.rows * p.chunks_per_row;
  const int64_t grid = std::min<int64_t>(items, int64_t(std::max(sms, 1)) * kRescaleBlocksPerSm);
  k<<<static_cast<unsigned>(grid), kRescaleThreads, 0, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : device_error(e, "the rescale kernel launch");
}

/// The finalize pass's inputs: the per-row results and where the sums go.
void fill_finalize(BatchParams& bp, const RowParams& p, const detail::CeCall& call, const Options& o) {
  bp.row_loss = p.row_loss;
  bp.loss_out = o.reduction != Reduction::kNone ? static_cast<float*>(call.out.loss.data) : nullptr;
  if (o.compute_metrics) {
    bp.row_entropy = p.row_entropy;
    bp.row_correct = p.row_correct;
    bp.num_correct_out = static_cast<int64_t*>(call.out.num_correct.data);
    bp.entropy_out = static_cast<float*>(call.out.entropy_sum.data);
  }
}

}  // namespace

size_t workspace_size(Job job, int64_t rows, int64_t, const Options& options) {
  return plan_workspace(job, rows, options).total;
}

Status run(const detail::CeCall& call) { return run(call, PlanChoices{}); }

Status run(const detail::CeCall& call, const PlanChoices& choices) {
  DeviceGuard guard(call.device.index);
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  (void)cudaGetLastError();  // an earlier, unrelated error must not be reported as ours
  if (call.job == Job::kRescale) return run_rescale(call, stream);

  const MatrixView& L = call.logits;
  const Options& o = call.options;
  const int64_t N = L.rows, V = L.cols;
  const bool forward = call.job != Job::kBackward;
  const bool grad = call.job != Job::kForward;
  if (V >= (int64_t(1) << 31) - 64) {
    return Status(StatusCode::kInvalidArgument, "logits: the CUDA backend takes V < 2^31 - 64 columns");
  }

  const WorkspaceLayout ws = plan_workspace(call.job, N, o);
  char* base = static_cast<char*>(call.workspace.data);
  if (base == nullptr && ws.total > 0) {
    // No workspace given: stream-ordered scratch (still no host sync, still graph-capturable).
    // Callers on the hot path pass one from cross_entropy_workspace_size instead.
    void* scratch = nullptr;
    cudaError_t e = cudaMallocAsync(&scratch, ws.total, stream);
    if (e != cudaSuccess) return device_error(e, "allocating scratch (cudaMallocAsync)");
    detail::CeCall with = call;
    with.workspace = Workspace{scratch, ws.total};
    Status s = run(with, choices);
    e = cudaFreeAsync(scratch, stream);
    if (s.ok() && e != cudaSuccess) return device_error(e, "freeing scratch (cudaFreeAsync)");
    return s;
  }
  if (call.workspace.bytes < ws.total) {
    std::ostringstream os;
    os << "workspace has " << call.workspace.bytes << " bytes, this call needs " << ws.total
       << " (ask cross_entropy_workspace_size)";
    return Status(StatusCode::kWorkspaceTooSmall, os.str());
  }
  BatchScalars* batch = reinterpret_cast<BatchScalars*>(base + ws.batch);

  BatchParams bp = {};
  bp.target = call.target.data;
  bp.target_stride = call.target.stride;
  bp.target_i64 = call.target.dtype == DType::kInt64;
  bp.ignore_index = o.ignore_index;
  bp.rows = N;
  bp.vocab = V;
  bp.class_weight = static_cast<const float*>(o.class_weight.data);
  bp.weight_stride = o.class_weight.stride;
  bp.mean = o.reduction == Reduction::kMean;
  bp.batch = batch;

  // The stream kernel (sm_90, forward jobs) and its work split, planned first: whether it
  // finishes the call itself decides which one-block passes run around it.
  const int vec = vec_of(L.dtype);
  // Plan for the worst row alignment, so one shape serves every row.
  const int64_t segments = row_segments(V, vec - 1, vec);
  const int cc_major = N > 0 ? device_cc_major(call.device.index) : 0;
  const bool use_stream =
      N > 0 && kHopperFeatures && forward && cc_major >= 9 && choices.stream != PlanChoices::Force::kOff;
  int sms = 0;
  StreamPlan plan = {1, 0, 0};
  if (use_stream) {
    (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, call.device.index);
    plan = plan_stream(N, segments, sms, grad, choices.split_chunks);
  }
  // Its grid never has more blocks than the SMs (with or without halves).
  const bool finish_here = use_stream && sms <= kMaxFinishBlocks && choices.stream_finish;
  // The mean's 1 / denominator counted by every block of a stream kernel that forms the
  // gradient, for a batch small enough (no prepare pass).
  const bool count_den = finish_here && grad && bp.mean && plan.splits == 1 && bp.class_weight == nullptr &&
                         !o.check_targets && N <= kCountDenRowsMax;

  // The prepare pass: for class weights, the target check, and the gradient's 1 / denominator.
  // A forward's mean counts its rows in the finalize pass instead (one launch less).
  const bool need_batch = (bp.mean && grad && !count_den) || bp.class_weight != nullptr || o.check_targets;
  bp.count_rows = bp.mean && !need_batch && !count_den;
  if (need_batch) {
    launch_prepare(bp, stream);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return device_error(e, "the prepare kernel launch");
  }
  if (o.check_targets) {
    // Opt-in: the one place a call waits for the device, to report the bad row by name.
    BatchScalars host;
    cudaError_t e = cudaMemcpyAsync(&host, batch, sizeof(host), cudaMemcpyDeviceToHost, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    if (e != cudaSuccess) return device_error(e, "reading the target check");
    if (host.bad_row != INT64_MAX) {
      std::ostringstream os;
      os << "target[" << host.bad_row << "] = " << host.bad_value << " is out of range [0, " << V
         << ") and is not ignore_index (" << o.ignore_index << ")";
      return Status(StatusCode::kTargetOutOfRange, os.str());
    }
  }

  RowParams p = {};
  p.logits = L.data;
  p.logits_stride = L.row_stride;
  p.dlogits = grad ? call.dlogits.data : nullptr;
  p.dlogits_stride = call.dlogits.row_stride;
  p.target = call.target.data;
  p.target_stride = call.target.stride;
  p.target_i64 = bp.target_i64;
  p.ignore_index = o.ignore_index;
  p.class_weight = bp.class_weight;
  p.weight_stride = o.class_weight.stride;
  p.rows = N;
  p.vocab = V;
  p.c = detail::make_loss_constants(o, V, static_cast<float>(V));
  p.batch = need_batch ? batch : nullptr;
  p.softcap = o.softcap > 0.0f;
  p.smoothing = o.label_smoothing != 0.0f;
  p.metrics = forward && o.compute_metrics;
  if (forward) {
    if (o.reduction == Reduction::kNone) {
      p.row_loss = static_cast<float*>(call.out.loss.data);
      p.row_loss_stride = call.out.loss.stride;
    } else {
      p.row_loss = reinterpret_cast<float*>(base + ws.row_loss);
      p.row_loss_stride = 1;
    }
    p.lse_out = static_cast<float*>(call.out.lse.data);
    p.lse_stride = call.out.lse.stride;
    if (p.metrics) {
      p.row_entropy = reinterpret_cast<float*>(base + ws.row_entropy);
      p.row_correct = reinterpret_cast<uint8_t*>(base + ws.row_correct);
    }
  } else {
    p.lse_in = static_cast<const float*>(call.lse_in.data);
    p.lse_in_stride = call.lse_in.stride;
  }
  p.grad_loss = static_cast<const float*>(call.grad_loss.data);
  p.grad_stride = call.grad_loss.stride;
  p.grad_scalar = o.reduction != Reduction::kNone;

  bool finalized = false;  // the batch sums were formed (by the stream kernel or split-merge pass)
  if (N > 0) {
    // The plain kernels assume logit_scale > 0 (they take the max over raw logits).
    const bool extras = p.softcap || p.smoothing || p.metrics || p.class_weight != nullptr || o.logit_scale < 0.0f;
    if (use_stream) {
      StreamParams sp = {};
      sp.row = p;
      sp.splits = plan.splits;
      sp.chunks_per_split = plan.chunks_per_split;
      sp.async_reduce = choices.async_reduce;
      const StreamOpts opts = !extras ? kStreamPlain
                              : (p.softcap || o.logit_scale < 0.0f) ? kStreamGeneral : kStreamOptions;
      int l2_bytes = 0;
      (void)cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, call.device.index);
      const int64_t row_bytes = V * static_cast<int64_t>(dtype_size(L.dtype));
      const bool want_halves =
          grad && plan.splits == 1 && plan.chunks_per_split >= 2 && use_halves(sms, row_bytes, l2_bytes, choices.halves);
      // Groups fold whole rows of one block: no splits, no halves.
      const int groups = plan.splits == 1 && !want_halves ? stream_groups(plan.chunks_per_split, choices.groups) : 1;
      const StreamKernel kernel = select_stream_kernel(L.dtype, grad && plan.splits == 1, opts, groups);
      cudaError_t e = allow_stream_smem(reinterpret_cast<const void*>(kernel), call.device.index);
      if (e != cudaSuccess) return device_error(e, "raising the stream kernel's shared memory limit");
      sp.halves = 1;
      int grid = plan.grid;
      if (want_halves) {
        const int clusters = clusters_of_two(kernel, call.device.index);
        if (clusters > 0) {
          sp.halves = 2;
          sp.chunks_per_split = (plan.chunks_per_split + 1) / 2;
          grid = 2 * static_cast<int>(std::min<int64_t>(N, clusters));
        }
      }
      // The gradient sweep walks each row backwards when the rows in flight outgrow L2 (the
      // chunks loaded last, still in L2, come first); rows that fit keep the forward order.
      sp.grad_backwards = int64_t(sms) * row_bytes / sp.halves > int64_t(l2_bytes);
      if (finish_here) {
        sp.finish = true;
        if (forward && (o.reduction != Reduction::kNone || o.compute_metrics)) fill_finalize(bp, p, call, o);
        sp.fin = bp;
        sp.counters = reinterpret_cast<unsigned long long*>(base + ws.counters);
        sp.block_sums = reinterpret_cast<BatchSums*>(base + ws.block_sums);
        sp.tag = next_call_tag();
        sp.count_den = count_den;
      }
      if (plan.splits > 1) {
        sp.partials = base + ws.partials;
        if (grad && sp.row.lse_out == nullptr) {
          sp.row.lse_out = reinterpret_cast<float*>(base + ws.row_lse);
          sp.row.lse_stride = 1;
        }
      }
      if (sp.halves > 1) {
        e = launch_in_clusters_of_two(kernel, grid, sp, stream);
      } else {
        kernel<<<grid, kStreamThreads, kStreamSmemBytes, stream>>>(sp);
        e = cudaGetLastError();
      }
      if (e != cudaSuccess) return device_error(e, "the stream kernel launch");
      if (plan.splits > 1 && !finish_here) {
        // The rows' partials folded into their results (and the batch sums: no finalize below).
        fill_finalize(bp, p, call, o);
        launch_split_merge(bp, sp.row, sp.partials, plan.splits, stream);
        e = cudaGetLastError();
        if (e != cudaSuccess) return device_error(e, "the split-merge kernel launch");
      }
      finalized = finish_here || plan.splits > 1;
      if (grad && plan.splits > 1) {
        // Few rows, each split over blocks: the gradient in a second pass from the merged lse
        // (the rows are small enough to be re-read from L2).
        RowParams bp_row = sp.row;
        bp_row.lse_in = sp.row.lse_out;
        bp_row.lse_in_stride = sp.row.lse_stride;
        const RowShape shape = plan_rows(segments, false, cc_major);
        bp_row.cluster = shape.cluster;
        bp_row.pieces = shape.pieces;
        Status s = launch_row_kernel(select_row_kernel(L.dtype, shape.items, false, true, extras), shape, bp_row, stream);
        if (!s.ok()) return s;
      }
    } else {
      const RowShape shape = plan_rows(segments, forward, cc_major);
      p.cluster = shape.cluster;
      p.pieces = shape.pieces;
      Status s = launch_row_kernel(select_row_kernel(L.dtype, shape.items, forward, grad, extras), shape, p, stream);
      if (!s.ok()) return s;
    }
  }

  if (!finalized && forward && (o.reduction != Reduction::kNone || o.compute_metrics)) {
    fill_finalize(bp, p, call, o);
    launch_finalize(bp, stream);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return device_error(e, "the finalize kernel launch");
  }
  return Status::Ok();
}

}  // namespace cuda
}  // namespace fusedce
