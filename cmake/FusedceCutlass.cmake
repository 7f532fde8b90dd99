# CUTLASS / CuTe C++ headers for the Hopper matrix-product kernels, fetched at configure time
# from the package index (the nvidia-cutlass wheel carries them), at one pinned version checked
# by its SHA-256. Nothing of CUTLASS is kept in the repository.
#
# Where the wheel comes from, first match wins:
#   1. FUSEDCE_CUTLASS_WHEEL: a wheel file already here (machines without internet: carry it);
#   2. .deps/ of the source tree: a wheel an earlier configure downloaded;
#   3. a download from the package index's file host, into .deps/ (checked as above).
# Sets FUSEDCE_CUTLASS_INCLUDE_DIR (the directory holding cutlass/ and cute/).

set(FUSEDCE_CUTLASS_VERSION 4.2.0.0)
set(FUSEDCE_CUTLASS_SHA256 f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6)
set(FUSEDCE_CUTLASS_URL "https://files.pythonhosted.org/packages/21/6b/e86fc2fd536dd4b8bd2209aa31d7002610c501b0802337787eac9c9b328c/nvidia_cutlass-4.2.0.0-py3-none-any.whl")
set(_fusedce_cutlass_name nvidia_cutlass-${FUSEDCE_CUTLASS_VERSION}-py3-none-any.whl)
set(FUSEDCE_CUTLASS_WHEEL "" CACHE FILEPATH "A local ${_fusedce_cutlass_name} (offline builds)")

set(_fusedce_cutlass_cache ${CMAKE_CURRENT_SOURCE_DIR}/.deps)
set(_fusedce_cutlass_wheel ${FUSEDCE_CUTLASS_WHEEL})
if(NOT _fusedce_cutlass_wheel)
  set(_fusedce_cutlass_wheel ${_fusedce_cutlass_cache}/${_fusedce_cutlass_name})
  if(NOT EXISTS ${_fusedce_cutlass_wheel})
    message(STATUS "fusedce: downloading nvidia-cutlass ${FUSEDCE_CUTLASS_VERSION} (CUTLASS headers)")
    file(DOWNLOAD ${FUSEDCE_CUTLASS_URL} ${_fusedce_cutlass_wheel}.part
         EXPECTED_HASH SHA256=${FUSEDCE_CUTLASS_SHA256} STATUS _fusedce_dl TLS_VERIFY ON)
    list(GET _fusedce_dl 0 _fusedce_dl_code)
    if(NOT _fusedce_dl_code EQUAL 0)
      file(REMOVE ${_fusedce_cutlass_wheel}.part)
      message(FATAL_ERROR "fusedce: could not download nvidia-cutlass ${FUSEDCE_CUTLASS_VERSION} (${_fusedce_dl}); "
                          "pass -DFUSEDCE_CUTLASS_WHEEL=<path to ${_fusedce_cutlass_name}> "
                          "or -DFUSEDCE_CUTLASS=OFF (cuBLASLt products only)")
    endif()
    file(RENAME ${_fusedce_cutlass_wheel}.part ${_fusedce_cutlass_wheel})
  endif()
endif()

file(SHA256 ${_fusedce_cutlass_wheel} _fusedce_cutlass_sum)
if(NOT _fusedce_cutlass_sum STREQUAL FUSEDCE_CUTLASS_SHA256)
  message(FATAL_ERROR "fusedce: ${_fusedce_cutlass_wheel} has SHA-256 ${_fusedce_cutlass_sum}, "
                      "expected ${FUSEDCE_CUTLASS_SHA256} (nvidia-cutlass ${FUSEDCE_CUTLASS_VERSION})")
endif()

set(_fusedce_cutlass_root ${CMAKE_CURRENT_BINARY_DIR}/_deps/cutlass-${FUSEDCE_CUTLASS_VERSION})
set(FUSEDCE_CUTLASS_INCLUDE_DIR ${_fusedce_cutlass_root}/cutlass_library/source/include)
if(NOT EXISTS ${FUSEDCE_CUTLASS_INCLUDE_DIR}/cutlass/version.h)
  file(ARCHIVE_EXTRACT INPUT ${_fusedce_cutlass_wheel} DESTINATION ${_fusedce_cutlass_root}
       PATTERNS "cutlass_library/source/include/*")
endif()
if(NOT EXISTS ${FUSEDCE_CUTLASS_INCLUDE_DIR}/cute/tensor.hpp)
  message(FATAL_ERROR "fusedce: no CUTLASS headers in ${_fusedce_cutlass_wheel}")
endif()
message(STATUS "fusedce: CUTLASS ${FUSEDCE_CUTLASS_VERSION} headers in ${FUSEDCE_CUTLASS_INCLUDE_DIR}")
