# Included before enable_language(HIP) when FUSEDCE_HIP is on. CMake's HIP support looks for the
# ROCm runtime's CMake package at <rocm>/lib/cmake/hip-lang, and a bare clang looks for the device
# libraries under <rocm>/amdgcn. Debian's and Ubuntu's ROCm packages (hipcc, libamdhip64-dev,
# rocm-device-libs) install both under lib/<multiarch>/ instead, and build HIP with a versioned
# clang (clang++-15 for ROCm 5.2 on bookworm). On such a layout, and only when the user has not
# chosen a compiler or a ROCm root, this points CMake and clang at them. Elsewhere (AMD's own
# packages under /opt/rocm) it does nothing.

if(DEFINED CMAKE_HIP_COMPILER_ROCM_ROOT OR DEFINED CMAKE_HIP_COMPILER OR DEFINED ENV{HIPCXX})
  return()
endif()
find_program(FUSEDCE_HIPCC hipcc)
if(NOT FUSEDCE_HIPCC)
  return()
endif()
get_filename_component(_fusedce_rocm "${FUSEDCE_HIPCC}" DIRECTORY)
get_filename_component(_fusedce_rocm "${_fusedce_rocm}" DIRECTORY)  # <rocm>/bin/hipcc -> <rocm>
set(_fusedce_rocm_lib "${_fusedce_rocm}/lib/${CMAKE_LIBRARY_ARCHITECTURE}")
if(NOT CMAKE_LIBRARY_ARCHITECTURE
   OR EXISTS "${_fusedce_rocm}/lib/cmake/hip-lang/hip-lang-config.cmake"
   OR NOT EXISTS "${_fusedce_rocm_lib}/cmake/hip-lang/hip-lang-config.cmake")
  return()
endif()

# The clang hipcc itself runs (hipcc.pl names it, e.g. "$HIP_CLANG_PATH/clang++-15").
set(_fusedce_clang_name clang++)
if(EXISTS "${FUSEDCE_HIPCC}.pl")
  file(STRINGS "${FUSEDCE_HIPCC}.pl" _fusedce_line REGEX "clang\\+\\+-[0-9]+" LIMIT_COUNT 1)
  if(_fusedce_line MATCHES "(clang\\+\\+-[0-9]+)")
    set(_fusedce_clang_name "${CMAKE_MATCH_1}")
  endif()
endif()
find_program(_fusedce_hip_clang NAMES ${_fusedce_clang_name} REQUIRED NO_CACHE)
set(CMAKE_HIP_COMPILER "${_fusedce_hip_clang}" CACHE FILEPATH "HIP compiler (the clang hipcc runs)")

# A ROCm root in the build tree whose lib/cmake is the multiarch one (hip-lang-config.cmake
# resolves its real location, so the prefix it reports is still <rocm>).
set(_fusedce_shim "${CMAKE_BINARY_DIR}/CMakeFiles/fusedce-rocm-root")
file(MAKE_DIRECTORY "${_fusedce_shim}/lib")
file(CREATE_LINK "${_fusedce_rocm_lib}/cmake" "${_fusedce_shim}/lib/cmake" SYMBOLIC)
set(CMAKE_HIP_COMPILER_ROCM_ROOT "${_fusedce_shim}" CACHE PATH "ROCm root for CMake's HIP support")

# hip-lang's dependency amd_comgr, also for the project CMake builds to test the compiler (it
# runs before the library architecture is known, so the multiarch directory is not searched).
set(amd_comgr_DIR "${_fusedce_rocm_lib}/cmake/amd_comgr" CACHE PATH "amd_comgr's CMake package")
list(APPEND CMAKE_TRY_COMPILE_PLATFORM_VARIABLES amd_comgr_DIR)

# clang does not find this layout by itself.
set(CMAKE_HIP_FLAGS_INIT
    "${CMAKE_HIP_FLAGS_INIT} --rocm-path=${_fusedce_rocm} --rocm-device-lib-path=${_fusedce_rocm_lib}/amdgcn/bitcode")
message(STATUS "fusedce: HIP from the ${_fusedce_rocm_lib} layout (Debian/Ubuntu ROCm packages), "
               "compiler ${CMAKE_HIP_COMPILER}")
