// fusedce public types: dtypes, reductions, device handle, framework-free views, options and
// status. Nothing here depends on torch or on CUDA headers; a CUDA stream travels as `void*`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace fusedce {

/// Element types a view can hold. Logits and gradients use the floating types; targets use
/// kInt32 / kInt64; class weights and losses are kFloat32; num_correct is kInt64.
enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt32 = 3, kInt64 = 4 };

/// Size in bytes of one element of `dtype`.
size_t dtype_size(DType dtype);
/// Readable name ("float32", "bfloat16", ...).
const char* dtype_name(DType dtype);

/// How per-row losses are combined (docs/contract.md, "Reductions").
enum class Reduction : int32_t { kNone = 0, kSum = 1, kMean = 2 };
const char* reduction_name(Reduction reduction);

enum class DeviceType : int32_t { kCPU = 0, kCUDA = 1 };

/// Where a call runs. For CUDA, `stream` is a cudaStream_t (nullptr = the legacy default
/// stream) and all work is enqueued on it; for the CPU, `num_threads` caps the worker threads
/// (0 = all hardware threads).
struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  void* stream = nullptr;
  int num_threads = 0;

  static Device cpu(int num_threads = 0) { return Device{DeviceType::kCPU, 0, nullptr, num_threads}; }
  static Device cuda(int index = 0, void* stream = nullptr) {
    return Device{DeviceType::kCUDA, index, stream, 0};
  }
};

/// A row-major matrix: `rows` x `cols`, unit stride along a row, `row_stride` elements between
/// row starts (>= cols; any value for rows <= 1). A null `data` means "not given".
struct MatrixView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t rows = 0;
  int64_t cols = 0;
  int64_t row_stride = 0;

  bool empty() const { return data == nullptr; }
};

/// A vector of `size` elements, `stride` elements apart (1 = contiguous).
/// A null `data` means "not given".
struct VectorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int64_t size = 0;
  int64_t stride = 1;

  bool empty() const { return data == nullptr; }
};

/// Make a contiguous matrix view (row_stride = cols).
inline MatrixView matrix(void* data, DType dtype, int64_t rows, int64_t cols) {
  return MatrixView{data, dtype, rows, cols, cols};
}
inline MatrixView matrix(void* data, DType dtype, int64_t rows, int64_t cols, int64_t row_stride) {
  return MatrixView{data, dtype, rows, cols, row_stride};
}
inline VectorView vector(void* data, DType dtype, int64_t size, int64_t stride = 1) {
  return VectorView{data, dtype, size, stride};
}

/// Scratch memory on the call's device, from the caller (see *_workspace_size).
struct Workspace {
  void* data = nullptr;
  size_t bytes = 0;
};

/// The options of docs/contract.md ("Options"). Defaults reproduce plain `F.cross_entropy`.
struct Options {
  int64_t ignore_index = -100;   ///< rows with this target contribute nothing
  float label_smoothing = 0.0f;  ///< eps in [0, 1]
  float logit_scale = 1.0f;      ///< z = logit_scale * x (before the softcap)
  float softcap = 0.0f;          ///< > 0: z = softcap * tanh(z / softcap); 0 = off
  float z_loss = 0.0f;           ///< adds z_loss * lse^2 per non-ignored row
  VectorView class_weight;       ///< float32 (V,), PyTorch's `weight=`; empty = none
  Reduction reduction = Reduction::kMean;
  bool return_metrics = false;  ///< fill num_correct / entropy_sum (forward jobs)
  bool inplace_backward = false;     ///< forward-with-gradient: dlogits is the logits buffer
  bool check_targets = false;    ///< CUDA: verify targets (one device sync) and report the
                                 ///< first bad row; CPU always checks
};

enum class StatusCode : int32_t {
  kOk = 0,
  kInvalidArgument = 1,  ///< a malformed call; the message names the argument
  kTargetOutOfRange = 2, ///< a target outside [0, V) that is not ignore_index
  kUnsupported = 3,      ///< e.g. a CUDA call in a build without CUDA
  kDeviceError = 4,      ///< the device runtime reported an error
  kWorkspaceTooSmall = 5,
};

/// Result of every entry point. Never throws, never exits.
class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  static Status Ok() { return Status(); }

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  StatusCode code_ = StatusCode::kOk;
  std::string message_;
};

}  // namespace fusedce
