# The Kernels Hub layout of the torch extension (FUSEDCE_KERNELS_HUB=ON), installed as the
# component kernels_hub under CMAKE_INSTALL_PREFIX, which becomes a kernel repository:
#
#   build.toml
#   build/<variant>/metadata.json         name, id (= the ops' namespace), backend (+ CUDA archs)
#   build/<variant>/__init__.py, _ops.py  torch-ext/fusedce: the Hub API
#   build/<variant>/_fusedce/             python/fusedce (the front end), _build_info.py and the
#                                         extension library
#
# <variant> is named as the kernels package selects builds: torch<major><minor>-cxx11|cxx98-
# cpu|cu<major><minor>-<cpu>-linux, from the torch the extension is compiled against (its C++
# ABI, its CUDA version). Each build compiles its ops under a namespace of its own,
# _fusedce_<backend>_<source revision>, so that it loads beside an installed fusedce (namespace
# "fusedce") and beside other builds.

function(_fusedce_hub_facts)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c [=[
import platform, torch
print(";".join([torch.__version__.split("+")[0], torch.version.cuda or "",
                str(int(torch._C._GLIBCXX_USE_CXX11_ABI)), platform.machine()]), end="")
]=]
    OUTPUT_VARIABLE _facts RESULT_VARIABLE _result)
  if(NOT _result EQUAL 0)
    message(FATAL_ERROR "FUSEDCE_KERNELS_HUB: cannot ask ${Python_EXECUTABLE} for torch's facts")
  endif()
  list(GET _facts 0 _torch_version)
  list(GET _facts 1 _torch_cuda)
  list(GET _facts 2 _cxx11)
  list(GET _facts 3 _machine)
  string(REPLACE "." ";" _tv "${_torch_version}")
  list(GET _tv 0 _tmaj)
  list(GET _tv 1 _tmin)
  if(_cxx11)
    set(_abi cxx11)
  else()
    set(_abi cxx98)
  endif()
  if(FUSEDCE_TORCH_WITH_CUDA)
    string(REPLACE "." ";" _cv "${_torch_cuda}")
    list(GET _cv 0 _cmaj)
    list(GET _cv 1 _cmin)
    set(_backend cuda)
    set(_compute "cu${_cmaj}${_cmin}")
  else()
    set(_backend cpu)
    set(_compute cpu)
  endif()
  if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux")
    message(FATAL_ERROR "FUSEDCE_KERNELS_HUB: Linux builds only (the variant names its OS)")
  endif()
  set(FUSEDCE_HUB_BACKEND ${_backend} PARENT_SCOPE)
  set(FUSEDCE_HUB_VARIANT "torch${_tmaj}${_tmin}-${_abi}-${_compute}-${_machine}-linux" PARENT_SCOPE)
endfunction()

# The source revision that names a build: the commit of the sources when they are a git checkout
# of their own (the repository's top is the project's root), else the project's version. Never
# the commit of a repository that merely encloses the sources (a tarball unpacked inside another
# checkout would take that checkout's commit).
function(fusedce_source_revision out)
  set(_rev "")
  execute_process(COMMAND git rev-parse --show-toplevel WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
                  OUTPUT_VARIABLE _top OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET RESULT_VARIABLE _git)
  if(_git EQUAL 0 AND NOT _top STREQUAL "")
    file(REAL_PATH "${_top}" _top)
    file(REAL_PATH "${PROJECT_SOURCE_DIR}" _root)
    if(_top STREQUAL _root)
      execute_process(COMMAND git rev-parse --short=7 HEAD WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}"
                      OUTPUT_VARIABLE _rev OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
  endif()
  if(_rev STREQUAL "")
    string(REGEX REPLACE "[^0-9A-Za-z]" "_" _rev "v${PROJECT_VERSION}")
  endif()
  set(${out} "${_rev}" PARENT_SCOPE)
endfunction()

# The namespace (and metadata id) of this build: the backend and the source revision.
function(fusedce_hub_namespace out)
  _fusedce_hub_facts()
  fusedce_source_revision(_rev)
  set(${out} "_fusedce_${FUSEDCE_HUB_BACKEND}_${_rev}" PARENT_SCOPE)
  set(FUSEDCE_HUB_BACKEND ${FUSEDCE_HUB_BACKEND} PARENT_SCOPE)
  set(FUSEDCE_HUB_VARIANT ${FUSEDCE_HUB_VARIANT} PARENT_SCOPE)
endfunction()

# The CUDA architectures as the kernels package reads them: "8.0" for machine code only,
# "9.0+PTX" where PTX is embedded too (CMake's "90" and "90-virtual").
function(_fusedce_hub_cuda_archs out)
  set(_archs)
  foreach(_a IN LISTS CMAKE_CUDA_ARCHITECTURES)
    string(REGEX MATCH "^([0-9]+)([0-9])(-real|-virtual)?$" _m "${_a}")
    if(NOT _m)
      message(FATAL_ERROR "FUSEDCE_KERNELS_HUB: cannot name the CUDA architecture '${_a}'")
    endif()
    set(_name "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}")
    if(NOT CMAKE_MATCH_3 STREQUAL "-real")
      string(APPEND _name "+PTX")
    endif()
    list(APPEND _archs "\"${_name}\"")
  endforeach()
  list(JOIN _archs ", " _joined)
  set(${out} "[${_joined}]" PARENT_SCOPE)
endfunction()

function(fusedce_hub_install)
  set(_dir "build/${FUSEDCE_HUB_VARIANT}")
  if(FUSEDCE_HUB_BACKEND STREQUAL "cuda")
    _fusedce_hub_cuda_archs(_archs)
    set(FUSEDCE_HUB_BACKEND_JSON "{\"type\": \"cuda\", \"archs\": ${_archs}}")
  else()
    set(FUSEDCE_HUB_BACKEND_JSON "{\"type\": \"cpu\"}")
  endif()
  configure_file("${PROJECT_SOURCE_DIR}/torch-ext/metadata.json.in"
                 "${CMAKE_CURRENT_BINARY_DIR}/metadata.json" @ONLY)
  message(STATUS "fusedce Kernels Hub variant ${FUSEDCE_HUB_VARIANT}, ops namespace ${FUSEDCE_TORCH_NAMESPACE}")

  set(_c COMPONENT kernels_hub EXCLUDE_FROM_ALL)
  install(FILES "${PROJECT_SOURCE_DIR}/build.toml" DESTINATION . ${_c})
  install(FILES "${CMAKE_CURRENT_BINARY_DIR}/metadata.json" DESTINATION "${_dir}" ${_c})
  install(DIRECTORY "${PROJECT_SOURCE_DIR}/torch-ext/fusedce/" DESTINATION "${_dir}" ${_c}
          FILES_MATCHING PATTERN "*.py" PATTERN "__pycache__" EXCLUDE)
  # The front end: the package's modules, not its benchmark, demo or data.
  install(DIRECTORY "${PROJECT_SOURCE_DIR}/python/fusedce/" DESTINATION "${_dir}/_fusedce" ${_c}
          FILES_MATCHING PATTERN "*.py"
          PATTERN "__pycache__" EXCLUDE PATTERN "bench" EXCLUDE PATTERN "demo" EXCLUDE
          PATTERN "data" EXCLUDE)
  install(FILES "${CMAKE_CURRENT_BINARY_DIR}/_build_info.py" DESTINATION "${_dir}/_fusedce" ${_c})
  install(TARGETS fusedce_torch LIBRARY DESTINATION "${_dir}/_fusedce" ${_c})
endfunction()
