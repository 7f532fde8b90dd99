// The CUDA backend's host side for cross-entropy over logits: reads the device's facts, asks the
// planner (plan.h: pure functions) for the call's passes and shapes, fills their parameters and
// launches them (prepare -> row kernel -> finalize; on sm_90 the stream kernel, which finishes the
// call itself: usually one launch), all on the caller's stream with no host synchronisation
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
#include "cuda/ce/kernels.h"
#include "cuda/ce/params.h"
#include "cuda/ce/plan.h"
#include "cuda/host_util.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {
namespace {

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

/// cudaFuncSetAttribute once per kernel, device and attribute: it costs microseconds of host
/// time, which a few-rows call (tens of microseconds of GPU time) would otherwise wait on.
cudaError_t set_attribute_once(const void* kernel, int device, cudaFuncAttribute attr, int value) {
  struct Done {
    const void* kernel;
    int device;
    cudaFuncAttribute attr;
  };
  static std::mutex mu;
  static std::vector<Done> done;
  std::lock_guard<std::mutex> lock(mu);
  for (const Done& d : done) {
    if (d.kernel == kernel && d.device == device && d.attr == attr) return cudaSuccess;
  }
  cudaError_t e = cudaFuncSetAttribute(kernel, attr, value);
  if (e == cudaSuccess) done.push_back({kernel, device, attr});
  return e;
}

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

/// What the plan needs to know of device `index` (zeros where an attribute cannot be read).
DeviceFacts device_facts(int index) {
  DeviceFacts f;
  int major = 0;
  (void)cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, index);
  (void)cudaDeviceGetAttribute(&f.sms, cudaDevAttrMultiProcessorCount, index);
  (void)cudaDeviceGetAttribute(&f.l2_bytes, cudaDevAttrL2CacheSize, index);
  f.warp = kWarpSize;
  f.sm90 = kHopperFeatures && major >= 9;
  return f;
}

Status launch_row_kernel(RowKernel kernel, const RowShape& shape, const RowParams& params, int device,
                         cudaStream_t stream) {
#if FUSEDCE_PLATFORM_HIP
  // No thread-block clusters on AMD GPUs (plan_rows never asks for one there): a plain launch.
  (void)device;
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
      cudaError_t e = set_attribute_once(reinterpret_cast<const void*>(kernel), device,
                                         cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
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
  int sms = 0;
  (void)cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, call.device.index);
  const RescalePlan plan = plan_rescale(d.rows, d.cols, d.dtype, sms);
  RescaleParams p;
  p.dlogits = d.data;
  p.stride = d.row_stride;
  p.rows = d.rows;
  p.vocab = d.cols;
  p.grad_loss = static_cast<const float*>(call.grad_loss.data);
  p.grad_stride = call.grad_loss.stride;
  p.grad_scalar = call.grad_loss.size == 1 && d.rows != 1;
  p.chunks_per_row = plan.chunks_per_row;
  RescaleKernel k = d.dtype == DType::kFloat32    ? rescale_kernel_f32()
                    : d.dtype == DType::kBFloat16 ? rescale_kernel_bf16()
                                                  : rescale_kernel_f16();
  k<<<static_cast<unsigned>(plan.grid), kRescaleThreads, 0, stream>>>(p);
  cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? Status::Ok() : device_error(e, "the rescale kernel launch");
}

/// The finalize pass's inputs: the per-row results and where the sums go.
void fill_finalize(BatchParams& bp, const RowParams& p, const detail::CeCall& call, const Options& o) {
  bp.row_loss = p.row_loss;
  bp.loss_out = o.reduction != Reduction::kNone ? static_cast<float*>(call.out.loss.data) : nullptr;
  if (o.return_metrics) {
    bp.row_entropy = p.row_entropy;
    bp.row_correct = p.row_correct;
    bp.num_correct_out = static_cast<int64_t*>(call.out.num_correct.data);
    bp.entropy_out = static_cast<float*>(call.out.entropy_sum.data);
  }
}

/// The one-block passes' inputs (prepare, finalize, split-merge, the stream kernel's finish).
BatchParams batch_params(const detail::CeCall& call, BatchScalars* batch) {
  const Options& o = call.options;
  BatchParams bp = {};
  bp.target = call.target.data;
  bp.target_stride = call.target.stride;
  bp.target_i64 = call.target.dtype == DType::kInt64;
  bp.ignore_index = o.ignore_index;
  bp.rows = call.logits.rows;
  bp.vocab = call.logits.cols;
  bp.class_weight = static_cast<const float*>(o.class_weight.data);
  bp.weight_stride = o.class_weight.stride;
  bp.mean = o.reduction == Reduction::kMean;
  bp.batch = batch;
  return bp;
}

/// The row pass's inputs (the row kernels, and the stream kernel's StreamParams::row).
RowParams row_params(const detail::CeCall& call, char* base, const CePlan& plan) {
  const MatrixView& L = call.logits;
  const Options& o = call.options;
  const bool forward = call.job != Job::kBackward;
  const bool grad = call.job != Job::kForward;
  RowParams p = {};
  p.logits = L.data;
  p.logits_stride = L.row_stride;
  p.dlogits = grad ? call.dlogits.data : nullptr;
  p.dlogits_stride = call.dlogits.row_stride;
  p.target = call.target.data;
  p.target_stride = call.target.stride;
  p.target_i64 = call.target.dtype == DType::kInt64;
  p.ignore_index = o.ignore_index;
  p.class_weight = static_cast<const float*>(o.class_weight.data);
  p.weight_stride = o.class_weight.stride;
  p.rows = L.rows;
  p.vocab = L.cols;
  p.c = detail::make_loss_constants(o, L.cols, static_cast<float>(L.cols));
  p.batch = plan.prepare ? reinterpret_cast<BatchScalars*>(base + plan.ws.batch) : nullptr;
  p.softcap = o.softcap > 0.0f;
  p.smoothing = o.label_smoothing != 0.0f;
  p.metrics = forward && o.return_metrics;
  if (forward) {
    if (o.reduction == Reduction::kNone) {
      p.row_loss = static_cast<float*>(call.out.loss.data);
      p.row_loss_stride = call.out.loss.stride;
    } else {
      p.row_loss = reinterpret_cast<float*>(base + plan.ws.row_loss);
      p.row_loss_stride = 1;
    }
    p.lse_out = static_cast<float*>(call.out.lse.data);
    p.lse_stride = call.out.lse.stride;
    if (p.metrics) {
      p.row_entropy = reinterpret_cast<float*>(base + plan.ws.row_entropy);
      p.row_correct = reinterpret_cast<uint8_t*>(base + plan.ws.row_correct);
    }
  } else {
    p.lse_in = static_cast<const float*>(call.lse_in.data);
    p.lse_in_stride = call.lse_in.stride;
  }
  p.grad_loss = static_cast<const float*>(call.grad_loss.data);
  p.grad_stride = call.grad_loss.stride;
  p.grad_scalar = o.reduction != Reduction::kNone;
  return p;
}

/// The opt-in target check's verdict: the one place a call waits for the device, to report the
/// bad row by name.
Status read_target_check(const BatchScalars* batch, const detail::CeCall& call, cudaStream_t stream) {
  BatchScalars host;
  cudaError_t e = cudaMemcpyAsync(&host, batch, sizeof(host), cudaMemcpyDeviceToHost, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
  if (e != cudaSuccess) return device_error(e, "reading the target check");
  if (host.bad_row == INT64_MAX) return Status::Ok();
  std::ostringstream os;
  os << "target[" << host.bad_row << "] = " << host.bad_value << " is out of range [0, " << call.logits.cols
     << ") and is not ignore_index (" << call.options.ignore_index << ")";
  return Status(StatusCode::kTargetOutOfRange, os.str());
}

/// The stream kernel's parameters under a settled plan.
StreamParams stream_params(const CePlan& plan, const detail::CeCall& call, const RowParams& p, BatchParams bp,
                           char* base) {
  const StreamPlan& s = plan.sp;
  const Options& o = call.options;
  StreamParams sp = {};
  sp.row = p;
  sp.splits = s.splits;
  sp.chunks_per_split = s.chunks_per_split;
  sp.async_reduce = s.async_reduce;
  sp.halves = s.halves;
  sp.grad_backwards = s.grad_backwards;
  if (s.finish) {
    sp.finish = true;
    if (o.reduction != Reduction::kNone || o.return_metrics) fill_finalize(bp, p, call, o);
    sp.fin = bp;
    sp.counters = reinterpret_cast<unsigned long long*>(base + plan.ws.counters);
    sp.block_sums = reinterpret_cast<BatchSums*>(base + plan.ws.block_sums);
    sp.tag = next_call_tag();
    sp.count_den = s.count_den;
  }
  if (s.splits > 1) sp.partials = base + plan.ws.partials;
  if (s.lse_to_workspace) {
    sp.row.lse_out = reinterpret_cast<float*>(base + plan.ws.row_lse);
    sp.row.lse_stride = 1;
  }
  return sp;
}

/// The stream kernel and the passes that complete it: the split-merge pass, and the gradient of
/// split rows by the row kernel from the merged lse. `plan` is settled here (halves need the
/// chosen kernel's cluster occupancy).
Status launch_stream(CePlan plan, const DeviceFacts& dev, const detail::CeCall& call, const RowParams& p,
                     const BatchParams& bp, char* base, cudaStream_t stream) {
  const DType dtype = call.logits.dtype;
  const StreamKernel kernel = select_stream_kernel(dtype, plan.sp.grad, plan.sp.opts, plan.sp.groups);
  cudaError_t e = set_attribute_once(reinterpret_cast<const void*>(kernel), call.device.index,
                                     cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kStreamSmemBytes));
  if (e != cudaSuccess) return device_error(e, "raising the stream kernel's shared memory limit");
  if (plan.sp.want_halves) settle_halves(plan, p.rows, clusters_of_two(kernel, call.device.index), dev);
  const StreamParams sp = stream_params(plan, call, p, bp, base);
  if (sp.halves > 1) {
    e = launch_in_clusters_of_two(kernel, plan.sp.grid, sp, stream);
  } else {
    kernel<<<plan.sp.grid, kStreamThreads, kStreamSmemBytes, stream>>>(sp);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return device_error(e, "the stream kernel launch");
  if (plan.split_merge) {
    // The rows' partials folded into their results (and the batch sums: no finalize pass).
    BatchParams merge = bp;
    fill_finalize(merge, p, call, call.options);
    launch_split_merge(merge, sp.row, sp.partials, plan.sp.splits, stream);
    e = cudaGetLastError();
    if (e != cudaSuccess) return device_error(e, "the split-merge kernel launch");
  }
  if (plan.row_pass) {
    RowParams g = sp.row;
    g.lse_in = sp.row.lse_out;
    g.lse_in_stride = sp.row.lse_stride;
    g.cluster = plan.row.cluster;
    g.pieces = plan.row.pieces;
    RowKernel k = select_row_kernel(dtype, plan.row.items, false, true, plan.extras);
    return launch_row_kernel(k, plan.row, g, call.device.index, stream);
  }
  return Status::Ok();
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
  if (L.cols >= (int64_t(1) << 31) - 64) {
    return Status(StatusCode::kInvalidArgument, "logits: the CUDA backend takes V < 2^31 - 64 columns");
  }
  const DeviceFacts dev = L.rows > 0 ? device_facts(call.device.index) : DeviceFacts{};
  const CePlan plan =
      plan_ce(CeShape{call.job, L.rows, L.cols, L.dtype, call.out.lse.data != nullptr}, o, dev, choices);

  char* base = static_cast<char*>(call.workspace.data);
  if (base == nullptr && plan.ws.total > 0) {
    // No workspace given: stream-ordered scratch (still no host sync, still graph-capturable).
    // Callers on the hot path pass one from cross_entropy_workspace_size instead.
    return with_workspace(plan.ws.total, stream, [&](char* scratch) {
      detail::CeCall with = call;
      with.workspace = Workspace{scratch, plan.ws.total};
      return run(with, choices);
    });
  }
  if (call.workspace.bytes < plan.ws.total) {
    std::ostringstream os;
    os << "workspace has " << call.workspace.bytes << " bytes, this call needs " << plan.ws.total
       << " (ask cross_entropy_workspace_size)";
    return Status(StatusCode::kWorkspaceTooSmall, os.str());
  }
  BatchScalars* batch = reinterpret_cast<BatchScalars*>(base + plan.ws.batch);
  BatchParams bp = batch_params(call, batch);
  bp.count_rows = plan.count_rows;
  if (plan.prepare) {
    launch_prepare(bp, stream);
    const Status s = last_error("the prepare kernel launch");
    if (!s.ok()) return s;
  }
  if (o.check_targets) {
    const Status s = read_target_check(batch, call, stream);
    if (!s.ok()) return s;
  }

  RowParams p = row_params(call, base, plan);
  if (plan.stream) {
    const Status s = launch_stream(plan, dev, call, p, bp, base, stream);
    if (!s.ok()) return s;
  } else if (plan.row_pass) {
    p.cluster = plan.row.cluster;
    p.pieces = plan.row.pieces;
    RowKernel k = select_row_kernel(L.dtype, plan.row.items, plan.row_forward, plan.row_grad, plan.extras);
    const Status s = launch_row_kernel(k, plan.row, p, call.device.index, stream);
    if (!s.ok()) return s;
  }
  if (plan.finalize) {
    fill_finalize(bp, p, call, o);
    launch_finalize(bp, stream);
    return last_error("the finalize kernel launch");
  }
  return Status::Ok();
}

}  // namespace cuda
}  // namespace fusedce
