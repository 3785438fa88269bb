// The error type's helpers: messages carry the failing statement, file:line, the library's own
// error string, and (where known) the rank and host, added by main().
#include "mnist_mpi/check.hpp"

#include <mpi.h>

namespace mnist_mpi {

void throw_error(ExitCode code, const std::string& msg) { throw Error(code, msg); }

void throw_call_error(const char* lib, const char* stmt, const char* file, int line,
                      const std::string& lib_msg) {
  throw_call_error(ExitCode::kRuntime, lib, stmt, file, line, lib_msg);
}

void throw_call_error(ExitCode code, const char* lib, const char* stmt, const char* file, int line,
                      const std::string& lib_msg) {
  throw Error(code, std::string(lib) + " call failed: " + stmt + " at " + file + ":" + std::to_string(line) +
                        ": " + lib_msg);
}

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<std::size_t>(len));
}

}  // namespace mnist_mpi
