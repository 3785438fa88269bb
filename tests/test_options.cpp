// The option parser (src/config/options.cpp) on inputs that once broke it. The normal option
// checks are tested through the program in tests/e2e_cli.sh; device and precision options in
// tests/test_device.cpp.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <future>
#include <string>
#include <vector>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/options.hpp"

namespace mnist_mpi {
namespace {

// Parses args on a thread and gives (code, message), or fails the test when the parser has not
// returned within 10 s (the hang would otherwise stall the whole suite).
std::pair<ExitCode, std::string> parse_within_10s(std::vector<std::string> args) {
  args.insert(args.begin(), "mnist_mpi");
  auto job = std::async(std::launch::async, [args] {
    std::vector<const char*> argv;
    for (const std::string& a : args) argv.push_back(a.c_str());
    Options o;
    std::string text;
    try {
      parse_options(static_cast<int>(argv.size()), argv.data(), o, text);
    } catch (const Error& e) {
      return std::pair<ExitCode, std::string>{e.code(), e.what()};
    }
    return std::pair<ExitCode, std::string>{ExitCode::kOk, ""};
  });
  if (job.wait_for(std::chrono::seconds(10)) != std::future_status::ready) {
    ADD_FAILURE() << "parse_options did not return within 10 s";
    std::_Exit(1);  // the parser thread cannot be stopped; end the test binary rather than hang it
  }
  return job.get();
}

// Found by fuzz_options: Boost.ProgramOptions substitutes the user's text for %original_token% and
// friends in a loop that never ends when the text holds the placeholder itself.
TEST(Options, BoostPlaceholdersInAWrongOptionGiveAMessageNotAHang) {
  auto [code, msg] = parse_within_10s({"--b:%original_token%"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("the command line holds '%original_token%'"), std::string::npos) << msg;
  std::tie(code, msg) = parse_within_10s({"--batch-size", "%value%"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("holds '%value%'"), std::string::npos) << msg;

  const std::filesystem::path ini = std::filesystem::temp_directory_path() / "mnist_mpi_placeholder.ini";
  std::ofstream(ini) << "batch-size = 10\n%option% = 3\n";
  std::tie(code, msg) = parse_within_10s({"--config", ini.string()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("the --config file holds '%option%'"), std::string::npos) << msg;
  std::filesystem::remove(ini);
}

// The guard changes nothing for ordinary mistakes: Boost's own message still comes through.
TEST(Options, OrdinaryMistakesKeepBoostsMessage) {
  const auto [code, msg] = parse_within_10s({"--bogus", "1"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("unrecognised option '--bogus'"), std::string::npos) << msg;
}

}  // namespace
}  // namespace mnist_mpi
