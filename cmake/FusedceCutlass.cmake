# CUTLASS / CuTe C++ headers for the Hopper matrix-product kernels, fetched at configure time
# from the package index by package name (the nvidia-cutlass wheel carries them), at one pinned
# version checked by its SHA-256. Nothing of CUTLASS is kept in the repository.
#
# Where the wheel comes from, first match wins:
#   1. FUSEDCE_CUTLASS_WHEEL: a wheel file already here (machines without internet: carry it);
#   2. .deps/ of the source tree: a wheel an earlier configure downloaded;
#   3. `pip download nvidia-cutlass==<version> --no-deps` into .deps/, through the Python found
#      here (the package index pip is set up for; checked as above).
# Sets FUSEDCE_CUTLASS_INCLUDE_DIR (the directory holding cutlass/ and cute/).

set(FUSEDCE_CUTLASS_VERSION 4.2.0.0)
set(FUSEDCE_CUTLASS_SHA256 f9599ada45c7bcb6bf53f7d3f0a7d154183e53451c01bfa59eecd37dd4a693f6)
set(_fusedce_cutlass_name nvidia_cutlass-${FUSEDCE_CUTLASS_VERSION}-py3-none-any.whl)
set(FUSEDCE_CUTLASS_WHEEL "" CACHE FILEPATH "A local ${_fusedce_cutlass_name} (offline builds)")

set(_fusedce_cutlass_cache ${CMAKE_CURRENT_SOURCE_DIR}/.deps)
set(_fusedce_cutlass_wheel ${FUSEDCE_CUTLASS_WHEEL})
if(NOT _fusedce_cutlass_wheel)
  set(_fusedce_cutlass_wheel ${_fusedce_cutlass_cache}/${_fusedce_cutlass_name})
  if(NOT EXISTS ${_fusedce_cutlass_wheel})
    # Python_EXECUTABLE when the build names one (scikit-build-core, the torch extension);
    # else python3 on the PATH, found under a name of its own so that no later
    # find_package(Python) inherits this choice.
    set(_fusedce_pip_python "${Python_EXECUTABLE}")
    if(NOT _fusedce_pip_python)
      find_program(_fusedce_pip_python_found NAMES python3 python)
      set(_fusedce_pip_python "${_fusedce_pip_python_found}")
    endif()
    if(NOT _fusedce_pip_python)
      message(FATAL_ERROR "fusedce: no Python to fetch nvidia-cutlass ${FUSEDCE_CUTLASS_VERSION} with pip; "
                          "pass -DFUSEDCE_CUTLASS_WHEEL=<path to ${_fusedce_cutlass_name}> "
                          "or -DFUSEDCE_CUTLASS=OFF (cuBLASLt products only)")
    endif()
    message(STATUS "fusedce: pip download nvidia-cutlass==${FUSEDCE_CUTLASS_VERSION} (CUTLASS headers)")
    set(_fusedce_cutlass_tmp ${_fusedce_cutlass_cache}/pip-download)
    file(REMOVE_RECURSE ${_fusedce_cutlass_tmp})
    execute_process(
      COMMAND "${_fusedce_pip_python}" -m pip download --quiet --no-deps --only-binary=:all:
              --dest "${_fusedce_cutlass_tmp}" "nvidia-cutlass==${FUSEDCE_CUTLASS_VERSION}"
      RESULT_VARIABLE _fusedce_pip OUTPUT_VARIABLE _fusedce_pip_out ERROR_VARIABLE _fusedce_pip_out)
    if(NOT _fusedce_pip EQUAL 0 OR NOT EXISTS ${_fusedce_cutlass_tmp}/${_fusedce_cutlass_name})
      file(REMOVE_RECURSE ${_fusedce_cutlass_tmp})
      message(FATAL_ERROR "fusedce: pip could not download nvidia-cutlass ${FUSEDCE_CUTLASS_VERSION} "
                          "(${_fusedce_pip_out}); pass -DFUSEDCE_CUTLASS_WHEEL=<path to ${_fusedce_cutlass_name}> "
                          "or -DFUSEDCE_CUTLASS=OFF (cuBLASLt products only)")
    endif()
    # Checked before it takes the cache's name: a wrong file never looks like a good download.
    file(SHA256 ${_fusedce_cutlass_tmp}/${_fusedce_cutlass_name} _fusedce_cutlass_sum)
    if(NOT _fusedce_cutlass_sum STREQUAL FUSEDCE_CUTLASS_SHA256)
      file(REMOVE_RECURSE ${_fusedce_cutlass_tmp})
      message(FATAL_ERROR "fusedce: pip's nvidia-cutlass ${FUSEDCE_CUTLASS_VERSION} has SHA-256 "
                          "${_fusedce_cutlass_sum}, expected ${FUSEDCE_CUTLASS_SHA256}")
    endif()
    file(RENAME ${_fusedce_cutlass_tmp}/${_fusedce_cutlass_name} ${_fusedce_cutlass_wheel})
    file(REMOVE_RECURSE ${_fusedce_cutlass_tmp})
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
