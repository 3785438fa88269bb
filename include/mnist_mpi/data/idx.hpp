// IDX file reader (the format of the original MNIST files), raw or gzip-compressed, and the
// MNIST dataset with its train / validation / test splits. Every header field, the file length
// and the label range are checked; errors name the file and the problem (ExitCode::kData).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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

struct Mnist {
  Split train;       // the first 60000 - validation_size training images
  Split validation;  // the last validation_size training images
  Split test;
};

// Loads train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and
// t10k-labels-idx1-ubyte (each raw or .gz) from dir. Checks that images and labels agree in
// count, that validation_size < the training count, and (train_limit > 0) keeps only the first
// train_limit training images (for quick runs). A missing directory or file names the path and
// the fetch command (scripts/fetch_mnist.sh); a path that is there but is not a directory (or not a
// regular file: a FIFO, a link to /dev/zero) says what it is, and is never opened in a way that blocks.
Mnist load_mnist(const std::string& dir, std::int64_t validation_size, std::int64_t train_limit = 0);

}  // namespace mnist_mpi
