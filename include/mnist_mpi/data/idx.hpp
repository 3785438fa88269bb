// IDX file reader (the format of the original MNIST files), raw or gzip-compressed, and the
// MNIST dataset with its train / validation / test splits. Every header field, the file length
// and the label range are checked; errors name the file and the problem (ExitCode::kData).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "mnist_mpi/io/file_roles.hpp"

namespace mnist_mpi {

struct IdxImages {
  std::int64_t count = 0;
  int rows = 0;
  int cols = 0;
  std::vector<std::uint8_t> pixels;  // (count, rows, cols), row-major
};

struct IdxLabels {
  std::int64_t count = 0;
  std::vector<std::uint8_t> labels;  // (count), each in [0, num_classes)
};

// Reads an IDX3 image file (magic 2051). A path ending in ".gz" is gunzipped; a path that does
// not exist but whose ".gz" sibling does is read from the sibling. A header that declares more
// bytes than the machine's memory is refused before reading (Note [A payload must fit in memory]).
IdxImages read_idx_images(const std::string& path);
// Reads an IDX1 label file (magic 2049) and checks every label is < num_classes.
IdxLabels read_idx_labels(const std::string& path, int num_classes = 10);

// One split: images as uint8 (converted to [0, 1] floats one batch at a time by the loader).
struct Split {
  std::int64_t count = 0;
  int rows = 0;
  int cols = 0;
  std::vector<std::uint8_t> pixels;  // (count, rows, cols)
  std::vector<std::uint8_t> labels;  // (count)
  const std::uint8_t* image(std::int64_t i) const { return pixels.data() + i * rows * cols; }
};

// One of the four MNIST files: its name, the path it is read from (NAME, or NAME.gz where only that
// exists) and, once loaded, a digest of its decoded contents and sizes (Note [A digest of the
// training data] in include/mnist_mpi/crc32c.hpp), which the ranks compare.
struct DataFile {
  std::string name;  // "train-images-idx3-ubyte"
  std::string what;  // "the training images"
  std::string path;
  std::uint64_t digest = 0;
};

struct Mnist {
  Split train;       // the first 60000 - validation_size training images
  Split validation;  // the last validation_size training images
  Split test;
  std::vector<DataFile> files;  // the four files, in the order of mnist_files()
};

// The four files of `dir`, as load_mnist() reads them (digest 0): what a command lists as its
// inputs (Note [No output is an input] in include/mnist_mpi/io/file_roles.hpp).
std::vector<DataFile> mnist_files(const std::string& dir);
// The four files of `dir` as inputs of `roles`, each named "--data-dir (the training images)".
void declare_mnist_inputs(const std::string& dir, FileRoles& roles);

// Note [Where the data is found]
// `given` (--data-dir) when it is set, used as it is. Otherwise the first of these places that
// holds any of the four MNIST files (raw or .gz; load_mnist() then checks them all):
//   1. $MNIST_MPI_DATA_DIR, when set: an explicit choice, so a place that holds none of them is an
//      error naming the variable, not a reason to look further;
//   2. data/mnist under the current directory (where scripts/fetch_mnist.sh puts it, for a
//      command run from the checkout);
//   3. data/mnist of the source tree this program was built from (for `mpirun -np 2 ./mnist_mpi`
//      run in build/).
// When none does, Error(kData) lists the places it looked and the command that fetches the data.
std::string find_mnist_dir(const std::string& given);

// Loads train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
// t10k-labels-idx1-ubyte (each raw or .gz) from dir. Checks that images and labels agree in
// count, that validation_size < the training count, and (train_limit > 0) keeps only the first
// train_limit training images (for quick runs). A missing directory or file names the path and
// the fetch command (scripts/fetch_mnist.sh); a path that is there but is not a directory (or not a
// regular file: a FIFO, a link to /dev/zero) says what it is, and is never opened in a way that blocks.
Mnist load_mnist(const std::string& dir, std::int64_t validation_size, std::int64_t train_limit = 0);

}  // namespace mnist_mpi
