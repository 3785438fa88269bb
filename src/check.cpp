// The error type's helpers: messages carry the failing statement, file:line, the library's own
// error string, and (where known) the rank and host, added by main().
#include "mnist_mpi/check.hpp"

#include <mpi.h>

namespace mnist_mpi {

void throw_error(ExitCode code, const std::string& msg) { throw Error(code, msg); }

void throw_call_error(const char* lib, const char* stmt, const char* file, int line, const std::string& lib_msg) {
  throw_call_error(ExitCode::kRuntime, lib, stmt, file, line, lib_msg);
}

void throw_call_error(ExitCode code, const char* lib, const char* stmt, const char* file, int line,
                      const std::string& lib_msg) {
  throw Error(code,
              std::string(lib) + " call failed: " + stmt + " at " + file + ":" + std::to_string(line) + ": " + lib_msg);
}

std::string mpi_error_string(int rc) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(rc, buf, &len) != MPI_SUCCESS) return "MPI error " + std::to_string(rc);
  return std::string(buf, static_cast<std::size_t>(len));
}

}  // namespace mnist_mpi

namespace mnist_mpi {

// Note [Quoting what the user wrote] in include/mnist_mpi/check.hpp.
std::string quote_input(std::string_view text, std::size_t max) {
  // Appends, never "'" + std::string: GCC 12 warns about the latter (a -Wrestrict false positive).
  std::string out;
  auto append_escaped = [&out](std::string_view s) {
    for (const char ch : s) {
      const auto c = static_cast<unsigned char>(ch);
      if (c >= 0x20 && c < 0x7f && c != '\\') {
        out += ch;
      } else {
        static const char* hex = "0123456789abcdef";
        out += "\\x";
        out += hex[c >> 4];
        out += hex[c & 15];
      }
    }
  };
  if (max < 8) max = 8;
  out += '\'';
  if (text.size() <= max) {
    append_escaped(text);
  } else {
    const std::size_t head = max * 2 / 3, tail = max - head;
    append_escaped(text.substr(0, head));
    out += "...(";
    out += std::to_string(text.size() - head - tail);
    out += " more bytes)...";
    append_escaped(text.substr(text.size() - tail));
  }
  out += '\'';
  return out;
}

std::optional<std::int64_t> checked_mul(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

std::optional<std::int64_t> checked_add(std::int64_t a, std::int64_t b) {
  std::int64_t r = 0;
  if (a < 0 || b < 0 || __builtin_add_overflow(a, b, &r)) return std::nullopt;
  return r;
}

}  // namespace mnist_mpi
