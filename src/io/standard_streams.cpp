// The standard descriptors (Note [Closed standard descriptors] in
// include/mnist_mpi/io/standard_streams.hpp).
#include "mnist_mpi/io/standard_streams.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {
namespace {

bool g_stdout_was_closed = false;

}  // namespace

void open_closed_standard_descriptors() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    // The lowest free number is fd: the ones below it are open (they were, or were just opened).
    const int opened = ::open("/dev/null", fd == 0 ? O_RDONLY : O_WRONLY);
    if (opened >= 0 && opened != fd) {
      ::dup2(opened, fd);
      ::close(opened);
    }
    if (fd == 1) g_stdout_was_closed = true;
  }
}

bool stdout_was_closed() { return g_stdout_was_closed; }

std::string descriptor_target(int fd) {
  std::error_code ec;
  const auto target = std::filesystem::read_symlink("/proc/self/fd/" + std::to_string(fd), ec);
  return ec ? std::string() : target.string();
}

std::string standard_output_error() {
  if (g_stdout_was_closed) return "standard output: it was closed when the program started";
  errno = 0;
  const bool ok = std::fflush(stdout) == 0 && !std::ferror(stdout);
  if (ok) return {};
  const int err = errno;
  const std::string target = descriptor_target(1);
  std::string text = "standard output";  // appended: GCC 12 warns falsely (-Wrestrict) on " " + string
  if (!target.empty()) text.append(" ").append(quote_input(target));
  return text.append(": write: ").append(err != 0 ? std::strerror(err) : "an earlier write to it failed");
}

}  // namespace mnist_mpi
