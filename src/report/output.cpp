// Outputs whose failures are heard (Note [When an output cannot be written] in
// include/mnist_mpi/report/output.hpp).
#include "mnist_mpi/report/output.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdarg>
#include <cstring>
#include <utility>

#include "mnist_mpi/io/file_kind.hpp"
#include "mnist_mpi/io/standard_streams.hpp"

namespace mnist_mpi {

void report_lost_output(const std::string& what, const std::string& path, const std::string& error) {
  std::fflush(stdout);  // the warning lands after what was printed before it (when stdout works)
  std::fprintf(stderr,
               "mnist_mpi: warning: cannot write %s %s: %s; training goes on without it, and the run will exit "
               "with code 7\n",
               what.c_str(), quote_input(path).c_str(), error.c_str());
  std::fflush(stderr);
}

OutputFile::OutputFile(std::string what, std::string path, Mode mode)
    : what_(std::move(what)), path_(std::move(path)), mode_(mode) {}

OutputFile::OutputFile(std::string what, std::string path, std::FILE* adopted)
    : what_(std::move(what)), path_(std::move(path)), mode_(Mode::kStream), file_(adopted), owned_(false) {}

OutputFile::~OutputFile() {
  if (!owned_ || !file_) return;
  // A kReplace output not closed explicitly is incomplete (an exception while writing it): it
  // must not replace PATH. A stream has everything written so far: close it, checked.
  if (mode_ == Mode::kReplace)
    discard();
  else
    close();
}

OutputFile& OutputFile::standard_output() {
  static OutputFile out("standard output (progress and summary)", "", stdout);
  // Note [Closed standard descriptors] (include/mnist_mpi/io/standard_streams.hpp)
  static const bool checked = [] {
    if (stdout_was_closed()) {
      out.path_ = "descriptor 1";
      out.fail("it was closed when the program started (now /dev/null)");
    }
    return true;
  }();
  (void)checked;
  return out;
}

int OutputFile::open_file(std::string& error) {
  tmp_.clear();
  if (mode_ == Mode::kReplace && file_kind(path_) != FileKind::kCharDevice) tmp_ = path_ + kReplaceSuffix;
  const std::string& target = tmp_.empty() ? path_ : tmp_;
  std::string where;  // appended, not " " + string: GCC 12 warns falsely (-Wrestrict) on that
  if (!tmp_.empty()) where.append(" ").append(quote_input(tmp_));
  auto not_a_file = [&] { return "it is " + describe_path(target) + ", not a file that can be written"; };
  // O_NONBLOCK: a FIFO without a reader fails (ENXIO) instead of blocking until one comes.
  const int fd = ::open(target.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NONBLOCK | O_CLOEXEC | O_NOCTTY, 0666);
  if (fd < 0) {
    const int err = errno;
    const FileKind kind = file_kind(target);
    error = kind == FileKind::kMissing || kind == FileKind::kRegular || kind == FileKind::kCharDevice
                ? "open" + where + ": " + std::strerror(err)
                : not_a_file();
    return err;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || S_ISCHR(st.st_mode))) {  // a FIFO with a reader
    ::close(fd);
    error = not_a_file();
    return EINVAL;
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  file_ = ::fdopen(fd, "w");
  if (file_ == nullptr) {
    const int err = errno;
    ::close(fd);
    error = std::string("open: ") + std::strerror(err);
    return err;
  }
  return 0;
}

void OutputFile::open_or_throw(ExitCode code) {
  std::string error;
  if (open_file(error) != 0)
    throw Error(code, what_ + " " + quote_input(path_) + ": " + error + "; choose a path that can be written");
}

bool OutputFile::open() {
  if (failed_) return false;
  std::string error;
  if (open_file(error) == 0) return true;
  fail(error);
  return false;
}

bool OutputFile::write(std::string_view bytes) {
  if (failed_ || !file_) return false;
  errno = 0;
  if (!bytes.empty() && std::fwrite(bytes.data(), 1, bytes.size(), file_) != bytes.size()) {
    fail("write", errno);
    return false;
  }
  return true;
}

bool OutputFile::print(const char* format, ...) {
  if (failed_ || !file_) return false;
  std::va_list args;
  va_start(args, format);
  errno = 0;
  const int n = std::vfprintf(file_, format, args);
  va_end(args);
  if (n < 0) {
    fail("write", errno);
    return false;
  }
  return true;
}

bool OutputFile::flush() {
  if (failed_) return false;
  if (!file_) return true;
  errno = 0;
  if (std::fflush(file_) != 0 || std::ferror(file_)) {
    fail("write", errno);
    return false;
  }
  return true;
}

bool OutputFile::close() {
  if (failed_) return false;
  if (!file_) return true;
  if (!owned_) return flush();
  errno = 0;
  const bool flushed = std::fflush(file_) == 0 && !std::ferror(file_);
  const int flush_err = errno;
  std::FILE* f = std::exchange(file_, nullptr);
  errno = 0;
  const bool closed = std::fclose(f) == 0;  // a file system may report a lost write only now (NFS)
  const int close_err = errno;
  if (!flushed || !closed) {
    fail(flushed ? "close" : "write", flushed ? close_err : flush_err);
    return false;
  }
  if (!tmp_.empty() && std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    fail("rename from " + quote_input(tmp_) + ": " + std::strerror(errno));
    return false;
  }
  tmp_.clear();
  return true;
}

std::string OutputFile::lost() const {
  return failed_ ? what_ + " " + quote_input(path_) + " (" + error_ + ")" : std::string();
}

void OutputFile::fail(const char* op, int err) {
  // errno 0: the stream's error indicator was set by an earlier write elsewhere (stdout).
  fail(std::string(op) + ": " + (err != 0 ? std::strerror(err) : "an earlier write to it failed"));
}

void OutputFile::fail(const std::string& error) {
  if (failed_) return;
  failed_ = true;
  error_ = error;
  if (!owned_ && path_.empty()) {  // name the file behind stdout: "/dev/full", "/scratch/job.out"
    path_ = descriptor_target(::fileno(file_));
    if (path_.empty()) path_ = "stdout";
  }
  discard();
  report_lost_output(what_, path_, error_);
}

void OutputFile::discard() {
  if (owned_ && file_) std::fclose(file_);  // its error, if any, is the one already reported
  if (owned_) file_ = nullptr;
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
  tmp_.clear();
}

std::string fmt(const char* format, double v) {
  char b[64];
  std::snprintf(b, sizeof b, format, v);
  return b;
}

}  // namespace mnist_mpi
