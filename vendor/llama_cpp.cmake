# Provides the pinned llama.cpp source tree in CLLM_LLAMA_DIR.
#
# The pin is the PyPI source distribution of llama-cpp-python, which carries upstream llama.cpp
# in its vendor/llama.cpp. No llama.cpp code is committed here; it is found, in this order:
#   1. CLLM_LLAMA_SOURCE (CMake variable or environment variable): a llama.cpp directory, the
#      sdist itself, or an archive of a llama.cpp tree (offline builds, the GPU machine);
#   2. the cached copy unpacked by an earlier build;
#   3. `pip download` by package name, sha256 check, unpack of vendor/llama.cpp only.

set(CLLM_LLAMA_PACKAGE "llama-cpp-python")
set(CLLM_LLAMA_VERSION "0.3.36")
set(CLLM_LLAMA_COMMIT "0c1e57098")
set(CLLM_LLAMA_SDIST "llama_cpp_python-${CLLM_LLAMA_VERSION}.tar.gz")
set(CLLM_LLAMA_SHA256 "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e")

set(CLLM_LLAMA_SOURCE "$ENV{CLLM_LLAMA_SOURCE}" CACHE PATH
    "llama.cpp source: a directory, the pinned sdist, or an archive of a llama.cpp tree")

if(DEFINED ENV{CLLM_CACHE_DIR})
    set(_cllm_cache "$ENV{CLLM_CACHE_DIR}")
elseif(DEFINED ENV{XDG_CACHE_HOME})
    set(_cllm_cache "$ENV{XDG_CACHE_HOME}/cllm")
else()
    set(_cllm_cache "$ENV{HOME}/.cache/cllm")
endif()
set(_cllm_cached_tree "${_cllm_cache}/llama.cpp-${CLLM_LLAMA_COMMIT}")

# The parts of the tree a build of libllama, ggml and llama-server reads: models/, docs/, media/
# and benches/ (three quarters of the archive) stay packed.
set(_cllm_tree_parts CMakeLists.txt LICENSE cmake include src ggml common tools vendor licenses)

function(_cllm_find_tree root out)
    file(GLOB _headers LIST_DIRECTORIES false "${root}/include/llama.h" "${root}/*/include/llama.h"
        "${root}/*/vendor/llama.cpp/include/llama.h")
    foreach(_header IN LISTS _headers)
        get_filename_component(_tree "${_header}" DIRECTORY)
        get_filename_component(_tree "${_tree}" DIRECTORY)
        if(EXISTS "${_tree}/ggml/CMakeLists.txt")
            set(${out} "${_tree}" PARENT_SCOPE)
            return()
        endif()
    endforeach()
    message(FATAL_ERROR "cllm: no llama.cpp tree (include/llama.h beside ggml/) under ${root}")
endfunction()

# Unpacks an archive and moves the llama.cpp tree inside it to `dest`. From the pinned sdist only
# the parts of vendor/llama.cpp a build reads; any other archive is taken whole.
function(_cllm_unpack archive dest)
    set(_tmp "${dest}.unpacking")
    file(REMOVE_RECURSE "${_tmp}")
    set(_patterns "")
    get_filename_component(_name "${archive}" NAME)
    if(_name STREQUAL CLLM_LLAMA_SDIST)
        string(REPLACE ".tar.gz" "" _top "${_name}")
        list(TRANSFORM _cllm_tree_parts PREPEND "${_top}/vendor/llama.cpp/" OUTPUT_VARIABLE _parts)
        set(_patterns PATTERNS ${_parts})
    endif()
    message(STATUS "cllm: unpacking ${archive}")
    file(ARCHIVE_EXTRACT INPUT "${archive}" DESTINATION "${_tmp}" ${_patterns})
    _cllm_find_tree("${_tmp}" _tree)
    file(REMOVE_RECURSE "${dest}")
    file(RENAME "${_tree}" "${dest}")
    file(REMOVE_RECURSE "${_tmp}")
endfunction()

function(_cllm_check_sha256 file)
    file(SHA256 "${file}" _actual)
    if(NOT _actual STREQUAL CLLM_LLAMA_SHA256)
        message(FATAL_ERROR "cllm: ${file} has sha256 ${_actual}, expected ${CLLM_LLAMA_SHA256}")
    endif()
endfunction()

function(_cllm_pip_download dest_dir)
    find_package(Python COMPONENTS Interpreter REQUIRED)
    # The build may run inside pip's isolated environment, where pip itself is not importable:
    # drop the isolation's variables so the interpreter sees its own site-packages.
    set(_clean_env ${CMAKE_COMMAND} -E env --unset=PYTHONPATH --unset=PYTHONNOUSERSITE
        --unset=PIP_BUILD_TRACKER --unset=PIP_REQ_TRACKER)
    set(_pip_args download --no-deps --no-binary ${CLLM_LLAMA_PACKAGE}
        "${CLLM_LLAMA_PACKAGE}==${CLLM_LLAMA_VERSION}" -d "${dest_dir}")
    find_program(_cllm_pip NAMES pip3 pip)
    set(_candidates "${Python_EXECUTABLE}" "-m" "pip")
    message(STATUS "cllm: downloading ${CLLM_LLAMA_PACKAGE}==${CLLM_LLAMA_VERSION} (llama.cpp ${CLLM_LLAMA_COMMIT})")
    execute_process(COMMAND ${_clean_env} ${_candidates} ${_pip_args} RESULT_VARIABLE _rc)
    if(NOT _rc EQUAL 0 AND _cllm_pip)
        execute_process(COMMAND ${_clean_env} ${_cllm_pip} ${_pip_args} RESULT_VARIABLE _rc)
    endif()
    if(NOT _rc EQUAL 0)
        message(FATAL_ERROR "cllm: pip download of ${CLLM_LLAMA_PACKAGE}==${CLLM_LLAMA_VERSION} failed; "
            "pass a local copy with -DCLLM_LLAMA_SOURCE=<dir or archive>")
    endif()
endfunction()

if(CLLM_LLAMA_SOURCE)
    if(IS_DIRECTORY "${CLLM_LLAMA_SOURCE}")
        _cllm_find_tree("${CLLM_LLAMA_SOURCE}" CLLM_LLAMA_DIR)
    else()
        get_filename_component(_name "${CLLM_LLAMA_SOURCE}" NAME)
        if(_name STREQUAL CLLM_LLAMA_SDIST)
            _cllm_check_sha256("${CLLM_LLAMA_SOURCE}")
        endif()
        set(CLLM_LLAMA_DIR "${CMAKE_BINARY_DIR}/llama.cpp-src")
        if(NOT EXISTS "${CLLM_LLAMA_DIR}/include/llama.h"
           OR "${CLLM_LLAMA_SOURCE}" IS_NEWER_THAN "${CLLM_LLAMA_DIR}/include/llama.h")
            _cllm_unpack("${CLLM_LLAMA_SOURCE}" "${CLLM_LLAMA_DIR}")
        endif()
    endif()
elseif(EXISTS "${_cllm_cached_tree}/.cllm-verified")
    set(CLLM_LLAMA_DIR "${_cllm_cached_tree}")
else()
    set(_sdist "${_cllm_cache}/${CLLM_LLAMA_SDIST}")
    if(NOT EXISTS "${_sdist}")
        _cllm_pip_download("${_cllm_cache}")
    endif()
    _cllm_check_sha256("${_sdist}")
    _cllm_unpack("${_sdist}" "${_cllm_cached_tree}")
    file(WRITE "${_cllm_cached_tree}/.cllm-verified" "${CLLM_LLAMA_SHA256}\n")
    set(CLLM_LLAMA_DIR "${_cllm_cached_tree}")
endif()
message(STATUS "cllm: llama.cpp ${CLLM_LLAMA_COMMIT} from ${CLLM_LLAMA_DIR}")

# Patches to the pinned tree (vendor/patches/*.patch, each says why at its top). The cached tree
# stays as released: the benchmark builds its llama-server from it. The files a patch touches are
# copied into the build directory, patched there, and compiled in place of the originals.
file(GLOB CLLM_LLAMA_PATCHES CONFIGURE_DEPENDS "${CMAKE_CURRENT_LIST_DIR}/patches/*.patch")
set(_cllm_patched_tree "${CMAKE_BINARY_DIR}/llama.cpp-patched")

# The command that applies a patch in the current directory: `patch`, else `git apply` kept
# from finding the repository around the build directory.
function(_cllm_patch_command out)
    find_program(CLLM_PATCH_PROGRAM patch)
    find_package(Git QUIET)
    if(CLLM_PATCH_PROGRAM)
        set(${out} "${CLLM_PATCH_PROGRAM}" -p1 --forward --batch --input PARENT_SCOPE)
    elseif(GIT_EXECUTABLE)
        set(${out} ${CMAKE_COMMAND} -E env "GIT_CEILING_DIRECTORIES=${CMAKE_BINARY_DIR}"
            "${GIT_EXECUTABLE}" apply -p1 PARENT_SCOPE)
    else()
        message(FATAL_ERROR "cllm: applying vendor/patches needs `patch` or `git`: install one (e.g. apt-get install patch)")
    endif()
endfunction()

function(_cllm_patch_files out_files)
    _cllm_patch_command(_apply)
    set(_staging "${_cllm_patched_tree}.staging")
    file(REMOVE_RECURSE "${_staging}")
    set(_files "")
    foreach(_patch IN LISTS CLLM_LLAMA_PATCHES)
        set_property(DIRECTORY "${CMAKE_SOURCE_DIR}" APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS "${_patch}")
        file(STRINGS "${_patch}" _headers REGEX "^\\+\\+\\+ b/")
        foreach(_header IN LISTS _headers)
            string(REGEX REPLACE "^\\+\\+\\+ b/([^\t ]+).*" "\\1" _rel "${_header}")
            if(NOT EXISTS "${_staging}/${_rel}")
                configure_file("${CLLM_LLAMA_DIR}/${_rel}" "${_staging}/${_rel}" COPYONLY)
            endif()
            list(APPEND _files "${_rel}")
        endforeach()
        execute_process(COMMAND ${_apply} "${_patch}" WORKING_DIRECTORY "${_staging}"
            RESULT_VARIABLE _rc OUTPUT_VARIABLE _log ERROR_VARIABLE _log)
        if(NOT _rc EQUAL 0)
            message(FATAL_ERROR "cllm: ${_patch} does not apply to llama.cpp ${CLLM_LLAMA_COMMIT}:\n${_log}")
        endif()
    endforeach()
    list(REMOVE_DUPLICATES _files)
    # Only a changed file gets a new timestamp, so a reconfigure recompiles nothing else.
    foreach(_rel IN LISTS _files)
        get_filename_component(_parent "${_cllm_patched_tree}/${_rel}" DIRECTORY)
        file(MAKE_DIRECTORY "${_parent}")
        file(COPY_FILE "${_staging}/${_rel}" "${_cllm_patched_tree}/${_rel}" ONLY_IF_DIFFERENT)
    endforeach()
    file(REMOVE_RECURSE "${_staging}")
    set(${out_files} "${_files}" PARENT_SCOPE)
endfunction()

# Compiles the patched copies in place of the originals in `targets` (after add_subdirectory).
function(cllm_use_patched_sources)
    _cllm_patch_files(_files)
    set(_unused "${_files}")
    foreach(_target IN LISTS ARGN)
        if(NOT TARGET ${_target})
            continue()
        endif()
        get_target_property(_dir ${_target} SOURCE_DIR)
        get_target_property(_sources ${_target} SOURCES)
        set(_replaced "")
        foreach(_source IN LISTS _sources)
            get_filename_component(_abs "${_source}" ABSOLUTE BASE_DIR "${_dir}")
            file(RELATIVE_PATH _rel "${CLLM_LLAMA_DIR}" "${_abs}")
            if(_rel IN_LIST _files)
                set(_source "${_cllm_patched_tree}/${_rel}")
                list(REMOVE_ITEM _unused "${_rel}")
            endif()
            list(APPEND _replaced "${_source}")
        endforeach()
        set_property(TARGET ${_target} PROPERTY SOURCES "${_replaced}")
    endforeach()
    if(_unused)
        message(FATAL_ERROR "cllm: patched files no target compiles: ${_unused}")
    endif()
    message(STATUS "cllm: patched llama.cpp files: ${_files}")
endfunction()
