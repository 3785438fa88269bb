# The optional CUDA backend: MNIST_MPI_CUDA = AUTO (build it when nvcc, the CUDA toolkit, cuDNN and
# NCCL are all found), ON (the same, but a configure error naming what is missing) or OFF. Hints:
# CUDAToolkit_ROOT (or nvcc on PATH / CMAKE_CUDA_COMPILER), CUDNN_ROOT, NCCL_ROOT. Defines
# MNIST_MPI_HAVE_CUDA and mnist_mpi_add_cuda(target), which sets a target's CUDA flags and libraries.
set(MNIST_MPI_HAVE_CUDA OFF)
string(TOUPPER "${MNIST_MPI_CUDA}" _mode)
if(NOT _mode MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "MNIST_MPI_CUDA must be AUTO, ON or OFF, got '${MNIST_MPI_CUDA}'")
endif()

if(NOT _mode STREQUAL "OFF")
  set(_missing "")
  # nvcc: CMake's own search first, then CUDA's standard install location.
  if(NOT CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX} AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    list(APPEND _missing "the CUDA compiler nvcc (set CMAKE_CUDA_COMPILER or put nvcc on PATH)")
  endif()
  if(CMAKE_CUDA_COMPILER AND NOT CUDAToolkit_ROOT)
    get_filename_component(_nvcc_bin "${CMAKE_CUDA_COMPILER}" DIRECTORY)
    get_filename_component(CUDAToolkit_ROOT "${_nvcc_bin}" DIRECTORY)
  endif()
  find_package(CUDAToolkit QUIET)
  if(NOT CUDAToolkit_FOUND)
    list(APPEND _missing "the CUDA toolkit (runtime and cuBLAS; set CUDAToolkit_ROOT)")
  elseif(NOT TARGET CUDA::cublas)
    list(APPEND _missing "cuBLAS (libcublas)")
  endif()
  set(_cuda_hint "")
  if(CUDAToolkit_FOUND)
    set(_cuda_hint ${CUDAToolkit_LIBRARY_ROOT} ${CUDAToolkit_TARGET_DIR})
  endif()
  find_path(CUDNN_INCLUDE_DIR cudnn.h HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${_cuda_hint} ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  find_library(CUDNN_LIBRARY cudnn HINTS ${CUDNN_ROOT} $ENV{CUDNN_ROOT} ${_cuda_hint} ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib64 lib)
  if(NOT CUDNN_INCLUDE_DIR OR NOT CUDNN_LIBRARY)
    list(APPEND _missing "cuDNN (cudnn.h and libcudnn; set CUDNN_ROOT)")
  endif()
  find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${_cuda_hint} ${CUDAToolkit_INCLUDE_DIRS}
            PATH_SUFFIXES include)
  find_library(NCCL_LIBRARY nccl HINTS ${NCCL_ROOT} $ENV{NCCL_ROOT} ${_cuda_hint} ${CUDAToolkit_LIBRARY_DIR}
               PATH_SUFFIXES lib64 lib)
  if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
    list(APPEND _missing "NCCL (nccl.h and libnccl; set NCCL_ROOT)")
  endif()

  if(_missing STREQUAL "")
    # Real machine code for A100 (sm_80) and H100 / H200 (sm_90), plus sm_90 PTX for later GPUs.
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual")
    endif()
    enable_language(CUDA)
    # C++20 for the .cu files too (they include the project's headers). CMake 3.25 does not know
    # nvcc's C++20 flag (nvcc has it since CUDA 12), so it is told here.
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    set(MNIST_MPI_HAVE_CUDA ON)
    message(STATUS "mnist_mpi: CUDA backend ON (CUDA ${CUDAToolkit_VERSION}, cuDNN ${CUDNN_LIBRARY}, "
                   "NCCL ${NCCL_LIBRARY}; architectures ${CMAKE_CUDA_ARCHITECTURES})")
  elseif(_mode STREQUAL "ON")
    list(JOIN _missing "; " _what)
    message(FATAL_ERROR "MNIST_MPI_CUDA=ON but not found: ${_what}. Install them, give their location, "
                        "or configure with -DMNIST_MPI_CUDA=AUTO or OFF.")
  else()
    list(JOIN _missing "; " _what)
    message(STATUS "mnist_mpi: CUDA backend OFF (not found: ${_what})")
  endif()
else()
  message(STATUS "mnist_mpi: CUDA backend OFF (MNIST_MPI_CUDA=OFF)")
endif()

function(mnist_mpi_add_cuda target)
  target_include_directories(${target} SYSTEM PUBLIC ${CUDNN_INCLUDE_DIR} ${NCCL_INCLUDE_DIR})
  target_link_libraries(${target} PUBLIC CUDA::cudart CUDA::cublas ${CUDNN_LIBRARY} ${NCCL_LIBRARY})
  # nvcc: warnings of the host compiler on our .cu files too; exact IEEE division and square root
  # (nvcc's defaults, spelled out: Note [The optimiser bit for bit] relies on them).
  target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wshadow --prec-div=true --prec-sqrt=true --ftz=false>)
endfunction()
