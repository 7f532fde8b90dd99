// The namespace of the torch ops (torch.ops.<namespace> in Python). The Python package's own
// build uses "fusedce"; the Kernels Hub build compiles the same bindings with a namespace of
// its own per build (FUSEDCE_TORCH_NAMESPACE, set by torch/CMakeLists.txt), because a namespace
// can be registered once per process and the two may be loaded side by side.
#pragma once

#include <torch/library.h>

#ifndef FUSEDCE_TORCH_NAMESPACE
#define FUSEDCE_TORCH_NAMESPACE fusedce
#endif

// One level of indirection, so that the macro above is expanded before TORCH_LIBRARY pastes it.
#define FUSEDCE_TORCH_LIBRARY_(ns, m) TORCH_LIBRARY(ns, m)
#define FUSEDCE_TORCH_LIBRARY_FRAGMENT_(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define FUSEDCE_TORCH_LIBRARY_IMPL_(ns, key, m) TORCH_LIBRARY_IMPL(ns, key, m)
#define FUSEDCE_TORCH_LIBRARY(m) FUSEDCE_TORCH_LIBRARY_(FUSEDCE_TORCH_NAMESPACE, m)
#define FUSEDCE_TORCH_LIBRARY_FRAGMENT(m) FUSEDCE_TORCH_LIBRARY_FRAGMENT_(FUSEDCE_TORCH_NAMESPACE, m)
#define FUSEDCE_TORCH_LIBRARY_IMPL(key, m) FUSEDCE_TORCH_LIBRARY_IMPL_(FUSEDCE_TORCH_NAMESPACE, key, m)
