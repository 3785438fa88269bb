// libFuzzer target: the option parser (src/config/options.cpp) and the model / initialiser spec
// parsers it feeds (src/model/spec.cpp). Input starting with "--" is split at whitespace into a
// command line; anything else is a --config INI file. Every outcome must be parsed options or an
// Error(kUsage): no crash, leak or hang, whatever the text.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.hpp"
#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/model/spec.hpp"

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> args{"mnist_mpi"};
  if (text.rfind("--", 0) == 0) {
    std::string cur;
    for (char c : text) {
      if (c == ' ' || c == '\n' || c == '\t') {
        // --config FILE (or a prefix of it, which Boost accepts) would read a file the fuzzer names
        // (/dev/zero never ends): --co... tokens are dropped here, and config text is
        // fuzzed through the other form instead.
        if (!cur.empty() && cur.rfind("--co", 0) != 0) args.push_back(cur);
        cur.clear();
      } else {
        cur += c;
      }
    }
    if (!cur.empty() && cur.rfind("--co", 0) != 0) args.push_back(cur);
  } else {
    args.push_back("--config");
    args.push_back(mnist_mpi::fuzz::write_file("options.ini", data, size, false));
  }
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  try {
    mnist_mpi::Options o;
    std::string out;
    if (mnist_mpi::parse_options(static_cast<int>(argv.size()), argv.data(), o, out) == mnist_mpi::ParseOutcome::kRun) {
      mnist_mpi::parse_model_spec(o.model, mnist_mpi::Shape{1, 28, 28}, 10);
      mnist_mpi::parse_init_spec(o.weight_init);
      mnist_mpi::parse_init_spec(o.bias_init);
    }
  } catch (const mnist_mpi::Error& e) {
    if (e.code() != mnist_mpi::ExitCode::kUsage) __builtin_trap();
  }
  return 0;
}
