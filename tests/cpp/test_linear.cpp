// Fused linear cross-entropy (CPU backend) against a float64 reference built here from the
// formulas of docs/contract.md: logits = hidden . weight^T + bias in double, then the
// cross-entropy terms, then grad_hidden = dX . W, grad_weight = dX^T . hidden,
// grad_bias = colsum(dX).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cmath>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fusedce/fusedce.h"
#include "backend.h"
#include "cuda/linear/size_ladder.h"
#include "linear_form.h"
#include "problem.h"

namespace fusedce_test {
namespace {

using fusedce::DType;
using fusedce::Reduction;

struct LinCase {
  std::string name;
  int64_t N, H, V;
  fusedce::Options o;
  bool bias = false;
  int64_t shift = 0;
};

struct RefResult {
  std::vector<double> loss_rows, lse;  // N
  double loss = 0.0, entropy = 0.0;
  int64_t correct = 0;
  std::vector<double> gh, gw, gb;
  // How far each output may move when the 16-bit logits with a bias are rounded the other way
  // (see reference()); zero everywhere else. Added to the tolerance, element by element.
  std::vector<double> loss_rows_b, lse_b, gh_b, gw_b, gb_b;
  double loss_b = 0.0, entropy_b = 0.0;
};

// The float64 reference. Inputs are the already rounded values (exact in double).
// `logits_dtype`: the dtype each logit is rounded to before the cross-entropy, and each dlogit
// before the gradient products (the CUDA backend keeps a 16-bit input's logits and dlogits in that
// dtype, as PyTorch's bf16 matmuls do); float32 = no rounding beyond float32's, which is far below
// every tolerance here.
// A 16-bit logit with a bias comes out of the GPU's products rounded once, round(h . w + b), or
// twice, round(round(h . w) + b), and which depends on the kernel: on an H200, cuBLASLt's bias
// epilogue rounded twice at N37 H19 V300 (a 5% miss on the columns of confident rows against the
// once-rounded reference, matched to 4 digits by the twice-rounded one) and once at N133 H72 V1000;
// low_memory's separate bias pass rounds twice. PyTorch's F.linear with a bias makes the same
// cuBLASLt call. The reference takes the once-rounded logit and, where the two roundings differ
// (by one unit of the dtype), carries the first-order bound of how far that unit moves each
// output: the probabilities of the row through p_j ((1 - p_j) d_j + sum_{l != j} p_l d_l), the lse by
// sum_l p_l d_l, the entropy by sum_l p_l |z_l - E z| d_l (d: the logit's change times dz/dx).
// Only those logits widen the tolerance, and only the outputs they feed.
// `gpu_float32`: the CUDA backend's float32 path. Its logits come from cuBLASLt's float32 sums,
// whose order differs from any the reference could mirror: each logit may sit up to about
// sqrt(H) float32 roundoffs of sum_h |h w| from the exact value (a random walk of H roundings, 2x
// for margin), and that move reaches every output through the same first-order bound as above;
// its dlogits carry a few roundoffs of their own (the exponential and the products), which the
// gradient sums add up over |dlogit| |operand|, not over the (cancelling) sums themselves.
constexpr double kU32 = 5.9604644775390625e-08;  // 2^-24, float32's unit roundoff

RefResult reference(const LinCase& lc, const std::vector<double>& hid, const std::vector<double>& w,
                    const std::vector<double>& b, const std::vector<int64_t>& tgt, const std::vector<double>& cw,
                    const std::vector<double>& up, DType logits_dtype = DType::kFloat32, bool gpu_float32 = false) {
  const int64_t N = lc.N, H = lc.H, V = lc.V;
  const fusedce::Options& o = lc.o;
  RefResult r;
  r.loss_rows.assign(N, 0.0);
  r.lse.assign(N, 0.0);
  r.gh.assign(N * H, 0.0);
  r.gw.assign(V * H, 0.0);
  r.gb.assign(V, 0.0);
  r.loss_rows_b.assign(N, 0.0);
  r.lse_b.assign(N, 0.0);
  r.gh_b.assign(N * H, 0.0);
  r.gw_b.assign(V * H, 0.0);
  r.gb_b.assign(V, 0.0);
  auto wc = [&](int64_t j) { return cw.empty() ? 1.0 : cw[j]; };
  double W = 0.0, den = 0.0;
  for (int64_t j = 0; j < V; ++j) W += wc(j);
  auto eff = [&](int64_t i) -> int64_t {
    if (lc.shift > 0) return i % lc.shift == lc.shift - 1 ? o.ignore_index : tgt[i + 1];
    return tgt[i];
  };
  for (int64_t i = 0; i < N; ++i)
    if (eff(i) != o.ignore_index) den += wc(eff(i));
  const double eps = o.label_smoothing;
  const bool two_roundings = logits_dtype != DType::kFloat32 && lc.bias;
  std::vector<double> z(V), x(V), dzdx(V), dz_unit(V);
  double loss_b_total = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t t = eff(i);
    if (t == o.ignore_index) continue;
    double m = -INFINITY;
    std::vector<double> dx_unit(V, 0.0);  // |x_once - x_twice|
    for (int64_t j = 0; j < V; ++j) {
      double acc = 0.0, abs_acc = 0.0;
      for (int64_t h = 0; h < H; ++h) {
        acc += hid[i * H + h] * w[j * H + h];
        abs_acc += std::fabs(hid[i * H + h] * w[j * H + h]);
      }
      if (gpu_float32) dx_unit[j] = 2 * std::sqrt(static_cast<double>(H)) * kU32 * (abs_acc + (lc.bias ? std::fabs(b[j]) : 0.0));
      if (logits_dtype != DType::kFloat32) {
        const double once = round_to(logits_dtype, static_cast<float>(acc + (lc.bias ? b[j] : 0.0)));
        if (two_roundings) {
          const double twice = round_to(logits_dtype, static_cast<float>(round_to(logits_dtype, static_cast<float>(acc)) + b[j]));
          dx_unit[j] = std::fabs(once - twice);
        }
        acc = once;
      } else if (lc.bias) {
        acc += b[j];
      }
      x[j] = acc;
      z[j] = o.softcap > 0 ? o.softcap * std::tanh(o.logit_scale * acc / o.softcap) : o.logit_scale * acc;
      dzdx[j] = o.softcap > 0 ? o.logit_scale * (1 - std::pow(z[j] / o.softcap, 2)) : o.logit_scale;
      dz_unit[j] = dzdx[j] * dx_unit[j];
      m = std::max(m, z[j]);
    }
    double s = 0.0, pz = 0.0, smooth = 0.0;
    int64_t am = 0;
    for (int64_t j = 0; j < V; ++j) {
      s += std::exp(z[j] - m);
      smooth += wc(j) * z[j];
      if (z[j] > z[am]) am = j;
    }
    const double lse = m + std::log(s);
    double lse_b = 0.0, ent_b = 0.0, smooth_b = 0.0;
    for (int64_t j = 0; j < V; ++j) {
      pz += std::exp(z[j] - lse) * z[j];
      lse_b += std::exp(z[j] - lse) * dz_unit[j];
      smooth_b += wc(j) * dz_unit[j];
    }
    for (int64_t j = 0; j < V; ++j) ent_b += std::exp(z[j] - lse) * std::fabs(z[j] - pz) * dz_unit[j];
    double loss = (1 - eps) * wc(t) * (lse - z[t]);
    if (eps != 0) loss += eps / V * (W * lse - smooth);
    loss += o.z_loss * lse * lse;
    r.loss_rows[i] = loss;
    r.lse[i] = lse;
    r.entropy += lse - pz;
    r.correct += am == t;
    r.lse_b[i] = lse_b;
    r.loss_rows_b[i] = (1 - eps) * wc(t) * (lse_b + dz_unit[t]) + eps / V * (W * lse_b + smooth_b) +
                       2 * o.z_loss * std::fabs(lse) * lse_b;
    loss_b_total += r.loss_rows_b[i];
    r.entropy_b += ent_b;
    const double g = (o.reduction == Reduction::kMean ? 1.0 / den : 1.0) * (up.empty() ? 1.0 : up[o.reduction == Reduction::kNone ? i : 0]);
    const double a = (1 - eps) * wc(t) + eps / V * W + 2 * o.z_loss * lse;
    for (int64_t j = 0; j < V; ++j) {
      const double p = std::exp(z[j] - lse);
      const double dz = g * (a * p - (j == t ? (1 - eps) * wc(t) : 0.0) - eps / V * wc(j));
      double dx = dz * dzdx[j];
      // Bound of dx's move: p's, p ((1 - p) d_j + sum_{l != j} p_l d_l) = p (d_j + lse_b - 2 p d_j),
      // times a; the z-loss term's 2 z_loss p lse_b; under a soft-cap, dz/dx's own (its
      // derivative in x: 2 s^2 |z| / c^2).
      const double p_move = p * std::max(0.0, dz_unit[j] + lse_b - 2 * p * dz_unit[j]);
      double move = std::fabs(g) * (std::fabs(a) * p_move + 2 * o.z_loss * p * lse_b) * dzdx[j];
      if (o.softcap > 0) move += std::fabs(dz) * 2 * o.logit_scale * o.logit_scale * std::fabs(z[j]) / (o.softcap * o.softcap) * dx_unit[j];
      if (gpu_float32) move += 4 * kU32 * std::fabs(dx);
      // The CUDA backend's 16-bit path holds dlogits in the dtype for the gradient products.
      if (logits_dtype != DType::kFloat32) dx = round_to(logits_dtype, static_cast<float>(dx));
      r.gb[j] += dx;
      r.gb_b[j] += move;
      for (int64_t h = 0; h < H; ++h) {
        r.gh[i * H + h] += dx * w[j * H + h];
        r.gw[j * H + h] += dx * hid[i * H + h];
        if (move != 0.0) {
          r.gh_b[i * H + h] += move * std::fabs(w[j * H + h]);
          r.gw_b[j * H + h] += move * std::fabs(hid[i * H + h]);
        }
      }
    }
  }
  double total = 0.0;
  for (double l : r.loss_rows) total += l;
  r.loss = o.reduction == Reduction::kMean ? total / den : total;
  r.loss_b = o.reduction == Reduction::kMean ? loss_b_total / den : loss_b_total;
  return r;
}

struct Tol {
  double rtol, atol;  // allowed |got - ref|: rtol |ref| + atol max|ref| (+ the reference's budget)
  double floor = 0.0; // + an absolute floor
};
Tol loss_tol(DType) { return {2e-5, 2e-6}; }
// The CUDA backend's 16-bit logits: the reference rounds them too, but its double sums may round
// a logit one unit of the dtype away from the GPU's float32 sums (rarely; on a target logit that
// moves the row's loss by that unit).
Tol loss_tol_cuda16(DType d) { return d == DType::kBFloat16 ? Tol{8e-3, 1e-3} : Tol{1e-3, 2e-4}; }

/// Unit roundoff of a dtype: rounding to nearest moves a value x by at most u |x| (2^-24 float32,
/// 2^-8 bfloat16, 2^-11 float16; float16 below 2^-14 by at most half its subnormal step 2^-24).
double unit_roundoff(DType d) {
  return std::ldexp(1.0, d == DType::kFloat32 ? -24 : d == DType::kBFloat16 ? -8 : -11);
}

/// Gradients, formed in float32 and rounded once to the dtype: rtol = u of the dtype (that one
/// rounding, relative to the element); atol = 2 sqrt(K) float32 roundoffs of the output's
/// largest magnitude, K = N + H + V the summed length of the sums behind an element (the logits
/// over H, grad_hidden over V, grad_weight and grad_bias over N), whose float32 rounding errors
/// add like a random walk, twice that for margin; float16's subnormal floor. The CPU grid's worst
/// elements (K up to 2064) reach u relative in 16 bits and 1.9e-6 of the largest in float32
/// (sqrt(K) u32 is 2.7e-6 there), so a 0.5% bfloat16 scale error or a 1e-5 float32 one fails.
Tol grad_tol(DType d, const LinCase& lc) {
  const double u32 = unit_roundoff(DType::kFloat32);
  return {unit_roundoff(d), 2 * std::sqrt(static_cast<double>(lc.N + lc.H + lc.V)) * u32,
          d == DType::kFloat16 ? std::ldexp(1.0, -25) : 0.0};
}
// The CUDA backend's 16-bit path keeps logits and dlogits in the dtype, and the reference rounds
// them as it does, so the relative part is grad_tol's (the output's one rounding). What the
// reference cannot reproduce is a value its double sums round one unit of the dtype away from
// the GPU's float32 sums: a flipped logit or dlogit moves an element by up to a few units of the
// largest term (in bfloat16 a dominant logit's dlogit by about 1% of the largest gradient
// entry): atol 2.56 u in bfloat16 (1e-2), 2 u in float16 (about 1e-3).
Tol grad_tol_cuda16(DType d, const LinCase& lc) {
  const Tol cpu = grad_tol(d, lc);
  return {cpu.rtol, d == DType::kBFloat16 ? 1e-2 : 2 * unit_roundoff(d), cpu.floor};
}

/// `budget` (empty, or one per element): what the reference's rounding bound adds to element k.
void expect_close(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref, Tol t,
                  const std::vector<double>& budget = {}) {
  double scale = 0.0;
  for (double v : ref) scale = std::max(scale, std::fabs(v));
  int bad = 0;
  for (size_t k = 0; k < ref.size(); ++k) {
    const double allowed = t.rtol * std::fabs(ref[k]) + t.atol * scale + t.floor + (budget.empty() ? 0.0 : budget[k]);
    if (std::isnan(ref[k]) && std::isnan(got[k])) continue;  // NaN must meet NaN
    if (!(std::fabs(got[k] - ref[k]) <= allowed)) {
      if (++bad <= 3) ADD_FAILURE() << what << "[" << k << "]: got " << got[k] << ", reference " << ref[k] << " (allowed " << allowed << ")";
    }
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << ref.size() << " mismatch";
}

struct LinRun {
  std::vector<float> loss, lse;
  float entropy = 0;
  int64_t correct = 0;
  std::vector<uint8_t> gh, gw, gb;
};

/// Rows of `cols` elements of `el` bytes, contiguous, spread to a row stride of cols + pad
/// (the gaps hold poison), or gathered back.
std::vector<uint8_t> spread_rows(const std::vector<uint8_t>& v, int64_t cols, int64_t pad, size_t el) {
  if (pad == 0) return v;
  const int64_t rows = static_cast<int64_t>(v.size() / (cols * el));
  std::vector<uint8_t> out(rows * (cols + pad) * el, 0xCD);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&out[r * (cols + pad) * el], &v[r * cols * el], cols * el);
  return out;
}
std::vector<uint8_t> gather_rows(const std::vector<uint8_t>& v, int64_t rows, int64_t cols, int64_t pad, size_t el) {
  std::vector<uint8_t> out(rows * cols * el);
  for (int64_t r = 0; r < rows; ++r) std::memcpy(&out[r * cols * el], &v[r * (cols + pad) * el], cols * el);
  return out;
}

/// One forward_backward on `backend` (inputs copied to its memory, results copied back).
/// `pad` > 0: hidden, weight, grad_hidden and grad_weight with rows strided by H + pad.
LinRun run(Backend& backend, const LinCase& lc, DType d, const std::vector<uint8_t>& hid, const std::vector<uint8_t>& w,
           const std::vector<uint8_t>& b, const std::vector<int64_t>& tgt, const std::vector<float>& cw,
           const std::vector<float>& up, bool metrics, fusedce::Status* status, bool skip_ignored = false,
           bool low_memory = false, size_t budget = 0, int64_t pad = 0) {
  LinRun r;
  const int64_t N = lc.N, H = lc.H, V = lc.V, ld = H + pad;
  const size_t el = elem_size(d);
  fusedce::Options o = lc.o;
  o.return_metrics = metrics;
  DeviceBuffer d_hid = DeviceBuffer::from_vector(backend, spread_rows(hid, H, pad, el)),
               d_w = DeviceBuffer::from_vector(backend, spread_rows(w, H, pad, el)),
               d_b = DeviceBuffer::from_vector(backend, b), d_t = DeviceBuffer::from_vector(backend, tgt),
               d_cw = DeviceBuffer::from_vector(backend, cw), d_up = DeviceBuffer::from_vector(backend, up);
  if (!cw.empty()) o.class_weight = fusedce::vector(d_cw.data(), DType::kFloat32, V);
  const int64_t loss_n = o.reduction == Reduction::kNone ? N : 1;
  // Outputs start as poison: whatever the call does not write shows up as a mismatch.
  DeviceBuffer d_loss(backend, loss_n * 4), d_lse(backend, N * 4), d_ent(backend, 4), d_cor(backend, 8),
      d_gh(backend, N * ld * el), d_gw(backend, V * ld * el), d_gb(backend, V * el);
  for (DeviceBuffer* buf : {&d_loss, &d_lse, &d_ent, &d_cor, &d_gh, &d_gw, &d_gb}) buf->fill(0xCD);
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(d_loss.data(), DType::kFloat32, loss_n);
  out.lse = fusedce::vector(d_lse.data(), DType::kFloat32, N);
  if (metrics) {
    out.num_correct = fusedce::vector(d_cor.data(), DType::kInt64, 1);
    out.entropy_sum = fusedce::vector(d_ent.data(), DType::kFloat32, 1);
  }
  fusedce::LinearOptions lo;
  lo.shift_seq_len = lc.shift;
  lo.skip_ignored = skip_ignored;
  lo.low_memory = low_memory;
  // A small chunk budget on the GPU, so that several chunks (and a ragged last one) run; the CPU
  // takes the budget given (0: its default, one chunk at these sizes).
  if (backend.kind() == BackendKind::kCuda) lo.chunk_budget_bytes = budget ? budget : size_t(7) * V * el + 3;
  if (backend.kind() == BackendKind::kCpu) lo.chunk_budget_bytes = budget;
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(d_gh.data(), d, N, H, ld);
  g.grad_weight = fusedce::matrix(d_gw.data(), d, V, H, ld);
  if (lc.bias) g.grad_bias = fusedce::vector(d_gb.data(), d, V);
  *status = fusedce::linear_cross_entropy_forward_backward(
      backend.device(), fusedce::matrix(d_hid.data(), d, N, H, ld), fusedce::matrix(d_w.data(), d, V, H, ld),
      lc.bias ? fusedce::vector(d_b.data(), d, V) : fusedce::VectorView{},
      fusedce::vector(d_t.data(), DType::kInt64, N), o, lo, out,
      up.empty() ? fusedce::VectorView{} : fusedce::vector(d_up.data(), DType::kFloat32, up.size()), g);
  backend.synchronize();
  r.loss = d_loss.to_host_as<float>();
  r.loss.resize(loss_n);
  r.lse = d_lse.to_host_as<float>();
  r.lse.resize(N);
  if (metrics) {
    d_ent.download(&r.entropy, 4);
    d_cor.download(&r.correct, 8);
  }
  r.gh = gather_rows(d_gh.to_host(), N, H, pad, el);
  r.gw = gather_rows(d_gw.to_host(), V, H, pad, el);
  r.gb = d_gb.to_host();
  r.gb.resize(V * el);
  if (!lc.bias) r.gb.assign(V * el, 0);
  return r;
}

std::vector<LinCase> cases() {
  std::vector<LinCase> v;
  // N=3, H=67, V=1001: odd everything (no vector width divides H or V); smaller shapes carry the
  // option grid. N=133, H=72, V=1000: rows that TMA can address (H and V multiples of 8), so on
  // Hopper the bf16 products run as CUTLASS kernels, over ragged tiles in every dimension.
  for (auto shape : {std::array<int64_t, 3>{3, 67, 1001}, std::array<int64_t, 3>{37, 19, 300},
                     std::array<int64_t, 3>{133, 72, 1000}}) {
    auto add = [&](std::string name, auto tweak) {
      LinCase c;
      c.N = shape[0];
      c.H = shape[1];
      c.V = shape[2];
      c.name = name + "_N" + std::to_string(c.N) + "_H" + std::to_string(c.H) + "_V" + std::to_string(c.V);
      tweak(c);
      v.push_back(c);
    };
    add("plain", [](LinCase&) {});
    add("label_smoothing", [](LinCase& c) { c.o.label_smoothing = 0.1f; });
    add("logit_scale", [](LinCase& c) { c.o.logit_scale = 0.7f; });
    add("softcap", [](LinCase& c) { c.o.softcap = 3.0f; });
    add("z_loss", [](LinCase& c) { c.o.z_loss = 1e-2f; });
    add("class_weight", [](LinCase& c) { c.o.label_smoothing = 0.05f; c.name += "_w"; });
    add("bias", [](LinCase& c) { c.bias = true; });
    add("sum", [](LinCase& c) { c.o.reduction = Reduction::kSum; });
    add("none", [](LinCase& c) { c.o.reduction = Reduction::kNone; });
    add("all", [](LinCase& c) {
      c.o.label_smoothing = 0.1f;
      c.o.logit_scale = 0.9f;
      c.o.softcap = 5.0f;
      c.o.z_loss = 1e-3f;
      c.bias = true;
    });
  }
  LinCase s;
  s.name = "shift_N40_H16_V97";
  s.N = 40;
  s.H = 16;
  s.V = 97;
  s.shift = 8;
  s.bias = true;
  v.push_back(s);
  return v;
}

/// One random problem's inputs in the test's dtype and, read back from it, in float64: hidden
/// N(0, 1); weights scaled to logits of a few units with one entry in 50 four times larger (so
/// the softmax is not flat); bias N(0, 1); class weights in [0.25, 2.23) when asked for; the
/// upstream gradient, one per row (reduction none) or one scalar.
struct LinInputs {
  std::vector<uint8_t> hid, w, b;
  std::vector<double> hd, wd, bd, cwd, upd;
  std::vector<float> cw, up;
};

LinInputs random_inputs(int64_t N, int64_t H, int64_t V, DType d, bool class_weight, bool per_row_up,
                        std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  LinInputs in;
  in.hid.resize(N * H * elem_size(d));
  in.w.resize(V * H * elem_size(d));
  in.b.resize(V * elem_size(d));
  in.hd.resize(N * H);
  in.wd.resize(V * H);
  in.bd.resize(V);
  for (int64_t k = 0; k < N * H; ++k) {
    store_value(in.hid.data(), d, k, normal(rng));
    in.hd[k] = load_value(in.hid.data(), d, k);
  }
  const float wscale = 2.0f / std::sqrt(static_cast<float>(H));
  for (int64_t k = 0; k < V * H; ++k) {
    store_value(in.w.data(), d, k, normal(rng) * wscale * (rng() % 50 == 0 ? 4.0f : 1.0f));
    in.wd[k] = load_value(in.w.data(), d, k);
  }
  for (int64_t j = 0; j < V; ++j) {
    store_value(in.b.data(), d, j, normal(rng));
    in.bd[j] = load_value(in.b.data(), d, j);
  }
  if (class_weight) {
    in.cw.resize(V);
    for (auto& x : in.cw) x = 0.25f + static_cast<float>(rng() % 100) / 50.0f;
    in.cwd.assign(in.cw.begin(), in.cw.end());
  }
  if (per_row_up) {
    in.up.resize(N);
    for (auto& u : in.up) u = 0.5f + static_cast<float>(rng() % 100) / 100.0f;
  } else {
    in.up = {1.75f};
  }
  in.upd.assign(in.up.begin(), in.up.end());
  return in;
}

/// Points about half the counted rows' targets at the row's argmax ("a confident right answer",
/// as a trained model's rows often are), so that num_correct is more than the zero that random
/// targets over hundreds of classes almost always give. Only rows whose top logit clears the
/// second by 5% of its size: no rounding of the logits to 16 bits can change their argmax.
void confident_targets(const LinCase& lc, const LinInputs& in, std::mt19937_64& rng, std::vector<int64_t>* tgt) {
  const int64_t N = lc.N, H = lc.H, V = lc.V;
  for (int64_t i = 0; i < N; ++i) {
    if (lc.shift > 0 && i % lc.shift == lc.shift - 1) continue;  // no next token: not counted
    double top = -INFINITY, second = -INFINITY;
    int64_t am = 0;
    for (int64_t j = 0; j < V; ++j) {
      double x = lc.bias ? in.bd[j] : 0.0;
      for (int64_t h = 0; h < H; ++h) x += in.hd[i * H + h] * in.wd[j * H + h];
      if (x > top) {
        second = top;
        top = x;
        am = j;
      } else {
        second = std::max(second, x);
      }
    }
    if (rng() % 2 == 0 && top - second > 0.05 * std::max(1.0, std::fabs(top))) (*tgt)[lc.shift > 0 ? i + 1 : i] = am;
  }
}

class LinearGrid : public ::testing::TestWithParam<std::tuple<LinCase, DType, BackendKind>> {};

TEST_P(LinearGrid, MatchesFloat64Reference) {
  const LinCase& lc = std::get<0>(GetParam());
  const DType d = std::get<1>(GetParam());
  std::string why;
  Backend* backend = find_backend(std::get<2>(GetParam()), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const bool cuda16 = backend->kind() == BackendKind::kCuda && d != DType::kFloat32;
  std::mt19937_64 rng = test_rng();
  const int64_t N = lc.N, H = lc.H, V = lc.V;
  const LinInputs in = random_inputs(N, H, V, d, lc.name.rfind("class_weight", 0) == 0,
                                     lc.o.reduction == Reduction::kNone, rng);
  std::vector<int64_t> tgt(N);
  for (auto& t : tgt) t = rng() % 10 < 3 ? -100 : static_cast<int64_t>(rng() % V);
  tgt[lc.shift > 0 ? 1 : 0] = static_cast<int64_t>(rng() % V);  // at least one row counts
  confident_targets(lc, in, rng, &tgt);
  const bool gpu32 = backend->kind() == BackendKind::kCuda && d == DType::kFloat32;
  const RefResult ref = reference(lc, in.hd, in.wd, in.bd, tgt, in.cwd, in.upd, cuda16 ? d : DType::kFloat32, gpu32);

  fusedce::Status st;
  const LinRun got = run(*backend, lc, d, in.hid, in.w, in.b, tgt, in.cw, in.up, true, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<double> gl(got.loss.begin(), got.loss.end()), glse(got.lse.begin(), got.lse.end());
  const Tol lt = cuda16 ? loss_tol_cuda16(d) : loss_tol(d);
  expect_close("loss", gl, lc.o.reduction == Reduction::kNone ? ref.loss_rows : std::vector<double>{ref.loss}, lt, lc.o.reduction == Reduction::kNone ? ref.loss_rows_b : std::vector<double>{ref.loss_b});
  expect_close("lse", glse, ref.lse, lt, ref.lse_b);
  EXPECT_NEAR(got.entropy, ref.entropy, (cuda16 ? 1e-3 : 2e-5) * (std::fabs(ref.entropy) + N) + ref.entropy_b);
  // A near-tie of the argmax may resolve either way under the GPU's float32 sums.
  EXPECT_NEAR(static_cast<double>(got.correct), static_cast<double>(ref.correct), cuda16 ? 1.0 : 0.0);
  auto widen = [&](const std::vector<uint8_t>& buf, int64_t n) {
    std::vector<double> v(n);
    for (int64_t k = 0; k < n; ++k) v[k] = load_value(buf.data(), d, k);
    return v;
  };
  const Tol gt = cuda16 ? grad_tol_cuda16(d, lc) : grad_tol(d, lc);
  expect_close("grad_hidden", widen(got.gh, N * H), ref.gh, gt, ref.gh_b);
  expect_close("grad_weight", widen(got.gw, V * H), ref.gw, gt, ref.gw_b);
  if (lc.bias) expect_close("grad_bias", widen(got.gb, V), ref.gb, gt, ref.gb_b);

  // Metrics on or off: loss and every gradient bit for bit the same.
  const LinRun plain = run(*backend, lc, d, in.hid, in.w, in.b, tgt, in.cw, in.up, false, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_EQ(0, std::memcmp(plain.loss.data(), got.loss.data(), got.loss.size() * sizeof(float)));
  EXPECT_EQ(plain.gh, got.gh);
  EXPECT_EQ(plain.gw, got.gw);
  EXPECT_EQ(plain.gb, got.gb);

  // Ignored rows dropped before the products: the same results (on the GPU, other chunks, so
  // within tolerance rather than bit for bit), and zeros where rows were skipped.
  const LinRun skipped = run(*backend, lc, d, in.hid, in.w, in.b, tgt, in.cw, in.up, true, &st, /*skip_ignored=*/true);
  ASSERT_TRUE(st.ok()) << st.message();
  std::vector<double> sl(skipped.loss.begin(), skipped.loss.end()), slse(skipped.lse.begin(), skipped.lse.end());
  expect_close("loss (skip_ignored)", sl, lc.o.reduction == Reduction::kNone ? ref.loss_rows : std::vector<double>{ref.loss}, lt, lc.o.reduction == Reduction::kNone ? ref.loss_rows_b : std::vector<double>{ref.loss_b});
  expect_close("lse (skip_ignored)", slse, ref.lse, lt, ref.lse_b);
  expect_close("grad_hidden (skip_ignored)", widen(skipped.gh, N * H), ref.gh, gt, ref.gh_b);
  expect_close("grad_weight (skip_ignored)", widen(skipped.gw, V * H), ref.gw, gt, ref.gw_b);
  if (lc.bias) expect_close("grad_bias (skip_ignored)", widen(skipped.gb, V), ref.gb, gt, ref.gb_b);

  // low_memory: grad_weight by vocabulary slices. On the GPU two budgets: a thin one (several
  // slices, one token chunk each) and one byte (a one-row buffer: several token chunks per slice,
  // summed in the float32 slice accumulator when V is small enough); with and without
  // skip_ignored.
  // low_memory adds a 16-bit bias in a pass of its own (so that its second pass forms the very
  // same logits again: src/cuda/linear/linear_cuda.cpp), rounding as the reference does.
  const std::vector<size_t> budgets =
      backend->kind() == BackendKind::kCuda ? std::vector<size_t>{size_t(7) * V * elem_size(d) + 3, 1} : std::vector<size_t>{0};
  for (size_t budget : budgets) {
    for (bool skip : {false, true}) {
      const std::string tag = " (low_memory, budget " + std::to_string(budget) + (skip ? ", skip_ignored)" : ")");
      const LinRun lm = run(*backend, lc, d, in.hid, in.w, in.b, tgt, in.cw, in.up, true, &st, skip, /*low_memory=*/true, budget);
      ASSERT_TRUE(st.ok()) << st.message();
      std::vector<double> ml(lm.loss.begin(), lm.loss.end()), mlse(lm.lse.begin(), lm.lse.end());
      expect_close("loss" + tag, ml, lc.o.reduction == Reduction::kNone ? ref.loss_rows : std::vector<double>{ref.loss}, lt, lc.o.reduction == Reduction::kNone ? ref.loss_rows_b : std::vector<double>{ref.loss_b});
      expect_close("lse" + tag, mlse, ref.lse, lt, ref.lse_b);
      expect_close("grad_hidden" + tag, widen(lm.gh, N * H), ref.gh, gt, ref.gh_b);
      expect_close("grad_weight" + tag, widen(lm.gw, V * H), ref.gw, gt, ref.gw_b);
      if (lc.bias) expect_close("grad_bias" + tag, widen(lm.gb, V), ref.gb, gt, ref.gb_b);
    }
  }

  // CPU: chunk budgets that split the rows (several chunks with a ragged last one; one row per
  // chunk), so that grad_weight and grad_bias add over chunks, each with rows of hidden, weight,
  // grad_hidden and grad_weight strided past H (the products' leading dimensions).
  if (backend->kind() == BackendKind::kCpu) {
    for (size_t budget : {size_t(0), size_t(7) * V * 4 + 3, size_t(1)}) {
      for (int64_t pad : {int64_t(0), int64_t(5)}) {
        if (budget == 0 && pad == 0) continue;  // the default run above
        const std::string tag = " (budget " + std::to_string(budget) + ", row stride H + " + std::to_string(pad) + ")";
        const LinRun cr = run(*backend, lc, d, in.hid, in.w, in.b, tgt, in.cw, in.up, true, &st, false, false, budget, pad);
        ASSERT_TRUE(st.ok()) << st.message();
        std::vector<double> cl(cr.loss.begin(), cr.loss.end()), clse(cr.lse.begin(), cr.lse.end());
        expect_close("loss" + tag, cl, lc.o.reduction == Reduction::kNone ? ref.loss_rows : std::vector<double>{ref.loss}, lt, lc.o.reduction == Reduction::kNone ? ref.loss_rows_b : std::vector<double>{ref.loss_b});
        expect_close("lse" + tag, clse, ref.lse, lt, ref.lse_b);
        EXPECT_NEAR(cr.entropy, ref.entropy, 2e-5 * (std::fabs(ref.entropy) + N)) << tag;
        EXPECT_EQ(cr.correct, ref.correct) << tag;
        expect_close("grad_hidden" + tag, widen(cr.gh, N * H), ref.gh, gt, ref.gh_b);
        expect_close("grad_weight" + tag, widen(cr.gw, V * H), ref.gw, gt, ref.gw_b);
        if (lc.bias) expect_close("grad_bias" + tag, widen(cr.gb, V), ref.gb, gt, ref.gb_b);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Linear, LinearGrid,
                         ::testing::Combine(::testing::ValuesIn(cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                                            ::testing::ValuesIn(all_backends())),
                         [](const auto& info) {
                           return std::string(backend_name(std::get<2>(info.param))) + "_" +
                                  std::get<0>(info.param).name + "_" + fusedce::dtype_name(std::get<1>(info.param));
                         });

// A bf16 problem (N = 300, H = 72, V = 3001, a quarter of the targets ignored) on a backend, and
// one forward_backward on its first `rows` rows: every output's bytes, in a fixed order (loss,
// lse, entropy, correct, grad_hidden, grad_weight; grad_weight starts as poison).
struct ContractProblem {
  static constexpr int64_t N = 300, H = 72, V = 3001;
  static constexpr DType d = DType::kBFloat16;
  Backend& backend;
  DeviceBuffer hid, w, t;

  static std::vector<uint8_t> random_values(int64_t n, float scale, std::mt19937_64& rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<uint8_t> v(n * 2);
    for (int64_t k = 0; k < n; ++k) store_value(v.data(), d, k, scale * normal(rng));
    return v;
  }
  static std::vector<int64_t> random_targets(std::mt19937_64& rng) {
    std::vector<int64_t> tgt(N);
    for (auto& x : tgt) x = rng() % 4 == 0 ? -100 : static_cast<int64_t>(rng() % V);
    return tgt;
  }
  ContractProblem(Backend& b, std::mt19937_64 rng = test_rng())
      : backend(b),
        hid(DeviceBuffer::from_vector(b, random_values(N * H, 1.0f, rng))),
        w(DeviceBuffer::from_vector(b, random_values(V * H, 0.3f, rng))),
        t(DeviceBuffer::from_vector(b, random_targets(rng))) {}

  /// Every output's bytes, grad_weight's H columns a row last; `gw_stride`: grad_weight's row stride.
  std::vector<uint8_t> call(int64_t rows, const fusedce::Options& o, const fusedce::LinearOptions& lo,
                            fusedce::Workspace ws, fusedce::Status* st, int64_t gw_stride = H) {
    DeviceBuffer loss(backend, 4), lse(backend, std::max<int64_t>(rows, 1) * 4), ent(backend, 4),
        cor(backend, 8), gh(backend, std::max<int64_t>(rows, 1) * H * 2), gw(backend, V * gw_stride * 2);
    gw.fill(0xCD);
    fusedce::ForwardOutputs out;
    out.loss = fusedce::vector(loss.data(), DType::kFloat32, 1);
    out.lse = fusedce::vector(lse.data(), DType::kFloat32, rows);
    out.entropy_sum = fusedce::vector(ent.data(), DType::kFloat32, 1);
    out.num_correct = fusedce::vector(cor.data(), DType::kInt64, 1);
    fusedce::LinearGrads g;
    g.grad_hidden = fusedce::matrix(gh.data(), d, rows, H);
    g.grad_weight = fusedce::matrix(gw.data(), d, V, H, gw_stride);
    *st = fusedce::linear_cross_entropy_forward_backward(backend.device(), fusedce::matrix(hid.data(), d, rows, H),
                                                         fusedce::matrix(w.data(), d, V, H), {},
                                                         fusedce::vector(t.data(), DType::kInt64, rows), o, lo, out,
                                                         {}, g, ws);
    backend.synchronize();
    std::vector<uint8_t> all = loss.to_host();
    for (const DeviceBuffer* b : {&lse, &ent, &cor, &gh}) {
      const std::vector<uint8_t> v = b->to_host();
      all.insert(all.end(), v.begin(), v.end());
    }
    const std::vector<uint8_t> w_rows = gw.to_host();
    for (int64_t r = 0; r < V; ++r) {
      all.insert(all.end(), w_rows.begin() + r * gw_stride * 2, w_rows.begin() + (r * gw_stride + H) * 2);
    }
    return all;
  }

  /// The empty batch: a NaN mean and an all-zero grad_weight.
  void expect_empty_batch_results(const fusedce::Options& o, const fusedce::LinearOptions& lo) {
    fusedce::Status st;
    const std::vector<uint8_t> empty = call(0, o, lo, {}, &st);
    ASSERT_TRUE(st.ok()) << st.message();
    float loss;
    std::memcpy(&loss, empty.data(), 4);
    EXPECT_TRUE(std::isnan(loss)) << "mean over no rows: " << loss;
    const size_t gw_at = empty.size() - size_t(V) * H * 2;
    for (size_t k = gw_at; k < empty.size(); ++k) ASSERT_EQ(empty[k], 0) << "grad_weight byte " << k - gw_at;
  }
};

// The GPU path's contract beyond the numbers: same bits run to run, a caller's workspace of the
// queried size gives the same bits as the backend's own scratch, one byte less is refused by
// name, and N = 0 gives the empty-batch results (mean NaN, zero gradients).
class LinearContract : public ::testing::TestWithParam<BackendKind> {};

TEST_P(LinearContract, DeterministicWorkspaceAndEmptyBatch) {
  std::string why;
  Backend* backend = find_backend(GetParam(), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const bool gpu = GetParam() == BackendKind::kCuda;
  using P = ContractProblem;
  P p(*backend);
  fusedce::Options o;
  o.label_smoothing = 0.1f;
  o.return_metrics = true;
  fusedce::LinearOptions lo;
  lo.chunk_budget_bytes = size_t(64) * P::V * 2;  // five chunks
  fusedce::Status st;
  const std::vector<uint8_t> first = p.call(P::N, o, lo, {}, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(first == p.call(P::N, o, lo, {}, &st)) << "a second run differs";
  fusedce::LinearGrads want;
  want.grad_hidden = fusedce::matrix(p.hid.data(), P::d, P::N, P::H);
  want.grad_weight = fusedce::matrix(p.w.data(), P::d, P::V, P::H);
  const size_t bytes = fusedce::linear_cross_entropy_workspace_size(fusedce::Job::kForwardBackward, backend->device(),
                                                                    P::N, P::H, P::V, P::d, o, lo, want);
  if (gpu) {
    ASSERT_GT(bytes, 0u);
    DeviceBuffer ws(*backend, bytes);
    EXPECT_TRUE(first == p.call(P::N, o, lo, fusedce::Workspace{ws.data(), bytes}, &st)) << "with a caller's workspace";
    ASSERT_TRUE(st.ok()) << st.message();
    p.call(P::N, o, lo, fusedce::Workspace{ws.data(), bytes - 1}, &st);
    EXPECT_EQ(st.code(), fusedce::StatusCode::kWorkspaceTooSmall);
    EXPECT_NE(st.message().find("workspace"), std::string::npos) << st.message();
  } else {
    EXPECT_EQ(bytes, 0u);
  }
  p.expect_empty_batch_results(o, lo);
}

// Several token chunks of a 16-bit grad_weight: the float32 accumulator sums them, and a logit
// buffer no larger than grad_weight lives in that output until the accumulator is rounded into
// it, so the workspace holds the accumulator but no buffer. A grad_weight with padded rows
// cannot hold the buffer; it gets scratch of its own and the same results. The buffer is the
// budget's rows of logits on the logits path; on Hopper the call takes the window form, whose
// per-row partials share the budget, so the buffer holds fewer whole rows (more than half of
// them at this V: 16 tiles of partials a row against 3001 logits).
TEST_P(LinearContract, LogitBufferLivesInGradWeight) {
  std::string why;
  Backend* backend = find_backend(GetParam(), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  using P = ContractProblem;
  P p(*backend);
  fusedce::Options o;
  o.return_metrics = true;
  fusedce::LinearOptions lo;
  const size_t buffer = size_t(64) * 3008 * 2;  // 64 rows of V padded to 16 bytes: five chunks
  lo.chunk_budget_bytes = buffer;
  ASSERT_LE(buffer, size_t(P::V) * P::H * 2);
  fusedce::Status st;
  const std::vector<uint8_t> dense = p.call(P::N, o, lo, {}, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(dense == p.call(P::N, o, lo, {}, &st, P::H + 8)) << "grad_weight with padded rows";
  ASSERT_TRUE(st.ok()) << st.message();
  if (GetParam() == BackendKind::kCuda) {
    fusedce::LinearGrads want;  // views only describe what is wanted
    want.grad_hidden = fusedce::matrix(reinterpret_cast<void*>(256), P::d, P::N, P::H);
    auto size = [&] {
      return fusedce::linear_cross_entropy_workspace_size(fusedce::Job::kForwardBackward, backend->device(), P::N,
                                                          P::H, P::V, P::d, o, lo, want);
    };
    const size_t without_gw = size();  // the buffer, no accumulator
    want.grad_weight = fusedce::matrix(reinterpret_cast<void*>(256), P::d, P::V, P::H);
    const size_t bytes = size();
    const size_t acc = (size_t(P::V) * P::H * 4 + 255) / 256 * 256;
    // what the workspace without grad_weight holds beyond the one with it, less the accumulator:
    // the logit buffer, whole rows of 3008 bf16 (padded to the workspace's 256-byte alignment)
    ASSERT_GE(without_gw + acc, bytes);
    const size_t held = without_gw + acc - bytes;
    const size_t row = size_t(3008) * 2, rows = held / row;
    EXPECT_LE(held, buffer) << "the accumulator in the workspace, the buffer not";
    EXPECT_GT(rows, size_t(32)) << "the buffer holds most of the budget's rows";
    EXPECT_EQ(held, (rows * row + 255) / 256 * 256) << "whole rows of logits";
    DeviceBuffer ws(*backend, bytes);
    EXPECT_TRUE(dense == p.call(P::N, o, lo, fusedce::Workspace{ws.data(), bytes}, &st)) << "with a caller's workspace";
    ASSERT_TRUE(st.ok()) << st.message();
  }
}

// low_memory's promise: the whole workspace stays under 512 MiB at language-model shapes (H up
// to 8192, V up to 262144, up to 262144 rows; the default path needs the float32 (V, H)
// accumulator on top), and a low_memory call is the same bits run to run and gives the
// empty-batch results.
TEST_P(LinearContract, LowMemoryStaysUnder512MiB) {
  std::string why;
  Backend* backend = find_backend(GetParam(), &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const DType d = DType::kBFloat16;
  fusedce::Options o;
  o.return_metrics = true;
  fusedce::LinearOptions lo;
  lo.low_memory = true;
  struct Shape { int64_t N, H, V; };
  for (const Shape s : {Shape{4096, 4096, 128256}, Shape{8192, 4096, 128256}, Shape{16384, 2304, 256000},
                        Shape{32768, 4096, 128256}, Shape{262144, 8192, 262144}}) {
    fusedce::LinearGrads g;  // views only describe what is wanted; no memory behind them
    g.grad_hidden = fusedce::matrix(reinterpret_cast<void*>(256), d, s.N, s.H);
    g.grad_weight = fusedce::matrix(reinterpret_cast<void*>(256), d, s.V, s.H);
    g.grad_bias = fusedce::vector(reinterpret_cast<void*>(256), d, s.V);
    for (bool skip : {false, true}) {
      lo.skip_ignored = skip;
      const size_t bytes = fusedce::linear_cross_entropy_workspace_size(fusedce::Job::kForwardBackward,
                                                                        backend->device(), s.N, s.H, s.V, d, o, lo, g);
      if (GetParam() == BackendKind::kCuda) {
        EXPECT_GT(bytes, 0u);
        EXPECT_LT(bytes, size_t(512) << 20) << s.N << " x " << s.H << " x " << s.V << " skip_ignored " << skip;
      }
    }
  }

  ContractProblem p(*backend);
  lo.skip_ignored = false;
  lo.chunk_budget_bytes = size_t(40) * ContractProblem::V * 2;  // several token chunks and vocabulary slices
  fusedce::Status st;
  const std::vector<uint8_t> first = p.call(ContractProblem::N, o, lo, {}, &st);
  ASSERT_TRUE(st.ok()) << st.message();
  EXPECT_TRUE(first == p.call(ContractProblem::N, o, lo, {}, &st)) << "a second low_memory run differs";
  p.expect_empty_batch_results(o, lo);
}

INSTANTIATE_TEST_SUITE_P(Backends, LinearContract, ::testing::ValuesIn(all_backends()),
                         [](const auto& info) { return std::string(backend_name(info.param)); });

TEST(LinearBadInput, NamesTheArgument) {
  std::vector<float> h(4 * 8), w(10 * 8), gw(10 * 8);
  std::vector<int64_t> t(4, 1);
  float loss = 0;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(&loss, DType::kFloat32, 1);
  auto call = [&](fusedce::MatrixView hv, fusedce::MatrixView wv, fusedce::LinearOptions lo, fusedce::LinearGrads g) {
    return fusedce::linear_cross_entropy_forward_backward(fusedce::Device::cpu(), hv, wv, {},
                                                          fusedce::vector(t.data(), DType::kInt64, 4), {}, lo, out, {}, g);
  };
  const auto H = fusedce::matrix(h.data(), DType::kFloat32, 4, 8);
  fusedce::Status s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 7), {}, {});
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("weight"), std::string::npos) << s.message();
  s = call(H, fusedce::matrix(w.data(), DType::kBFloat16, 10, 8), {}, {});
  EXPECT_NE(s.message().find("weight"), std::string::npos) << s.message();
  fusedce::LinearOptions lo;
  lo.shift_seq_len = 3;
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), lo, {});
  EXPECT_NE(s.message().find("shift_seq_len"), std::string::npos) << s.message();
  fusedce::LinearGrads g;
  g.grad_weight = fusedce::matrix(gw.data(), DType::kFloat32, 9, 8);
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), {}, g);
  EXPECT_NE(s.message().find("grad_weight"), std::string::npos) << s.message();
  g.grad_weight = fusedce::matrix(gw.data(), DType::kBFloat16, 10, 8);  // not the head's dtype
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), {}, g);
  EXPECT_NE(s.message().find("grad_weight must be 10 x 8 float32"), std::string::npos) << s.message();
  g.grad_weight = {};
  g.grad_hidden = fusedce::matrix(gw.data(), DType::kFloat32, 4, 7);
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), {}, g);
  EXPECT_NE(s.message().find("grad_hidden must be 4 x 8"), std::string::npos) << s.message();
  t[2] = 10;
  s = call(H, fusedce::matrix(w.data(), DType::kFloat32, 10, 8), {}, {});
  EXPECT_EQ(s.code(), fusedce::StatusCode::kTargetOutOfRange);
  EXPECT_NE(s.message().find("target[2] = 10"), std::string::npos) << s.message();
}

// skip_ignored under CUDA graph capture (src/cuda/linear/linear_cuda.cpp, "Under CUDA graph
// capture"): the call is captured once on the backend's stream, and the graph is replayed with
// other targets in the same buffers, so the count of valid rows changes between replays and the
// work must follow it. Each replay is checked against the float64 reference and against the
// eager (synced) skip_ignored call on the same targets: bit for bit where the two run the same
// chunks (the count on a rung of the size ladder, or every row valid), else within a reordered
// float32 sum. Every option is on (label smoothing, logit scale, soft-cap, z-loss, class weights,
// bias, metrics), but in the `window` case the soft-cap, and that case asks for the window form
// (detail::LinearForm::kWindow: the planner keeps the metrics and grad_bias on the logits path), so
// that a bf16 call on Hopper runs it with label smoothing's extra rows after each rung's rows.
// Prints the plan of each step, so that one run shows where a failure sits.
struct CaptureCase {
  std::string name;
  int64_t N, H, V;
  int64_t chunk_rows;  // > 0: a budget of this many rows per chunk; 0: the default (one chunk)
  Reduction reduction;
  std::vector<int64_t> counts;  // valid rows of each step (the first is captured, then replays)
  std::vector<bool> same_bits;  // whether that step must match the synced call bit for bit
  bool window = false;          // no soft-cap, the window form asked for
};

std::vector<CaptureCase> capture_cases() {
  // N = 300 in one chunk: rungs 128, 256, 300. Counts: on a rung, one past it, none, all, a
  // single row. N = 1000 (not a multiple of 128), V = 1000 (TMA-aligned: the bf16 grad_weight's
  // last product is the CUTLASS kernel on Hopper) in chunks of 256 (rungs 128, 256; the last
  // chunk 232: rungs 128, 232): 768 = three whole chunks (the synced path's chunks too), 600 and
  // 129 (other chunks than the synced path's), all 1000, none.
  return {
      {"one_chunk_odd_V", 300, 72, 1001, 0, Reduction::kMean, {128, 129, 0, 300, 1, 256},
       {true, false, true, true, false, true}},
      {"one_chunk_none", 300, 40, 515, 0, Reduction::kNone, {256, 257, 300, 0}, {true, false, true, true}},
      {"chunks", 1000, 64, 1000, 256, Reduction::kMean, {768, 600, 1000, 0, 129, 768},
       {true, false, true, true, false, true}},
      {"chunks_sum_odd_V", 1000, 24, 333, 256, Reduction::kSum, {1000, 513, 768}, {true, false, true}},
      {"window_one_chunk_odd_V", 300, 72, 1001, 0, Reduction::kMean, {128, 129, 0, 300, 1, 256},
       {true, false, true, true, false, true}, true},
  };
}

class LinearCapture : public ::testing::TestWithParam<std::tuple<CaptureCase, DType>> {};

TEST_P(LinearCapture, SkipIgnoredFollowsTheDeviceCount) {
  const CaptureCase& cc = std::get<0>(GetParam());
  const DType d = std::get<1>(GetParam());
  std::string why;
  Backend* backend = find_backend(BackendKind::kCuda, &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const int64_t N = cc.N, H = cc.H, V = cc.V;
  const size_t el = elem_size(d);
  const bool cuda16 = d != DType::kFloat32;
  LinCase lc;
  lc.name = cc.name;
  lc.N = N;
  lc.H = H;
  lc.V = V;
  lc.bias = true;
  lc.o.reduction = cc.reduction;
  lc.o.label_smoothing = 0.1f;
  lc.o.logit_scale = 0.9f;
  lc.o.softcap = cc.window ? 0.0f : 5.0f;
  lc.o.z_loss = 1e-3f;
  lc.o.return_metrics = true;

  std::mt19937_64 rng = test_rng();
  const LinInputs in = random_inputs(N, H, V, d, true, cc.reduction == Reduction::kNone, rng);
  // Targets with exactly `count` valid rows, at random positions.
  auto targets_with = [&](int64_t count) {
    std::vector<int64_t> t(N, -100), order(N);
    for (int64_t i = 0; i < N; ++i) order[i] = i;
    std::shuffle(order.begin(), order.end(), rng);
    for (int64_t k = 0; k < count; ++k) t[order[k]] = static_cast<int64_t>(rng() % V);
    return t;
  };

  // Buffers that stay put across the capture and its replays.
  DeviceBuffer d_hid = DeviceBuffer::from_vector(*backend, in.hid), d_w = DeviceBuffer::from_vector(*backend, in.w),
               d_b = DeviceBuffer::from_vector(*backend, in.b), d_cw = DeviceBuffer::from_vector(*backend, in.cw),
               d_up = DeviceBuffer::from_vector(*backend, in.up), d_t(*backend, N * 8);
  const int64_t loss_n = cc.reduction == Reduction::kNone ? N : 1;
  DeviceBuffer d_loss(*backend, loss_n * 4), d_lse(*backend, N * 4), d_ent(*backend, 4), d_cor(*backend, 8),
      d_gh(*backend, N * H * el), d_gw(*backend, V * H * el), d_gb(*backend, V * el);
  fusedce::Options o = lc.o;
  o.class_weight = fusedce::vector(d_cw.data(), DType::kFloat32, V);
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(d_loss.data(), DType::kFloat32, loss_n);
  out.lse = fusedce::vector(d_lse.data(), DType::kFloat32, N);
  out.num_correct = fusedce::vector(d_cor.data(), DType::kInt64, 1);
  out.entropy_sum = fusedce::vector(d_ent.data(), DType::kFloat32, 1);
  fusedce::LinearOptions lo;
  lo.skip_ignored = true;
  // Bytes per row of the plan's chunk (logits row padded to 16 bytes, gathered hidden and
  // grad_hidden rows): a budget of chunk_rows rows.
  const int64_t ld = (V * int64_t(el) + 15) / 16 * 16;
  if (cc.chunk_rows > 0) lo.chunk_budget_bytes = size_t(cc.chunk_rows) * size_t(ld + 2 * H * int64_t(el));
  fusedce::LinearGrads g;
  g.grad_hidden = fusedce::matrix(d_gh.data(), d, N, H);
  g.grad_weight = fusedce::matrix(d_gw.data(), d, V, H);
  g.grad_bias = fusedce::vector(d_gb.data(), d, V);
  auto enqueue = [&]() {
    if (cc.window) {
      return linear_forward_backward_in(
          fusedce::detail::LinearForm::kWindow, backend->device(), fusedce::matrix(d_hid.data(), d, N, H),
          fusedce::matrix(d_w.data(), d, V, H), fusedce::vector(d_b.data(), d, V),
          fusedce::vector(d_t.data(), DType::kInt64, N), o, lo, out,
          in.up.size() == 1 ? fusedce::vector(d_up.data(), DType::kFloat32, 1) : fusedce::vector(d_up.data(), DType::kFloat32, N),
          g);
    }
    return fusedce::linear_cross_entropy_forward_backward(
        backend->device(), fusedce::matrix(d_hid.data(), d, N, H), fusedce::matrix(d_w.data(), d, V, H),
        fusedce::vector(d_b.data(), d, V), fusedce::vector(d_t.data(), DType::kInt64, N), o, lo, out,
        in.up.size() == 1 ? fusedce::vector(d_up.data(), DType::kFloat32, 1) : fusedce::vector(d_up.data(), DType::kFloat32, N),
        g);
  };
  auto poison = [&]() {
    for (DeviceBuffer* buf : {&d_loss, &d_lse, &d_ent, &d_cor, &d_gh, &d_gw, &d_gb}) buf->fill(0xCD);
  };
  auto read = [&]() {
    LinRun r;
    r.loss = d_loss.to_host_as<float>();
    r.loss.resize(loss_n);
    r.lse = d_lse.to_host_as<float>();
    r.lse.resize(N);
    d_ent.download(&r.entropy, 4);
    d_cor.download(&r.correct, 8);
    r.gh = d_gh.to_host();
    r.gh.resize(N * H * el);
    r.gw = d_gw.to_host();
    r.gw.resize(V * H * el);
    r.gb = d_gb.to_host();
    r.gb.resize(V * el);
    return r;
  };
  auto widen = [&](const std::vector<uint8_t>& buf, int64_t n) {
    std::vector<double> v(n);
    for (int64_t k = 0; k < n; ++k) v[k] = load_value(buf.data(), d, k);
    return v;
  };
  auto first_difference = [](const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t unit) {
    for (size_t k = 0; k < std::min(a.size(), b.size()); ++k) {
      if (a[k] != b[k]) return std::to_string(k / unit);
    }
    return std::string(a.size() == b.size() ? "none" : "sizes differ");
  };
  auto as_bytes = [](const std::vector<float>& v) {
    std::vector<uint8_t> out(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  };

  const int64_t step = cc.chunk_rows > 0 ? cc.chunk_rows : N;
  std::ostringstream plan;
  plan << cc.name << " " << fusedce::dtype_name(d) << ": N " << N << " H " << H << " V " << V << ", chunks of " << step
       << " rows, rungs";
  for (int64_t p0 = 0; p0 < N; p0 += step) {
    const fusedce::cuda::SizeLadder l = fusedce::cuda::size_ladder(std::min(step, N - p0));
    plan << " [";
    for (int r = 0; r < l.rungs; ++r) plan << (r ? " " : "") << l.size[r];
    plan << "]";
  }
  std::printf("%s\n", plan.str().c_str());

  bool captured = false;
  for (size_t s = 0; s < cc.counts.size(); ++s) {
    const int64_t count = cc.counts[s];
    const std::vector<int64_t> tgt = targets_with(count);
    d_t.upload(tgt.data(), N * 8);
    const std::string tag = " (step " + std::to_string(s) + ", " + std::to_string(count) + " valid rows)";
    SCOPED_TRACE(plan.str() + tag);

    poison();
    fusedce::Status st = enqueue();
    backend->synchronize();
    ASSERT_TRUE(st.ok()) << "synced call: " << st.message();
    const LinRun synced = read();

    poison();
    if (!captured) {
      ASSERT_TRUE(backend->capture_begin(&why)) << why;
      st = enqueue();
      size_t nodes = 0;
      const bool ended = backend->capture_end(&nodes, &why);
      ASSERT_TRUE(st.ok()) << "captured call: " << st.message();
      ASSERT_TRUE(ended) << why;
      std::printf("  captured: %zu top-level graph nodes\n", nodes);
      captured = true;
    }
    ASSERT_TRUE(backend->replay(&why)) << why;
    const LinRun got = read();

    // Against the float64 reference.
    const RefResult ref = reference(lc, in.hd, in.wd, in.bd, tgt, in.cwd, in.upd, cuda16 ? d : DType::kFloat32, !cuda16);
    const Tol lt = cuda16 ? loss_tol_cuda16(d) : loss_tol(d);
    const Tol gt = cuda16 ? grad_tol_cuda16(d, lc) : grad_tol(d, lc);
    std::vector<double> gl(got.loss.begin(), got.loss.end()), glse(got.lse.begin(), got.lse.end());
    expect_close("loss" + tag, gl, cc.reduction == Reduction::kNone ? ref.loss_rows : std::vector<double>{ref.loss}, lt, cc.reduction == Reduction::kNone ? ref.loss_rows_b : std::vector<double>{ref.loss_b});
    expect_close("lse" + tag, glse, ref.lse, lt, ref.lse_b);
    EXPECT_NEAR(got.entropy, ref.entropy, (cuda16 ? 1e-3 : 2e-5) * (std::fabs(ref.entropy) + N) + ref.entropy_b) << tag;
    EXPECT_NEAR(static_cast<double>(got.correct), static_cast<double>(ref.correct), cuda16 ? 1.0 : 0.0) << tag;
    expect_close("grad_hidden" + tag, widen(got.gh, N * H), ref.gh, gt, ref.gh_b);
    expect_close("grad_weight" + tag, widen(got.gw, V * H), ref.gw, gt, ref.gw_b);
    expect_close("grad_bias" + tag, widen(got.gb, V), ref.gb, gt, ref.gb_b);

    // Against the synced call on the same targets.
    const std::vector<uint8_t> gloss = as_bytes(got.loss), sloss = as_bytes(synced.loss);
    const std::vector<uint8_t> glse_b = as_bytes(got.lse), slse_b = as_bytes(synced.lse);
    std::printf("  step %zu: %lld valid rows: loss %.9g (synced %.9g), entropy %.9g (%.9g), correct %lld (%lld); first "
                "differing element vs synced: loss %s, lse %s, grad_hidden %s, grad_weight %s, grad_bias %s\n",
                s, static_cast<long long>(count), got.loss[0], synced.loss[0], got.entropy, synced.entropy,
                static_cast<long long>(got.correct), static_cast<long long>(synced.correct),
                first_difference(gloss, sloss, 4).c_str(), first_difference(glse_b, slse_b, 4).c_str(),
                first_difference(got.gh, synced.gh, el).c_str(), first_difference(got.gw, synced.gw, el).c_str(),
                first_difference(got.gb, synced.gb, el).c_str());
    if (cc.same_bits[s]) {
      EXPECT_EQ(gloss, sloss) << "loss" << tag;
      EXPECT_EQ(glse_b, slse_b) << "lse" << tag;
      EXPECT_EQ(0, std::memcmp(&got.entropy, &synced.entropy, 4)) << "entropy" << tag;
      EXPECT_EQ(got.correct, synced.correct) << "num_correct" << tag;
      EXPECT_EQ(got.gh, synced.gh) << "grad_hidden" << tag;
      EXPECT_EQ(got.gw, synced.gw) << "grad_weight" << tag;
      EXPECT_EQ(got.gb, synced.gb) << "grad_bias" << tag;
    } else {
      // Other row counts in the products: a reordered float32 sum, then one rounding to the dtype.
      const Tol near = cuda16 ? Tol{8e-3, 1e-3} : Tol{1e-5, 1e-6};
      std::vector<double> sl(synced.loss.begin(), synced.loss.end()), slse(synced.lse.begin(), synced.lse.end());
      expect_close("loss vs synced" + tag, gl, sl, near);
      expect_close("lse vs synced" + tag, glse, slse, near);
      expect_close("grad_hidden vs synced" + tag, widen(got.gh, N * H), widen(synced.gh, N * H), near);
      expect_close("grad_weight vs synced" + tag, widen(got.gw, V * H), widen(synced.gw, V * H), near);
      expect_close("grad_bias vs synced" + tag, widen(got.gb, V), widen(synced.gb, V), near);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Linear, LinearCapture,
                         ::testing::Combine(::testing::ValuesIn(capture_cases()),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16)),
                         [](const auto& info) {
                           return std::get<0>(info.param).name + "_" + fusedce::dtype_name(std::get<1>(info.param));
                         });

// check_targets reads the target check back on the host: refused under capture, by name.
TEST(LinearCaptureErrors, CheckTargetsIsRefusedByName) {
  std::string why;
  Backend* backend = find_backend(BackendKind::kCuda, &why);
  if (backend == nullptr) GTEST_SKIP() << why;
  const int64_t N = 16, H = 8, V = 40;
  const DType d = DType::kFloat32;
  std::vector<float> hid(N * H, 0.5f), w(V * H, 0.25f);
  std::vector<int64_t> tgt(N, 3);
  DeviceBuffer d_hid = DeviceBuffer::from_vector(*backend, hid), d_w = DeviceBuffer::from_vector(*backend, w),
               d_t = DeviceBuffer::from_vector(*backend, tgt), d_loss(*backend, 4);
  fusedce::Options o;
  o.check_targets = true;
  fusedce::LinearOptions lo;
  lo.skip_ignored = true;
  fusedce::ForwardOutputs out;
  out.loss = fusedce::vector(d_loss.data(), DType::kFloat32, 1);
  ASSERT_TRUE(backend->capture_begin(&why)) << why;
  const fusedce::Status st = fusedce::linear_cross_entropy_forward(
      backend->device(), fusedce::matrix(d_hid.data(), d, N, H), fusedce::matrix(d_w.data(), d, V, H), {},
      fusedce::vector(d_t.data(), DType::kInt64, N), o, lo, out);
  size_t nodes = 0;
  backend->capture_end(&nodes, &why);  // the capture is over either way
  EXPECT_FALSE(st.ok());
  EXPECT_NE(st.message().find("check_targets"), std::string::npos) << st.message();
}

}  // namespace
}  // namespace fusedce_test
