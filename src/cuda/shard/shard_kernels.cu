// The vocabulary-parallel steps on CUDA (vocab_parallel.h): a shard's per-row statistics, the
// merge of the gathered statistics in rank order, and a shard's gradient. Same formulas as the
// CPU backend (common/numeric.h: lse_merge, LseAccum, row_loss, row_grad); every reduction in a fixed
// order, so results are the same bits run to run and on every rank. No host synchronisation:
// the batch scalars (mean denominator, class-weight sum) stay in device memory.
//
// These are plain one-block-per-row kernels: the statistics read a shard once from device
// memory (a thread's columns twice, the second time from cache), which is what the
// vocabulary-parallel path needs to be correct everywhere; the streaming kernels of the
// whole-vocabulary path are the place to look when this path's speed matters.
#include "cuda/port.h"  // first: the platform's runtime header

#include <cstdint>
#include <cstring>

#include "common/call.h"
#include "common/constants.h"
#include "cuda/host_util.h"
#include "cuda/vec.cuh"

namespace fusedce {
namespace cuda {
namespace {

constexpr int kThreads = 256;

struct ShardParams {
  const void* logits;
  int64_t logits_stride;
  void* dlogits;
  int64_t dlogits_stride;
  const void* target;
  int64_t target_stride;
  bool target_i64;
  int64_t ignore_index;
  int64_t rows, vocab_local, vocab_start;
  const float* class_weight;  // local slice, or null
  int64_t weight_stride;
  detail::LossConstants c;
  bool softcap;
  float* stats;  // step 1: (rows + 1, 9)
  // step 3
  const float* lse;
  int64_t lse_stride;
  const float* row_weight;
  int64_t row_weight_stride;
  const float* batch;  // [mean denominator, class-weight sum]
  int64_t batch_stride;
  const float* grad_loss;
  int64_t grad_stride;
  bool grad_scalar, mean;
};

__device__ int64_t shard_target(const ShardParams& p, int64_t i) {
  return p.target_i64 ? static_cast<const int64_t*>(p.target)[i * p.target_stride]
                      : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[i * p.target_stride]);
}

/// torch.argmax's order: NaN above everything, ties to the lowest index.
__device__ bool argmax_better(float av, int64_t ai, float bv, int64_t bi) {
  const bool an = av != av, bn = bv != bv;
  if (an || bn) return an && (!bn || ai < bi);
  return av > bv || (av == bv && ai < bi);
}

struct Partial {
  detail::LseState st;
  float smooth;
  float best;
  int64_t arg;
};

__device__ Partial combine(const Partial& a, const Partial& b) {
  Partial r;
  r.st = detail::lse_merge(a.st, b.st);
  r.smooth = a.smooth + b.smooth;
  const bool take_b = a.arg < 0 || (b.arg >= 0 && argmax_better(b.best, b.arg, a.best, a.arg));
  r.best = take_b ? b.best : a.best;
  r.arg = take_b ? b.arg : a.arg;
  return r;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) shard_stats_kernel(const ShardParams p) {
  __shared__ Partial part[kThreads];
  const int64_t i = blockIdx.x;
  const int tid = threadIdx.x;
  if (i == p.rows) {
    // The extra row: the shard's class-weight sum (V_local without weights), fixed order.
    __shared__ double wpart[kThreads];
    double w = 0.0;
    for (int64_t j = tid; j < p.vocab_local; j += kThreads) w += p.class_weight ? p.class_weight[j * p.weight_stride] : 1.0;
    wpart[tid] = w;
    __syncthreads();
    for (int s = kThreads / 2; s > 0; s >>= 1) {
      if (tid < s) wpart[tid] += wpart[tid + s];
      __syncthreads();
    }
    if (tid < kShardStatsWidth) p.stats[i * kShardStatsWidth + tid] = tid == 0 ? static_cast<float>(wpart[0]) : 0.0f;
    return;
  }
  float* out = p.stats + i * kShardStatsWidth;
  const int64_t t = shard_target(p, i);
  if (t == p.ignore_index) {
    if (tid < kShardStatsWidth) out[tid] = 0.0f;
    return;
  }
  const T* x = static_cast<const T*>(p.logits) + i * p.logits_stride;
  const int64_t V = p.vocab_local;
  // This thread's columns tid, tid + kThreads, ...: max first, then the sums against it.
  float m = -INFINITY, best = 0.0f;
  int64_t arg = -1;
  for (int64_t j = tid; j < V; j += kThreads) {
    const float z = detail::transform_logit(Elem<T>::to_float(x[j]), p.c, p.softcap);
    m = fmaxf(m, z);  // fmaxf drops NaN: NaN reaches the sums instead, as lse_merge expects
    if (arg < 0 || argmax_better(z, j, best, arg)) {
      best = z;
      arg = j;
    }
  }
  const float ref = detail::lse_ref(m);
  // A thread's sums run over V_local / kThreads columns: in double, so their rounding does not
  // grow with the shard (float32 sums of 2^16 terms lose about 1e-5).
  double s = 0.0, ez = 0.0, smooth = 0.0;
  for (int64_t j = tid; j < V; j += kThreads) {
    const float z = detail::transform_logit(Elem<T>::to_float(x[j]), p.c, p.softcap);
    const float e = expf(z - ref);
    s += e;
    if (e > 0.0f) ez += static_cast<double>(e) * z;  // 0, not 0 * -inf
    smooth += p.class_weight ? static_cast<double>(p.class_weight[j * p.weight_stride]) * z : z;
  }
  part[tid] = Partial{detail::LseState{m, static_cast<float>(s), static_cast<float>(ez)}, static_cast<float>(smooth),
                      best, arg};
  __syncthreads();
  for (int k = kThreads / 2; k > 0; k >>= 1) {
    if (tid < k) part[tid] = combine(part[tid], part[tid + k]);
    __syncthreads();
  }
  if (tid == 0) {
    const Partial r = part[0];
    const int64_t tl = t - p.vocab_start;
    const bool holds = tl >= 0 && tl < V;
    out[0] = r.st.m;
    out[1] = r.st.s;
    out[2] = r.st.ez;
    out[3] = holds ? detail::transform_logit(Elem<T>::to_float(x[tl]), p.c, p.softcap) : 0.0f;
    out[4] = holds ? 1.0f : 0.0f;
    out[5] = r.smooth;
    out[6] = r.arg >= 0 ? r.best : -INFINITY;
    const int32_t gi = static_cast<int32_t>((r.arg >= 0 ? r.arg : 0) + p.vocab_start);
    memcpy(&out[7], &gi, sizeof(gi));
    out[8] = holds ? (p.class_weight ? p.class_weight[tl * p.weight_stride] : 1.0f) : 0.0f;
  }
}

struct MergeParams {
  const float* gathered;
  int64_t world, rows;
  const void* target;
  int64_t target_stride;
  bool target_i64;
  int64_t shift;  // the linear form's causal shift (rows per sequence), 0 = none
  int64_t ignore_index;
  bool weighted;
  detail::LossConstants c;  // weight_sum filled in on the device
  int reduction;
  float* loss;
  int64_t loss_stride;
  float* lse;
  int64_t lse_stride;
  float* row_weight;
  int64_t row_weight_stride;
  float* batch;
  int64_t batch_stride;
  int64_t* num_correct;  // or null
  float* entropy_sum;
};

constexpr int kMergeThreads = 1024;

__global__ void __launch_bounds__(kMergeThreads) shard_merge_kernel(const MergeParams p) {
  __shared__ double s_total[kMergeThreads], s_den[kMergeThreads], s_ent[kMergeThreads];
  __shared__ long long s_cor[kMergeThreads];
  __shared__ float s_w;
  const int tid = threadIdx.x;
  const int64_t N = p.rows;
  auto row = [&](int64_t r, int64_t i) { return p.gathered + (r * (N + 1) + i) * kShardStatsWidth; };
  if (tid == 0) {
    double w = 0.0;
    for (int64_t r = 0; r < p.world; ++r) w += row(r, N)[0];  // rank order
    s_w = static_cast<float>(w);
  }
  __syncthreads();
  detail::LossConstants c = p.c;
  c.weight_sum = s_w;
  double total = 0.0, den = 0.0, ent = 0.0;
  long long cor = 0;
  for (int64_t i = tid; i < N; i += kMergeThreads) {
    const bool dropped = p.shift > 0 && i % p.shift == p.shift - 1;  // the last row of a sequence
    const int64_t e = p.shift > 0 && !dropped ? i + 1 : i;               // the target entry it takes
    const int64_t t = dropped        ? p.ignore_index
                      : p.target_i64 ? static_cast<const int64_t*>(p.target)[e * p.target_stride]
                                     : static_cast<int64_t>(static_cast<const int32_t*>(p.target)[e * p.target_stride]);
    if (t == p.ignore_index) {
      if (p.reduction == static_cast<int>(Reduction::kNone)) p.loss[i * p.loss_stride] = 0.0f;
      p.lse[i * p.lse_stride] = 0.0f;
      p.row_weight[i * p.row_weight_stride] = 0.0f;
      continue;
    }
    detail::LseAccum st = detail::lse_accum_empty();
    double smooth = 0.0;
    float z_t = NAN, w_t = NAN, best = 0.0f;
    int64_t arg = INT64_MAX;
    for (int64_t r = 0; r < p.world; ++r) {
      const float* q = row(r, i);
      detail::lse_accum_add(st, detail::LseState{q[0], q[1], q[2]});
      smooth += q[5];
      if (q[4] != 0.0f) {
        z_t = q[3];
        w_t = q[8];
      }
      int32_t ai;
      memcpy(&ai, &q[7], sizeof(ai));
      if (arg == INT64_MAX || argmax_better(q[6], ai, best, arg)) {
        best = q[6];
        arg = ai;
      }
    }
    if (!p.weighted) w_t = 1.0f;
    const float lse = detail::lse_accum_value(st);
    const float loss = detail::row_loss(c, lse, z_t, w_t, static_cast<float>(smooth), p.weighted);
    if (p.reduction == static_cast<int>(Reduction::kNone)) p.loss[i * p.loss_stride] = loss;
    p.lse[i * p.lse_stride] = lse;
    p.row_weight[i * p.row_weight_stride] = w_t;
    total += loss;
    den += w_t;
    ent += detail::lse_accum_entropy(st);
    cor += arg == t;
  }
  s_total[tid] = total;
  s_den[tid] = den;
  s_ent[tid] = ent;
  s_cor[tid] = cor;
  __syncthreads();
  for (int k = kMergeThreads / 2; k > 0; k >>= 1) {
    if (tid < k) {
      s_total[tid] += s_total[tid + k];
      s_den[tid] += s_den[tid + k];
      s_ent[tid] += s_ent[tid + k];
      s_cor[tid] += s_cor[tid + k];
    }
    __syncthreads();
  }
  if (tid == 0) {
    if (p.reduction != static_cast<int>(Reduction::kNone)) {
      const double v = p.reduction == static_cast<int>(Reduction::kMean) ? s_total[0] / s_den[0] : s_total[0];
      p.loss[0] = static_cast<float>(v);
    }
    if (p.num_correct) {
      *p.num_correct = s_cor[0];
      *p.entropy_sum = static_cast<float>(s_ent[0]);
    }
    p.batch[0] = static_cast<float>(s_den[0]);
    p.batch[p.batch_stride] = s_w;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) shard_backward_kernel(const ShardParams p) {
  const int64_t i = blockIdx.x;
  const int64_t V = p.vocab_local;
  const T* x = static_cast<const T*>(p.logits) + i * p.logits_stride;
  T* dx = static_cast<T*>(p.dlogits) + i * p.dlogits_stride;
  const int64_t t = shard_target(p, i);
  if (t == p.ignore_index) {
    for (int64_t j = threadIdx.x; j < V; j += kThreads) dx[j] = Elem<T>::from_float(0.0f);
    return;
  }
  detail::LossConstants c = p.c;
  c.weight_sum = p.batch[p.batch_stride];
  const float g_chain = p.mean ? 1.0f / p.batch[0] : 1.0f;
  const float g = g_chain * p.grad_loss[p.grad_scalar ? 0 : i * p.grad_stride];
  const float lse = p.lse[i * p.lse_stride];
  const float w_t = p.row_weight[i * p.row_weight_stride];
  const detail::RowGrad rg = detail::row_grad(c, lse, w_t, g);
  const int64_t tl = t - p.vocab_start;
  for (int64_t j = threadIdx.x; j < V; j += kThreads) {
    // Read every logit before any store: dlogits may be the logits themselves.
    const float z = detail::transform_logit(Elem<T>::to_float(x[j]), c, p.softcap);
    const float pj = expf(z - lse);
    const float wj = p.class_weight ? p.class_weight[j * p.weight_stride] : 1.0f;
    float d = rg.g_a * pj - rg.g_c * wj;
    if (j == tl) d -= rg.g_bt;
    dx[j] = Elem<T>::from_float(d * detail::dz_dx(z, c, p.softcap));
  }
}

ShardParams shard_params(const detail::ShardCall& call) {
  const Options& o = call.options;
  ShardParams p{};
  p.logits = call.logits.data;
  p.logits_stride = call.logits.row_stride;
  p.target = call.target.data;
  p.target_stride = call.target.stride;
  p.target_i64 = call.target.dtype == DType::kInt64;
  p.ignore_index = o.ignore_index;
  p.rows = call.target.size;
  p.vocab_local = call.logits.cols;
  p.vocab_start = call.shard.vocab_start;
  p.class_weight = static_cast<const float*>(o.class_weight.data);
  p.weight_stride = o.class_weight.stride;
  p.c = detail::make_loss_constants(o, call.shard.vocab_total, 0.0f);
  p.softcap = o.softcap > 0.0f;
  return p;
}

template <typename T>
void launch_stats(const ShardParams& p, cudaStream_t s) {
  shard_stats_kernel<T><<<static_cast<unsigned>(p.rows + 1), kThreads, 0, s>>>(p);
}

template <typename T>
void launch_backward(const ShardParams& p, cudaStream_t s) {
  if (p.rows > 0) shard_backward_kernel<T><<<static_cast<unsigned>(p.rows), kThreads, 0, s>>>(p);
}

}  // namespace

Status run_shard(const detail::ShardCall& call) {
  DType d = call.logits.dtype;
  cudaStream_t stream = static_cast<cudaStream_t>(call.device.stream);
  DeviceGuard guard(call.device.index);
  (void)cudaGetLastError();  // an earlier, unrelated error must not be reported as ours
  Status st;
  if (call.step == 1) {
    ShardParams p = shard_params(call);
    p.stats = static_cast<float*>(call.stats.data);
    if (d == DType::kFloat32) launch_stats<float>(p, stream);
    else if (d == DType::kBFloat16) launch_stats<BFloat16>(p, stream);
    else launch_stats<Half>(p, stream);
    st = last_error("the shard statistics kernel");
  } else if (call.step == 2) {
    const Options& o = call.options;
    MergeParams m{};
    m.gathered = static_cast<const float*>(call.stats.data);
    m.world = call.world;
    m.rows = call.target.size;
    m.target = call.target.data;
    m.target_stride = call.target.stride;
    m.target_i64 = call.target.dtype == DType::kInt64;
    m.shift = call.shift_seq_len;
    m.ignore_index = o.ignore_index;
    m.weighted = !o.class_weight.empty() || o.class_weight.size != 0;
    m.c = detail::make_loss_constants(o, call.shard.vocab_total, 0.0f);
    m.reduction = static_cast<int>(o.reduction);
    m.loss = static_cast<float*>(call.out.loss.data);
    m.loss_stride = call.out.loss.stride;
    m.lse = static_cast<float*>(call.out.lse.data);
    m.lse_stride = call.out.lse.stride;
    m.row_weight = static_cast<float*>(call.row_weight.data);
    m.row_weight_stride = call.row_weight.stride;
    m.batch = static_cast<float*>(call.batch.data);
    m.batch_stride = call.batch.stride;
    if (o.return_metrics) {
      m.num_correct = static_cast<int64_t*>(call.out.num_correct.data);
      m.entropy_sum = static_cast<float*>(call.out.entropy_sum.data);
    }
    shard_merge_kernel<<<1, kMergeThreads, 0, stream>>>(m);
    st = last_error("the shard merge kernel");
  } else {
    const Options& o = call.options;
    ShardParams p = shard_params(call);
    p.dlogits = call.dlogits.data;
    p.dlogits_stride = call.dlogits.row_stride;
    p.lse = static_cast<const float*>(call.lse.data);
    p.lse_stride = call.lse.stride;
    p.row_weight = static_cast<const float*>(call.row_weight.data);
    p.row_weight_stride = call.row_weight.stride;
    p.batch = static_cast<const float*>(call.batch.data);
    p.batch_stride = call.batch.stride;
    p.grad_loss = static_cast<const float*>(call.grad_loss.data);
    p.grad_stride = call.grad_loss.stride;
    p.grad_scalar = o.reduction != Reduction::kNone;
    p.mean = o.reduction == Reduction::kMean;
    if (d == DType::kFloat32) launch_backward<float>(p, stream);
    else if (d == DType::kBFloat16) launch_backward<BFloat16>(p, stream);
    else launch_backward<Half>(p, stream);
    st = last_error("the shard backward kernel");
  }
  return st;
}

}  // namespace cuda
}  // namespace fusedce
