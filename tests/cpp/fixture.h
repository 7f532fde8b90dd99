// The parameterised fixture every backend-dependent suite derives from: the parameter names a
// backend (directly, or as a `backend` member); SetUp finds it or skips the test, saying why.
#pragma once

#include <string>

#include "backend.h"
#include "gtest/gtest.h"

namespace fusedce_test {

inline BackendKind backend_kind(BackendKind kind) { return kind; }
template <typename Param>
BackendKind backend_kind(const Param& param) {
  return param.backend;
}

template <typename Param>
class BackendTest : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    std::string why;
    const BackendKind kind = backend_kind(this->GetParam());
    backend_ = find_backend(kind, &why);
    if (backend_ == nullptr) GTEST_SKIP() << backend_name(kind) << " backend not available: " << why;
  }
  Backend& backend() { return *backend_; }

 private:
  Backend* backend_ = nullptr;
};

}  // namespace fusedce_test
