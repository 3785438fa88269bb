// FileRoles (Note [No output is an input] in include/mnist_mpi/io/file_roles.hpp): an output that
// is an input or another output, by name, through a symbolic or a hard link, or inside a family of
// names that a directory's owner writes, is a usage error naming both options; what clashes with
// nothing passes, and nothing is created while checking. Also the data locator's order (Note
// [Where the data is found]) and the digest the ranks compare (Note [A digest of the training data]).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/crc32c.hpp"
#include "mnist_mpi/data/idx.hpp"
#include "mnist_mpi/io/file_roles.hpp"
#include "mnist_mpi/io/standard_streams.hpp"

namespace mnist_mpi {
namespace {

namespace fs = std::filesystem;

// A scratch directory that is the current directory while the fixture lives.
class FileRolesTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("mnist_mpi_roles_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    old_ = fs::current_path();
    fs::current_path(dir_);
    std::ofstream("in.bin") << "input";
    std::ofstream("cfg.ini") << "seed = 1\n";
  }
  void TearDown() override {
    fs::current_path(old_);
    fs::remove_all(dir_);
  }
  // The message of the clash check() finds, or "" when it finds none.
  static std::string clash(const FileRoles& roles) {
    try {
      roles.check();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      return e.what();
    }
    return {};
  }
  fs::path dir_, old_;
};

TEST_F(FileRolesTest, AnOutputNamingAnInputIsRefusedNamingBothOptions) {
  FileRoles r;
  r.input("--data-dir (the training images)", "in.bin");
  r.output("--metrics-file", "in.bin");
  const std::string m = clash(r);
  EXPECT_NE(m.find("--metrics-file and --data-dir (the training images) both name 'in.bin'"), std::string::npos) << m;
  EXPECT_NE(m.find("give --metrics-file another path"), std::string::npos) << m;
  std::ifstream in("in.bin");
  std::string content;
  in >> content;
  EXPECT_EQ(content, "input");  // checking touched nothing
}

TEST_F(FileRolesTest, LinksAndOtherSpellingsAreTheSameFile) {
  fs::create_symlink("in.bin", "soft");
  fs::create_hard_link("in.bin", "hard");
  fs::create_directory("sub");
  for (const char* other : {"soft", "hard", "sub/../in.bin", "./in.bin"}) {
    FileRoles r;
    r.input("--config", "in.bin");
    r.output("--timeline", other);
    const std::string m = clash(r);
    EXPECT_NE(m.find("--timeline '" + std::string(other) + "' and --config 'in.bin' are the same file"),
              std::string::npos)
        << other << ": " << m;
  }
  // A symbolic link to the input given as the input, a plain path as the output.
  FileRoles r;
  r.input("--config", "soft");
  r.output("--report", (dir_ / "in.bin").string());
  EXPECT_NE(clash(r).find("are the same file"), std::string::npos);
}

TEST_F(FileRolesTest, TwoOutputsOnOneFileAreRefusedEvenBeforeItExists) {
  FileRoles r;
  r.output("--timeline", "new.json");
  r.output("--report", "sub/../new.json");
  fs::create_directory("sub");
  const std::string m = clash(r);
  EXPECT_NE(m.find("--timeline 'new.json' and --report 'sub/../new.json' are the same file"), std::string::npos) << m;
  EXPECT_NE(m.find("one output would replace the other"), std::string::npos) << m;
  EXPECT_FALSE(fs::exists("new.json"));
}

TEST_F(FileRolesTest, WhatClashesWithNothingPasses) {
  FileRoles r;
  r.input("--data-dir (the training images)", "in.bin");
  r.input("--config", "in.bin");  // two inputs may be one file: reading destroys nothing
  r.input("--config", "cfg.ini");
  r.output("--metrics-file", "m.jsonl");
  r.output("--timeline", "/dev/null");  // any number of outputs may go to a character device
  r.output("--report", "/dev/null");
  EXPECT_EQ(clash(r), "");
}

TEST_F(FileRolesTest, AFamilyOfNamesClashesWithOthersButNotWithItsOwnersInputs) {
  fs::create_directory("ck");
  std::ofstream("ck/step-00000010.ckpt") << "x";
  // The checkpointer's family in `dir`, and one more file: an input (of `owner`, or of nobody) or an output.
  struct Case {
    const char* what;
    const char* dir;
    bool output;
    const char* option;
    const char* path;
    const char* owner;
    const char* expected;  // in the message; "" for no clash
  };
  const Case cases[] = {
      {"the checkpoint resumed from, in the directory the checkpointer writes: by design", "ck", false, "--resume",
       "ck/step-00000010.ckpt", "checkpoints", ""},
      {"an output named like a checkpoint that will be written there", "ck/", true, "--metrics-file",
       "ck/step-00000020.ckpt", "",
       "--metrics-file 'ck/step-00000020.ckpt' is a name that --checkpoint-dir 'ck/' writes or removes"},
      {"someone else's input named like one: it would be replaced or removed", "ck", false, "--config",
       "ck/step-00000010.ckpt", "",
       "the run would destroy it; move it, or give --checkpoint-dir another directory"},
      {"a name outside the family", "ck", true, "--metrics-file", "ck/metrics.jsonl", "", ""},
  };
  for (const Case& c : cases) {
    FileRoles r;
    r.outputs_in(
        "--checkpoint-dir", c.dir, [](std::string_view name) { return name.rfind("step-", 0) == 0; }, "checkpoints",
        "checkpoints");
    if (c.output)
      r.output(c.option, c.path);
    else
      r.input(c.option, c.path, c.owner);
    const std::string m = clash(r);
    if (*c.expected == '\0')
      EXPECT_EQ(m, "") << c.what;
    else
      EXPECT_NE(m.find(c.expected), std::string::npos) << c.what << ": " << m;
  }
}

// Note [Closed standard descriptors]: in a child process whose descriptors 0 and 2, then 1, are
// closed, each is /dev/null afterwards, a file opened next does not take their numbers, and only a
// closed stdout is remembered (and reported as a lost output).
TEST(StandardStreams, ClosedDescriptorsAreOpenedOnDevNull) {
  const auto in_child = [](const std::vector<int>& closed, bool stdout_closed) {
    const pid_t pid = ::fork();
    if (pid == 0) {
      for (int fd : closed) ::close(fd);
      open_closed_standard_descriptors();
      bool ok = stdout_was_closed() == stdout_closed;
      for (int fd : closed) ok = ok && descriptor_target(fd) == "/dev/null";
      const int next = ::open("/dev/zero", O_RDONLY);
      ok = ok && next > 2;
      ok = ok && (standard_output_error().find("closed when the program started") != std::string::npos) == stdout_closed;
      ::_exit(ok ? 0 : 1);
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  EXPECT_EQ(in_child({0, 2}, false), 0) << "stdin and stderr closed";
  EXPECT_EQ(in_child({1}, true), 0) << "stdout closed";
  EXPECT_EQ(in_child({0, 1, 2}, true), 0) << "all three closed";
}

// Note [Where the data is found]: --data-dir as given; else $MNIST_MPI_DATA_DIR, which must hold
// the data; else data/mnist here; else the source tree's.
TEST_F(FileRolesTest, TheDataIsFoundInTheDocumentedOrder) {
  ::unsetenv("MNIST_MPI_DATA_DIR");
  EXPECT_EQ(find_mnist_dir("anything"), "anything");  // given: used as it is, checked by the loader
  fs::create_directories("data/mnist");
  fs::create_directories("elsewhere");
  std::ofstream("data/mnist/train-images-idx3-ubyte.gz") << "x";
  std::ofstream("elsewhere/t10k-labels-idx1-ubyte") << "x";
  EXPECT_EQ(find_mnist_dir(""), "data/mnist");
  ::setenv("MNIST_MPI_DATA_DIR", "elsewhere", 1);
  EXPECT_EQ(find_mnist_dir(""), "elsewhere");  // the variable comes first
  ::setenv("MNIST_MPI_DATA_DIR", "cfg.ini", 1);
  try {
    find_mnist_dir("");
    ADD_FAILURE() << "a variable naming no data was taken";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kData);
    EXPECT_NE(std::string(e.what()).find("MNIST_MPI_DATA_DIR is 'cfg.ini', which holds none of the four MNIST files"),
              std::string::npos)
        << e.what();
  }
  ::unsetenv("MNIST_MPI_DATA_DIR");
  fs::remove_all("data");
  // Neither here: the source tree's copy, said relative when we are inside the tree, or an error
  // that lists every place looked at and the fetch command.
  try {
    const std::string found = find_mnist_dir("");
    EXPECT_TRUE(fs::equivalent(found, fs::path(MNIST_MPI_TEST_SOURCE_DIR) / "data/mnist")) << found;
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_FALSE(fs::exists(fs::path(MNIST_MPI_TEST_SOURCE_DIR) / "data/mnist/train-images-idx3-ubyte")) << m;
    for (const char* part : {"--data-dir is not given", "MNIST_MPI_DATA_DIR is not set", "'data/mnist' under the",
                             "(the source tree this program was built from)", "scripts/fetch_mnist.sh"})
      EXPECT_NE(m.find(part), std::string::npos) << part << " in " << m;
  }
}

// Note [A digest of the training data]: the instruction's value is the tables' value, for every
// length around the 32-byte blocks and the tail, and a change of any one byte changes it.
TEST(ContentDigest, TheSameWithAndWithoutTheCrcInstructionAndEveryByteCounts) {
  std::vector<unsigned char> buf(4096 + 77);
  for (std::size_t i = 0; i < buf.size(); ++i) buf[i] = static_cast<unsigned char>(i * 2654435761u >> 13);
  for (std::size_t n : {0u, 1u, 7u, 8u, 31u, 32u, 33u, 63u, 64u, 65u, 100u, 4096u, 4173u})
    EXPECT_EQ(content_digest(buf.data(), n), content_digest_portable(buf.data(), n)) << n;
  const std::uint64_t whole = content_digest(buf.data(), 200);
  EXPECT_NE(content_digest(buf.data(), 199), whole);
  for (std::size_t i = 0; i < 200; ++i) {
    buf[i] ^= 1;
    EXPECT_NE(content_digest(buf.data(), 200), whole) << "byte " << i;
    buf[i] ^= 1;
  }
  EXPECT_EQ(content_digest(buf.data(), 200), whole);
}

}  // namespace
}  // namespace mnist_mpi
