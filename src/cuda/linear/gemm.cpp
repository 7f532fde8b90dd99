// cuBLASLt products for the linear cross-entropy (gemm.h). One handle per device, created on
// first use and kept for the process (creating one costs far more than a product at our sizes).
#include "cuda/linear/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <string>

namespace fusedce {
namespace cuda {
namespace {

cudaDataType_t cuda_type(DType d) {
  switch (d) {
    case DType::kFloat32: return CUDA_R_32F;
    case DType::kBFloat16: return CUDA_R_16BF;
    default: return CUDA_R_16F;
  }
}

Status lt_error(cublasStatus_t s, const char* what) {
  std::ostringstream os;
  os << "cuBLASLt error " << static_cast<int>(s) << " in " << what;
  return Status(StatusCode::kDeviceError, os.str());
}

Status handle_for(int device, cublasLtHandle_t* out) {
  static std::mutex mu;
  static std::map<int, cublasLtHandle_t> handles;
  std::lock_guard<std::mutex> lock(mu);
  auto it = handles.find(device);
  if (it != handles.end()) {
    *out = it->second;
    return Status::Ok();
  }
  cublasLtHandle_t h = nullptr;
  const cublasStatus_t s = cublasLtCreate(&h);
  if (s != CUBLAS_STATUS_SUCCESS) return lt_error(s, "cublasLtCreate");
  handles[device] = h;
  *out = h;
  return Status::Ok();
}

/// The largest power of two (<= 256) dividing the address: cuBLASLt's heuristics otherwise assume
/// 256-byte aligned operands, and a kernel picked on that assumption may fault on a row slice.
uint32_t alignment_of(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  uint32_t align = 256;
  while (align > 1 && a % align != 0) align >>= 1;
  return align;
}

static_assert(kLtTile256x128 == CUBLASLT_MATMUL_TILE_256x128, "algo_choice.h's tile id");
static_assert(kLtTile176x128 == CUBLASLT_MATMUL_TILE_176x128, "algo_choice.h's tile id");

/// A candidate's configuration, as choose_algorithm reads it.
AlgoTraits traits_of(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attr, int32_t fallback) {
    int32_t v = fallback;
    size_t written = 0;
    if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) {
      return fallback;
    }
    return v;
  };
  // A configuration that cannot be read matches no preference (the tile -1).
  return AlgoTraits{get(CUBLASLT_ALGO_CONFIG_TILE_ID, -1), get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, -1),
                    get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM, -1), get(CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, -1)};
}

/// The device's compute capability, read once per device.
Status compute_capability(int device, int* major, int* minor) {
  static std::mutex mu;
  static std::map<int, std::pair<int, int>> known;
  std::lock_guard<std::mutex> lock(mu);
  auto it = known.find(device);
  if (it == known.end()) {
    int ma = 0, mi = 0;
    if (cudaDeviceGetAttribute(&ma, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&mi, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
      return Status(StatusCode::kDeviceError, "reading the device's compute capability");
    }
    it = known.emplace(device, std::make_pair(ma, mi)).first;
  }
  *major = it->second.first;
  *minor = it->second.second;
  return Status::Ok();
}

#define FUSEDCE_TRY_STATUS(expr)  \
  do {                            \
    const Status s_ = (expr);     \
    if (!s_.ok()) return s_;      \
  } while (0)

/// RAII for the descriptors of one product.
struct Descriptors {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~Descriptors() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (d) cublasLtMatrixLayoutDestroy(d);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

#define FUSEDCE_LT(expr, what)                                      \
  do {                                                              \
    const cublasStatus_t s_ = (expr);                               \
    if (s_ != CUBLAS_STATUS_SUCCESS) return lt_error(s_, what);     \
  } while (0)

/// One cuBLASLt call for the whole product.
Status gemm_whole(const GemmCall& c) {
  cublasLtHandle_t lt = nullptr;
  Status st = handle_for(c.device, &lt);
  if (!st.ok()) return st;
  Descriptors ds;
  FUSEDCE_LT(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "creating the product descriptor");
  const cublasOperation_t opa = c.transpose_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = c.transpose_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  FUSEDCE_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)), "TRANSA");
  FUSEDCE_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)), "TRANSB");
  if (c.scale) {
    const int32_t mode = CUBLASLT_POINTER_MODE_DEVICE;
    FUSEDCE_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_POINTER_MODE, &mode, sizeof(mode)),
               "POINTER_MODE");
  }
  if (c.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const cudaDataType_t bt = cuda_type(c.bias_dtype);
    FUSEDCE_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)), "EPILOGUE");
    FUSEDCE_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &c.bias, sizeof(c.bias)),
               "BIAS_POINTER");
    FUSEDCE_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)),
               "BIAS_DATA_TYPE");
  }
  FUSEDCE_LT(cublasLtMatrixLayoutCreate(&ds.a, cuda_type(c.a.dtype), c.a.rows, c.a.cols, c.a.ld), "layout of A");
  FUSEDCE_LT(cublasLtMatrixLayoutCreate(&ds.b, cuda_type(c.b.dtype), c.b.rows, c.b.cols, c.b.ld), "layout of B");
  FUSEDCE_LT(cublasLtMatrixLayoutCreate(&ds.d, cuda_type(c.d_dtype), c.m, c.n, c.ld_d), "layout of D");
  FUSEDCE_LT(cublasLtMatmulPreferenceCreate(&ds.pref), "preference");
  const uint64_t ws = kGemmWorkspaceBytes;
  FUSEDCE_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)),
             "workspace preference");
  const uint32_t al_a = alignment_of(c.a.data), al_b = alignment_of(c.b.data), al_d = alignment_of(c.d);
  FUSEDCE_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a)),
             "alignment of A");
  FUSEDCE_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b)),
             "alignment of B");
  FUSEDCE_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_d, sizeof(al_d)),
             "alignment of C");
  FUSEDCE_LT(cublasLtMatmulPreferenceSetAttribute(ds.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_d, sizeof(al_d)),
             "alignment of D");
  // The role's preferred candidate among the heuristic's first kCandidates (algo_choice.h);
  // without a role, its first.
  constexpr int kCandidates = 8;
  cublasLtMatmulHeuristicResult_t heur[kCandidates] = {};
  int found = 0;
  FUSEDCE_LT(cublasLtMatmulAlgoGetHeuristic(lt, ds.op, ds.a, ds.b, ds.d, ds.d, ds.pref,
                                            c.role == GemmRole::kAny ? 1 : kCandidates, heur, &found),
             "choosing an algorithm");
  if (found == 0) {
    std::ostringstream os;
    os << "cuBLASLt has no algorithm for a " << c.m << " x " << c.n << " product of " << dtype_name(c.a.dtype)
       << " operands (alignments " << al_a << ", " << al_b << ", " << al_d << " bytes)";
    return Status(StatusCode::kUnsupported, os.str());
  }
  int pick = 0;
  if (found > 1) {
    AlgoTraits traits[kCandidates];
    for (int i = 0; i < found; ++i) traits[i] = traits_of(heur[i].algo);
    int major = 0, minor = 0;
    FUSEDCE_TRY_STATUS(compute_capability(c.device, &major, &minor));
    pick = choose_algorithm(c.role, major, minor, traits, found);
  }
  const float one = 1.0f;
  const float* alpha = c.scale ? c.scale : &one;
  const float* beta = c.scale ? c.scale + (c.beta == 0.0f ? 1 : 2) : &c.beta;
  FUSEDCE_LT(cublasLtMatmul(lt, ds.op, alpha, c.a.data, ds.a, c.b.data, ds.b, beta, c.d, ds.d, c.d, ds.d,
                            &heur[pick].algo, c.workspace, kGemmWorkspaceBytes, c.stream),
             "the product");
  return Status::Ok();
}

/// Elements of `d` in 16 bytes.
int64_t per16(DType d) { return static_cast<int64_t>(16 / elem_size(d)); }

/// The head of an extent to split off as a multiple of `q` elements, or 0 when the extent needs
/// no split (it is a multiple of q already) or is shorter than q (nothing to split off).
int64_t aligned_head(int64_t extent, int64_t q) {
  const int64_t head = extent / q * q;
  return head > 0 && head < extent ? head : 0;
}

const void* advance(const void* p, int64_t elems, DType d) {
  return static_cast<const char*>(p) + elems * static_cast<int64_t>(elem_size(d));
}
void* advance(void* p, int64_t elems, DType d) { return static_cast<char*>(p) + elems * static_cast<int64_t>(elem_size(d)); }

}  // namespace

// cuBLASLt serves a product at full speed only when every extent that is contiguous in memory
// is a whole number of 16-byte segments; otherwise it falls back to kernels several times
// slower (docs/architecture.md gives the figures). A vocabulary such as GPT-2's 50257 is such an extent. The product then runs as a head of whole
// segments and a tail of the rest (under 16 bytes): each part at its own best speed.
//   m (rows of D, contiguous in D, and in A untransposed) and n (contiguous in B transposed):
//   the parts write disjoint blocks of D, so the result is the same as one product's.
//   k (contiguous in A transposed and in B untransposed): the tail adds into D; only a float32 D
//   is split, where the sum stays in float32 (a 16-bit D would be rounded twice).
Status gemm(const GemmCall& c) {
  if (c.scale && c.beta != 0.0f && c.beta != 1.0f) {
    return Status(StatusCode::kInvalidArgument, "internal: a product scaled on the device takes beta 0 or 1");
  }
  const int64_t k = c.transpose_a ? c.a.rows : c.a.cols;
  int64_t qm = per16(c.d_dtype);
  if (!c.transpose_a) qm = std::max(qm, per16(c.a.dtype));
  if (const int64_t head = aligned_head(c.m, qm)) {
    GemmCall h = c, t = c;
    h.m = head;
    t.m = c.m - head;
    if (c.transpose_a) {  // A stored k x m
      h.a.cols = head;
      t.a.cols = t.m;
      t.a.data = advance(c.a.data, head * c.a.ld, c.a.dtype);
    } else {  // A stored m x k
      h.a.rows = head;
      t.a.rows = t.m;
      t.a.data = advance(c.a.data, head, c.a.dtype);
    }
    t.d = advance(c.d, head, c.d_dtype);
    if (c.bias) t.bias = advance(c.bias, head, c.bias_dtype);
    const Status st = gemm(h);
    return st.ok() ? gemm(t) : st;
  }
  if (c.transpose_b) {
    if (const int64_t head = aligned_head(c.n, per16(c.b.dtype))) {
      GemmCall h = c, t = c;  // B stored n x k
      h.n = head;
      t.n = c.n - head;
      h.b.rows = head;
      t.b.rows = t.n;
      t.b.data = advance(c.b.data, head, c.b.dtype);
      t.d = advance(c.d, head * c.ld_d, c.d_dtype);
      const Status st = gemm(h);
      return st.ok() ? gemm(t) : st;
    }
  }
  const bool k_contiguous = c.transpose_a || !c.transpose_b;
  if (k_contiguous && c.d_dtype == DType::kFloat32) {
    if (const int64_t head = aligned_head(k, per16(c.a.dtype))) {
      GemmCall h = c, t = c;
      if (c.transpose_a) {  // A stored k x m
        h.a.rows = head;
        t.a.rows = k - head;
        t.a.data = advance(c.a.data, head, c.a.dtype);
      } else {  // A stored m x k
        h.a.cols = head;
        t.a.cols = k - head;
        t.a.data = advance(c.a.data, head * c.a.ld, c.a.dtype);
      }
      if (c.transpose_b) {  // B stored n x k
        h.b.cols = head;
        t.b.cols = k - head;
        t.b.data = advance(c.b.data, head * c.b.ld, c.b.dtype);
      } else {  // B stored k x n
        h.b.rows = head;
        t.b.rows = k - head;
        t.b.data = advance(c.b.data, head, c.b.dtype);
      }
      t.beta = 1.0f;  // the tail adds to the head's result (bias and beta applied once, there)
      t.bias = nullptr;
      const Status st = gemm(h);
      return st.ok() ? gemm(t) : st;
    }
  }
  return gemm_whole(c);
}

}  // namespace cuda
}  // namespace fusedce
