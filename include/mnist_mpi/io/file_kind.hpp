// What a path is, found out before it is opened, and opening that cannot block.
//
// Note [Look before you open]
// open() of a FIFO for reading blocks until a writer appears, and a directory, a socket or
// /dev/zero behind a link "opens" but then reads nothing, an error, or an endless stream. Every
// file the program reads (MNIST files, checkpoints, --config) therefore goes through
// open_regular_file(): it opens with O_NONBLOCK (a FIFO then opens at once), asks fstat() what was
// opened, refuses anything but a regular file with a message that says what it found, and only
// then clears O_NONBLOCK. Checking the opened descriptor, not the name, leaves no window for the
// path to change between the check and the read. Outputs go through check_output_path(): a
// regular file, a missing one (created), or a character device (/dev/null) are fine; a
// directory, a FIFO, a socket or a block device are refused.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

enum class FileKind { kMissing, kRegular, kDirectory, kFifo, kCharDevice, kBlockDevice, kSocket, kBrokenLink, kOther };

// stat() (links followed; a link to nothing is kBrokenLink). Never opens the path.
FileKind file_kind(const std::string& path);
// "a regular file", "a directory", "a FIFO (named pipe)", "a character device", ...
const char* file_kind_name(FileKind kind);
// The kind as said in a message: "a FIFO (named pipe)", or "a symbolic link to a character
// device ('/dev/zero')" when the path is a link.
std::string describe_path(const std::string& path);

// Opens `path` for reading without blocking and checks that it is a regular file. Returns the
// descriptor (blocking again, close-on-exec; the caller closes it). Otherwise throws
// Error(code, "<what> '<path>' <is missing | is a FIFO (named pipe), not a regular file>; <fix>").
int open_regular_file(const std::string& path, const std::string& what, ExitCode code, const std::string& fix);
// A descriptor that is closed when it goes out of scope (-1: none).
struct OwnedFd {
  int fd = -1;
  OwnedFd() = default;
  explicit OwnedFd(int f) : fd(f) {}
  OwnedFd(const OwnedFd&) = delete;
  OwnedFd& operator=(const OwnedFd&) = delete;
  ~OwnedFd();
  int release();  // returns the descriptor, no longer owned
};
// The bytes of the regular file `path` (opened with open_regular_file(): the same refusals). A
// file of more than max_bytes calls too_big(its size), which must throw; a read error throws
// Error(code, "cannot read <what> '<path>': <reason>"). A file that shrinks while it is read gives
// the bytes that were there.
std::vector<std::uint8_t> read_regular_file(const std::string& path, const std::string& what, ExitCode code,
                                            const std::string& fix, std::uint64_t max_bytes,
                                            const std::function<void(std::uint64_t size)>& too_big);
// The same check without keeping the file open.
void require_regular_file(const std::string& path, const std::string& what, ExitCode code, const std::string& fix);
// An output path: refused (Error(code)) when it is a directory, a FIFO, a socket, a block device
// or a broken link, when its parent directory does not exist, or when it is a read-only file.
//
// Note [A read-only output is not replaced]
// One rule for every output (the trainer's metrics, timeline and report, export's ONNX file,
// evaluate's logits): an existing file that we may not write, or that has no write permission
// for anyone, is refused before any work, never replaced. The second half matters as root, who
// may write any file: a file made read-only (chmod a-w) says "keep this", and a rename over it
// (which needs only the directory's permission) would replace it all the same.
void check_output_path(const std::string& path, const std::string& what, ExitCode code);

// Note [Whole or absent]
// A file other programs read (a checkpoint, an ONNX model) is written so that `path` holds either
// its old content or the whole new file: path + suffix is created afresh (a leftover removed
// first; O_EXCL | O_NOFOLLOW: never through a link, never into a FIFO), written, fsynced, renamed
// over `path`, and the directory fsynced. A `path` that is a device is refused: the rename would
// replace the device node (`--onnx /dev/null` as root). On any failure the temporary is removed
// and on_error(what failed, errno or 0, renamed) is called, which throws; renamed: only the
// directory's fsync failed, the file is in place.
using WriteError = std::function<void(const std::string& what, int err, bool renamed)>;
void replace_file(const std::string& path, const std::string& suffix, std::span<const std::uint8_t> bytes,
                  const WriteError& on_error);
// replace_file for a command's one product (export's ONNX model, report's page): a failure throws
// Error(kOutput) naming the file, what failed and the fix.
void write_whole_file(const std::string& path, const std::string& suffix, std::string_view bytes);

}  // namespace mnist_mpi
