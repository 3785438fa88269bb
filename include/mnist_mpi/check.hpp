// One error type and one family of check macros for every library we call (MPI, oneDNN, zlib,
// the C runtime, and CUDA, cuDNN, cuBLAS, NCCL in the CUDA backend: those macros expand only
// where their library's header is included). Library code throws mnist_mpi::Error; main() catches it, reports it once
// and makes sure every rank ends (see Note [Ending every rank] in src/main.cpp).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>

namespace mnist_mpi {

// Exit codes, documented in docs/faults.md ("Exit codes").
enum class ExitCode : int {
  kOk = 0,
  kRuntime = 1,     // an error while training (a library call failed, a rank died)
  kUsage = 2,       // a bad option or value
  kData = 3,        // a missing or corrupt data file
  kCheckpoint = 4,  // a missing, corrupt or mismatched checkpoint (the last good one is kept)
  kNumerical = 5,   // a non-finite loss or gradient
  kDevice = 6,      // no usable GPU for --device cuda, or more ranks on a node than GPUs
  kOutput = 7,      // training finished, but an output (metrics, TensorBoard, timeline, report, progress)
                    // could not be written (Note [When an output cannot be written])
  kPreempted = 75,  // stopped by SIGTERM / SIGINT / SIGUSR1 after writing a checkpoint: rerun with
                    // --resume auto (75 is EX_TEMPFAIL: a temporary failure, try again)
};

class Error : public std::runtime_error {
 public:
  Error(ExitCode code, const std::string& what) : std::runtime_error(what), code_(code) {}
  ExitCode code() const { return code_; }

 private:
  ExitCode code_;
};

// An error that every rank throws at the same point, after the ranks agreed on it (so no rank is
// left inside a collective): main() prints the message once, from the rank that holds a
// non-empty one, and every rank exits with the code after MPI_Finalize, without MPI_Abort.
class AgreedError : public Error {
 public:
  using Error::Error;
};

[[noreturn]] void throw_error(ExitCode code, const std::string& msg);
[[noreturn]] void throw_call_error(const char* lib, const char* stmt, const char* file, int line,
                                   const std::string& lib_msg);
// The same, with an exit code other than kRuntime (e.g. kDevice when a GPU is unusable).
[[noreturn]] void throw_call_error(ExitCode code, const char* lib, const char* stmt, const char* file, int line,
                                   const std::string& lib_msg);
std::string mpi_error_string(int rc);

// Note [Quoting what the user wrote]
// Messages quote the user's input (option values, spec tokens, paths, config lines) through
// quote_input(): in single quotes, control and non-ASCII bytes escaped as \xNN (a binary file
// cannot write raw bytes to the terminal), and at most `max` characters of it: a longer text keeps
// its head and tail around "...(N more bytes)...", so that a 10 MB value gives a one-line message.
std::string quote_input(std::string_view text, std::size_t max = 80);

// a * b and a + b for sizes computed from user input, or nullopt when they overflow int64 (or are
// negative): callers turn that into an error naming what overflowed.
std::optional<std::int64_t> checked_mul(std::int64_t a, std::int64_t b);
std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b);

}  // namespace mnist_mpi

// Runtime checks stay on in every build type.
#define MNIST_CHECK(cond, code, msg)                      \
  do {                                                    \
    if (!(cond)) ::mnist_mpi::throw_error((code), (msg)); \
  } while (0)

#define MPI_CHECK(stmt)                                                                                              \
  do {                                                                                                               \
    int mnist_mpi_rc_ = (stmt);                                                                                      \
    if (mnist_mpi_rc_ != 0 /* MPI_SUCCESS */)                                                                        \
      ::mnist_mpi::throw_call_error("MPI", #stmt, __FILE__, __LINE__, ::mnist_mpi::mpi_error_string(mnist_mpi_rc_)); \
  } while (0)

// The CUDA family. Each reports the statement, file:line and the library's own error name and
// string; main() prefixes the rank and host. Used only in src/backend/cuda/, which includes the
// libraries' headers.
#define CUDA_CHECK(stmt)                                                                              \
  do {                                                                                                \
    const cudaError_t mnist_cuda_rc_ = (stmt);                                                        \
    if (mnist_cuda_rc_ != cudaSuccess)                                                                \
      ::mnist_mpi::throw_call_error(                                                                  \
          "CUDA", #stmt, __FILE__, __LINE__,                                                          \
          std::string(cudaGetErrorName(mnist_cuda_rc_)) + ": " + cudaGetErrorString(mnist_cuda_rc_)); \
  } while (0)

// After a kernel launch: a bad configuration shows up here, a fault at the next synchronisation.
#define CUDA_CHECK_LAUNCH(kernel_name)                                                                \
  do {                                                                                                \
    const cudaError_t mnist_cuda_rc_ = cudaPeekAtLastError();                                         \
    if (mnist_cuda_rc_ != cudaSuccess)                                                                \
      ::mnist_mpi::throw_call_error(                                                                  \
          "CUDA", "launch of " #kernel_name, __FILE__, __LINE__,                                      \
          std::string(cudaGetErrorName(mnist_cuda_rc_)) + ": " + cudaGetErrorString(mnist_cuda_rc_)); \
  } while (0)

#define CUDNN_CHECK(stmt)                                                                            \
  do {                                                                                               \
    const cudnnStatus_t mnist_cudnn_rc_ = (stmt);                                                    \
    if (mnist_cudnn_rc_ != CUDNN_STATUS_SUCCESS) {                                                   \
      char mnist_cudnn_last_[512] = {0};                                                             \
      cudnnGetLastErrorString(mnist_cudnn_last_, sizeof mnist_cudnn_last_);                          \
      ::mnist_mpi::throw_call_error(                                                                 \
          "cuDNN", #stmt, __FILE__, __LINE__,                                                        \
          std::string(cudnnGetErrorString(mnist_cudnn_rc_)) +                                        \
              (mnist_cudnn_last_[0] ? std::string(" (") + mnist_cudnn_last_ + ")" : std::string())); \
    }                                                                                                \
  } while (0)

#define CUBLAS_CHECK(stmt)                                                                                      \
  do {                                                                                                          \
    const cublasStatus_t mnist_cublas_rc_ = (stmt);                                                             \
    if (mnist_cublas_rc_ != CUBLAS_STATUS_SUCCESS)                                                              \
      ::mnist_mpi::throw_call_error(                                                                            \
          "cuBLAS", #stmt, __FILE__, __LINE__,                                                                  \
          std::string(cublasGetStatusName(mnist_cublas_rc_)) + ": " + cublasGetStatusString(mnist_cublas_rc_)); \
  } while (0)

#define NCCL_CHECK(stmt)                                                                                             \
  do {                                                                                                               \
    const ncclResult_t mnist_nccl_rc_ = (stmt);                                                                      \
    if (mnist_nccl_rc_ != ncclSuccess) {                                                                             \
      const char* mnist_nccl_last_ = ncclGetLastError(nullptr);                                                      \
      ::mnist_mpi::throw_call_error(                                                                                 \
          "NCCL", #stmt, __FILE__, __LINE__,                                                                         \
          std::string(ncclGetErrorString(mnist_nccl_rc_)) +                                                          \
              (mnist_nccl_last_ && *mnist_nccl_last_ ? std::string(" (") + mnist_nccl_last_ + ")" : std::string())); \
    }                                                                                                                \
  } while (0)
