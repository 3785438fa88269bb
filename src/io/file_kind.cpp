// File kinds and non-blocking opens (Note [Look before you open] in
// include/mnist_mpi/io/file_kind.hpp).
#include "mnist_mpi/io/file_kind.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

namespace mnist_mpi {
namespace {

FileKind kind_of_mode(mode_t m) {
  if (S_ISREG(m)) return FileKind::kRegular;
  if (S_ISDIR(m)) return FileKind::kDirectory;
  if (S_ISFIFO(m)) return FileKind::kFifo;
  if (S_ISCHR(m)) return FileKind::kCharDevice;
  if (S_ISBLK(m)) return FileKind::kBlockDevice;
  if (S_ISSOCK(m)) return FileKind::kSocket;
  return FileKind::kOther;
}

bool is_link(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

std::string refusal(const std::string& path, const std::string& what, FileKind kind, const std::string& fix) {
  const std::string head = what + " " + quote_input(path) + " ";
  const std::string tail = fix.empty() ? std::string() : "; " + fix;
  if (kind == FileKind::kMissing) return head + "does not exist" + tail;
  return head + "is " + describe_path(path) + ", not a regular file" + tail;
}

}  // namespace

FileKind file_kind(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) == 0) return kind_of_mode(st.st_mode);
  return is_link(path) ? FileKind::kBrokenLink : FileKind::kMissing;
}

const char* file_kind_name(FileKind kind) {
  switch (kind) {
    case FileKind::kMissing:
      return "missing";
    case FileKind::kRegular:
      return "a regular file";
    case FileKind::kDirectory:
      return "a directory";
    case FileKind::kFifo:
      return "a FIFO (named pipe)";
    case FileKind::kCharDevice:
      return "a character device";
    case FileKind::kBlockDevice:
      return "a block device";
    case FileKind::kSocket:
      return "a socket";
    case FileKind::kBrokenLink:
      return "a symbolic link to nothing";
    case FileKind::kOther:
      return "not a file, directory or device";
  }
  return "?";
}

std::string describe_path(const std::string& path) {
  const FileKind kind = file_kind(path);
  if (kind == FileKind::kBrokenLink || !is_link(path)) return file_kind_name(kind);
  std::error_code ec;
  const std::string target = std::filesystem::canonical(path, ec).string();
  return std::string("a symbolic link to ") + file_kind_name(kind) + (ec ? "" : " (" + quote_input(target) + ")");
}

int open_regular_file(const std::string& path, const std::string& what, ExitCode code, const std::string& fix) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) throw Error(code, refusal(path, what, file_kind(path), fix));
    throw Error(code, what + " " + quote_input(path) + ": cannot open: " + std::strerror(err) +
                          (fix.empty() ? "" : "; " + fix));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const FileKind kind = kind_of_mode(st.st_mode);
    ::close(fd);
    throw Error(code, refusal(path, what, kind == FileKind::kRegular ? FileKind::kOther : kind, fix));
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags >= 0) ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
  return fd;
}

OwnedFd::~OwnedFd() {
  if (fd >= 0) ::close(fd);
}

int OwnedFd::release() { return std::exchange(fd, -1); }

std::vector<std::uint8_t> read_regular_file(const std::string& path, const std::string& what, ExitCode code,
                                            const std::string& fix, std::uint64_t max_bytes,
                                            const std::function<void(std::uint64_t size)>& too_big) {
  const OwnedFd f(open_regular_file(path, what, code, fix));
  const auto cannot_read = [&](int e) {
    throw Error(code, "cannot read " + what + " " + quote_input(path) + ": " + std::strerror(e));
  };
  struct stat st {};
  if (::fstat(f.fd, &st) != 0) cannot_read(errno);
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    too_big(size);
    throw_error(ExitCode::kRuntime, "read_regular_file: too_big returned");  // it must throw
  }
  std::vector<std::uint8_t> bytes(static_cast<std::size_t>(size));
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::read(f.fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) cannot_read(errno);
    if (r == 0) break;  // shrank while reading
    done += static_cast<std::size_t>(r);
  }
  bytes.resize(done);
  return bytes;
}

void require_regular_file(const std::string& path, const std::string& what, ExitCode code, const std::string& fix) {
  ::close(open_regular_file(path, what, code, fix));
}

void check_output_path(const std::string& path, const std::string& what, ExitCode code) {
  const FileKind kind = file_kind(path);
  switch (kind) {
    case FileKind::kRegular: {
      // Note [A read-only output is not replaced] (include/mnist_mpi/io/file_kind.hpp)
      struct stat st {};
      const bool no_write_bits = ::stat(path.c_str(), &st) == 0 && (st.st_mode & (S_IWUSR | S_IWGRP | S_IWOTH)) == 0;
      if (no_write_bits || ::access(path.c_str(), W_OK) != 0)
        throw Error(code, what + " " + quote_input(path) + " is read-only" +
                              (no_write_bits ? std::string(" (no write permission for anyone)")
                                             : " (" + std::string(std::strerror(errno)) + ")") +
                              ", so it is not replaced; make it writable (chmod u+w) or choose another path");
      return;
    }
    case FileKind::kCharDevice:
      return;
    case FileKind::kMissing: {
      const std::filesystem::path parent = std::filesystem::path(path).parent_path();
      const FileKind p = parent.empty() ? FileKind::kDirectory : file_kind(parent.string());
      if (p == FileKind::kDirectory) return;
      throw Error(code, what + " " + quote_input(path) + ": its directory " + quote_input(parent.string()) +
                            (p == FileKind::kMissing ? " does not exist" : std::string(" is ") + file_kind_name(p)) +
                            "; create the directory or choose another path");
    }
    default:
      throw Error(code, what + " " + quote_input(path) + " is " + describe_path(path) +
                            ", not a file that can be written; choose a regular file's path");
  }
}

// Note [Whole or absent] (include/mnist_mpi/io/file_kind.hpp)
void replace_file(const std::string& path, const std::string& suffix, std::span<const std::uint8_t> bytes,
                  const WriteError& on_error) {
  const std::string tmp = path + suffix;
  OwnedFd f;
  const auto fail = [&](const std::string& what, int e) {
    if (f.fd >= 0) ::close(f.release());
    ::unlink(tmp.c_str());
    on_error(what, e, false);
    throw_error(ExitCode::kRuntime, "replace_file: the error handler returned");  // it must throw
  };
  const FileKind kind = file_kind(path);
  if (kind == FileKind::kCharDevice || kind == FileKind::kBlockDevice)
    fail(quote_input(path) + " is " + describe_path(path) + ", which a file must not replace", 0);
  ::unlink(tmp.c_str());  // a leftover of an earlier write
  f.fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
  if (f.fd < 0) fail("cannot create '" + tmp + "'", errno);
  std::size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t r = ::write(f.fd, bytes.data() + done, bytes.size() - done);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0)
      fail("write failed after " + std::to_string(done) + " of " + std::to_string(bytes.size()) + " bytes", errno);
    done += static_cast<std::size_t>(r);
  }
  if (::fsync(f.fd) != 0) fail("fsync failed", errno);
  if (::close(f.release()) != 0) fail("close failed", errno);
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename failed", errno);
  const std::string dir = std::filesystem::path(path).parent_path().string();
  const OwnedFd d(::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (d.fd < 0 || ::fsync(d.fd) != 0) {  // the rename is done; only its durability is in doubt
    on_error("fsync of the directory failed", errno, true);
    throw_error(ExitCode::kRuntime, "replace_file: the error handler returned");
  }
}

void write_whole_file(const std::string& path, const std::string& suffix, std::string_view bytes) {
  replace_file(path, suffix, {reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size()},
               [&](const std::string& what, int e, bool renamed) {
                 throw_error(ExitCode::kOutput, std::string(renamed ? "wrote " : "cannot write ") + quote_input(path) +
                                                    (renamed ? " but " : ": ") + what +
                                                    (e ? ": " + std::string(std::strerror(e)) : std::string()) +
                                                    " -- check the directory exists and is writable");
               });
}

}  // namespace mnist_mpi
