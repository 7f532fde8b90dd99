// The cross-entropy options as they cross the binding: six scalar arguments in every op's schema
// (FUSEDCE_CE_ARGS, the one place their schema text is written; python/fusedce/_options.py keeps
// the same order and a test compares the two), one fusedce::Options inside the kernels.
//
// A kernel is written with one `fusedce::Options` parameter where the schema has the six
// arguments; schema_kernel<kernel>() is the function the dispatcher calls, with the six
// arguments in that place, which it turns into the Options with options_of (the one converter)
// before calling the kernel. The values are checked by the core (check_options: ranges of
// label_smoothing, logit_scale, softcap, z_loss), which names the argument; here only what the
// core cannot see: the reduction's name, and the class weights' device, dtype and rank.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Optional.h>
#include <c10/util/string_view.h>
#include <fusedce/fusedce.h>

#include <cstdint>
#include <type_traits>

// The options' schema text, in the order of fusedce::Options' fields as the ops take them.
#define FUSEDCE_CE_ARGS                                                                     \
  "int ignore_index, str reduction, float label_smoothing, float logit_scale, float softcap, " \
  "float z_loss"

namespace fusedce_torch {

inline fusedce::Reduction reduction_of(c10::string_view r) {
  if (r == "mean") return fusedce::Reduction::kMean;
  if (r == "sum") return fusedce::Reduction::kSum;
  if (r == "none") return fusedce::Reduction::kNone;
  TORCH_CHECK_VALUE(false, "fusedce: reduction must be 'none', 'sum' or 'mean', got '", r, "'");
  return fusedce::Reduction::kMean;  // unreachable
}

// The op arguments of FUSEDCE_CE_ARGS as the core's Options (no class weights yet: see
// with_class_weight). The core holds the four reals in float32.
inline fusedce::Options options_of(int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                                   double logit_scale, double softcap, double z_loss) {
  fusedce::Options o;
  o.ignore_index = ignore_index;
  o.reduction = reduction_of(reduction);
  o.label_smoothing = static_cast<float>(label_smoothing);
  o.logit_scale = static_cast<float>(logit_scale);
  o.softcap = static_cast<float>(softcap);
  o.z_loss = static_cast<float>(z_loss);
  return o;
}

// `o` with the class weights `weight` (float32 (V,) on `like`'s device), which must outlive the
// call; `name` is the weights' argument name, `like_name` that of the tensor that sets the device.
inline fusedce::Options with_class_weight(fusedce::Options o, const c10::optional<at::Tensor>& weight,
                                          const char* name, const at::Tensor& like, const char* like_name) {
  if (!weight.has_value()) return o;
  TORCH_CHECK_VALUE(weight->device() == like.device(), "fusedce: ", name, " is on ", weight->device(), " but ",
                    like_name, " are on ", like.device());
  TORCH_CHECK_VALUE(weight->scalar_type() == at::kFloat, "fusedce: ", name, " must be float32, got ",
                    weight->scalar_type());
  TORCH_CHECK_VALUE(weight->dim() == 1, "fusedce: ", name, " must be 1-D (V,), got shape ", weight->sizes());
  const int64_t stride = weight->numel() > 1 ? weight->stride(0) : 1;
  o.class_weight = fusedce::vector(weight->numel() > 0 ? const_cast<void*>(weight->const_data_ptr()) : nullptr,
                                   fusedce::DType::kFloat32, weight->numel(), stride);
  return o;
}

namespace detail {

template <class... T>
struct Types {};

// A kernel's parameter types split at its fusedce::Options parameter (found = false: it has none).
template <class Before, class Rest>
struct SplitAtOptions {
  static constexpr bool found = false;
};
template <class... B, class... A>
struct SplitAtOptions<Types<B...>, Types<fusedce::Options, A...>> {
  static constexpr bool found = true;
  using before = Types<B...>;
  using after = Types<A...>;
};
template <class... B, class H, class... A>
struct SplitAtOptions<Types<B...>, Types<H, A...>> : SplitAtOptions<Types<B..., H>, Types<A...>> {};

template <auto kernel, class R, class Before, class After>
struct WithOptionArguments;
template <auto kernel, class R, class... B, class... A>
struct WithOptionArguments<kernel, R, Types<B...>, Types<A...>> {
  static R call(B... before, int64_t ignore_index, c10::string_view reduction, double label_smoothing,
                double logit_scale, double softcap, double z_loss, A... after) {
    return kernel(before..., options_of(ignore_index, reduction, label_smoothing, logit_scale, softcap, z_loss),
                  after...);
  }
};

template <auto kernel, class F = decltype(kernel)>
struct SchemaKernel;
template <auto kernel, class R, class... P>
struct SchemaKernel<kernel, R (*)(P...)> {
  using split = SplitAtOptions<Types<>, Types<P...>>;
  static constexpr auto function() {
    if constexpr (split::found) {
      return &WithOptionArguments<kernel, R, typename split::before, typename split::after>::call;
    } else {
      return kernel;
    }
  }
};

}  // namespace detail

// The function the dispatcher calls for `kernel`: the kernel itself when it takes no Options,
// else a function with the six FUSEDCE_CE_ARGS arguments in place of its Options parameter.
template <auto kernel>
constexpr auto schema_kernel() {
  return detail::SchemaKernel<kernel>::function();
}

}  // namespace fusedce_torch
