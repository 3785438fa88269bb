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

#include <sys/stat.h>
#include <unistd.h>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/config/combinations.hpp"
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

// A fresh temporary file with `text`, removed at the end of the test.
class TempFile {
 public:
  explicit TempFile(const std::string& text, const std::string& name = "options.ini") {
    static int counter = 0;
    path_ = std::filesystem::temp_directory_path() /
            ("mnist_mpi_options_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" + name);
    std::ofstream(path_, std::ios::binary) << text;
  }
  ~TempFile() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// Every byte of msg is printable ASCII: no control byte reaches the terminal.
bool printable(const std::string& msg) {
  for (const char ch : msg) {
    const auto c = static_cast<unsigned char>(ch);
    if (c < 0x20 || c >= 0x7f) return false;
  }
  return true;
}

// Found by fuzz_options: Boost.ProgramOptions substitutes the user's text for %original_token% and
// friends in a loop that never ends when the text holds the placeholder itself. Our messages are
// built without Boost's what() (Note [Messages built from what the user wrote]), so they name the
// option as well.
TEST(Options, BoostPlaceholdersInAWrongOptionGiveAMessageNotAHang) {
  auto [code, msg] = parse_within_10s({"--b:%original_token%"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("unrecognised option '--b:%original_token%'"), std::string::npos) << msg;
  std::tie(code, msg) = parse_within_10s({"--batch-size", "%value%"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("option '--batch-size': the value '%value%' is not valid"), std::string::npos) << msg;

  const TempFile ini("batch-size = 10\n%option% = 3\n");
  std::tie(code, msg) = parse_within_10s({"--config", ini.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find(" line 2: unknown option '%option%'"), std::string::npos) << msg;
  const TempFile bad_value("batch-size = %canonical_option%\n");
  std::tie(code, msg) = parse_within_10s({"--config", bad_value.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find(" line 1: option 'batch-size': the value '%canonical_option%' is not valid"), std::string::npos)
      << msg;
}

// The guard changes nothing for ordinary mistakes: the message reads as Boost's did.
TEST(Options, OrdinaryMistakesKeepBoostsMessage) {
  const auto [code, msg] = parse_within_10s({"--bogus", "1"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("unrecognised option '--bogus'"), std::string::npos) << msg;
}

// Hostile input: --lr inf, --beta1 nan, --momentum inf were accepted and the run failed at step
// 2 naming no option. Every double option is checked for finiteness and range at parse time, on the
// command line and in a --config file alike (Note [One check for every floating-point option]).
TEST(Options, NonFiniteOrOutOfRangeRealOptionsAreRefusedNamingTheOption) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"lr", "inf"},
      {"lr", "nan"},
      {"lr", "0"},
      {"momentum", "inf"},
      {"momentum", "1"},
      {"momentum", "-0.5"},
      {"beta1", "nan"},
      {"beta1", "1"},
      {"beta2", "-inf"},
      {"beta2", "1.5"},
      {"eps", "0"},
      {"eps", "inf"},
      {"weight-decay", "-1"},
      {"weight-decay", "nan"},
      {"lr-gamma", "0"},
      {"lr-gamma", "inf"},
      {"lr-step-epochs", "0"},
      {"lr-step-epochs", "nan"},
      {"lr-min", "-1e-3"},
      {"lr-min", "inf"},
      {"bucket-mb", "1e300"},
      {"bucket-mb", "0"},
      {"first-bucket-mb", "nan"},
      {"first-bucket-mb", "inf"},
      {"collective-timeout", "inf"},
      {"collective-timeout", "nan"},
      {"collective-timeout", "-1"},
  };
  for (const auto& [name, value] : bad) {
    const auto [code, msg] = parse_within_10s({"--batch-size", "10", "--" + name, value});
    EXPECT_EQ(code, ExitCode::kUsage) << name << " " << value;
    EXPECT_EQ(msg.rfind("--" + name + " must be ", 0), 0u) << name << " " << value << ": " << msg;
    const TempFile ini(name + " = " + value + "\n");
    const auto [file_code, file_msg] = parse_within_10s({"--batch-size", "10", "--config", ini.str()});
    EXPECT_EQ(file_code, ExitCode::kUsage) << name << " " << value << " in a --config file";
    EXPECT_EQ(file_msg.rfind("--" + name + " must be ", 0), 0u) << file_msg;
  }
  // The edges that are allowed still are.
  for (const auto& [name, value] : std::vector<std::pair<std::string, std::string>>{{"momentum", "0"},
                                                                                    {"momentum", "0.99"},
                                                                                    {"beta1", "0"},
                                                                                    {"weight-decay", "0"},
                                                                                    {"lr-min", "0"},
                                                                                    {"collective-timeout", "0"},
                                                                                    {"bucket-mb", "1e6"},
                                                                                    {"lr", "1e-30"}}) {
    EXPECT_EQ(parse_within_10s({"--batch-size", "10", "--" + name, value}).first, ExitCode::kOk)
        << name << " " << value;
  }
  // A decaying schedule cannot end above where it starts; a constant one ignores --lr-min.
  auto [code, msg] =
      parse_within_10s({"--batch-size", "10", "--lr", "0.01", "--lr-min", "0.1", "--lr-schedule", "cosine"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("--lr-min 0.1 is above --lr 0.01"), std::string::npos) << msg;
  EXPECT_EQ(parse_within_10s({"--batch-size", "10", "--lr", "0.01", "--lr-min", "0.1"}).first, ExitCode::kOk);
}

// Hostile input: a 10 MB value in a --config line gave a 10 MB error line. The message quotes
// at most ~80 characters of it and names the file and the line.
TEST(Options, AHugeConfigValueGivesAShortMessageNamingFileAndLine) {
  const TempFile ini("batch-size = 10\n\nepochs = " + std::string(10 << 20, '7') + "x\n");
  const auto [code, msg] = parse_within_10s({"--config", ini.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_LT(msg.size(), 300u) << msg.substr(0, 400);
  EXPECT_NE(msg.find("--config " + quote_input(ini.str()) + " line 3: option 'epochs': the value '7777"),
            std::string::npos)
      << msg.substr(0, 400);
  EXPECT_NE(msg.find("more bytes"), std::string::npos) << msg.substr(0, 400);
}

// A binary file given to --config: its raw bytes reached the terminal, with no file or line named.
TEST(Options, ABinaryConfigIsRefusedEscapedWithFileAndLine) {
  std::string elf =
      "lr = 0.1\n\x7f"
      "ELF\x02\x01\x01";
  elf += std::string(8, '\0') + std::string("\x03\x00\x3e\x00 = \x1b[2J\n", 12);
  const TempFile ini(elf);
  const auto [code, msg] = parse_within_10s({"--config", ini.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_TRUE(printable(msg)) << msg;
  EXPECT_NE(msg.find("--config " + quote_input(ini.str()) + " line 2: holds the control byte '\\x7f' at column 1"),
            std::string::npos)
      << msg;
  // A NUL in an otherwise textual line, and an escape sequence in a key, the same.
  const TempFile nul(std::string("batch-size = 10\nepochs = 1\0\n", 28));
  const auto [nul_code, nul_msg] = parse_within_10s({"--config", nul.str()});
  EXPECT_EQ(nul_code, ExitCode::kUsage);
  EXPECT_NE(nul_msg.find("line 2: holds the control byte '\\x00' at column 11"), std::string::npos) << nul_msg;
}

// Command-line values and option names are quoted, cut and escaped the same way (argv may hold
// ~128 KB per argument; here in process, 10 MB).
TEST(Options, HugeOrBinaryCommandLineTextGivesAShortPrintableMessage) {
  const std::string huge(10 << 20, 'z');
  auto [code, msg] = parse_within_10s({"--batch-size", "10", "--epochs", huge});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_LT(msg.size(), 300u) << msg.substr(0, 400);
  EXPECT_NE(msg.find("option '--epochs': the value 'zzz"), std::string::npos) << msg.substr(0, 400);
  std::tie(code, msg) = parse_within_10s({"--" + huge + "\x1b[31m"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_LT(msg.size(), 300u) << msg.substr(0, 400);
  EXPECT_TRUE(printable(msg)) << msg.substr(0, 400);
  EXPECT_NE(msg.find("unrecognised option '--zzz"), std::string::npos) << msg.substr(0, 400);
  EXPECT_NE(msg.find("\\x1b[31m'"), std::string::npos) << msg.substr(0, 400);
  std::tie(code, msg) = parse_within_10s({"--batch-size", "10", "--device", "\x01gpu" + huge});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_LT(msg.size(), 300u) << msg.substr(0, 400);
  EXPECT_TRUE(printable(msg)) << msg.substr(0, 400);
}

// Hostile input for --config: a directory was read as an empty file and the run went on with
// the defaults (exit 0); a FIFO blocked in open() for ever. Both are refused at once, saying what
// was found.
TEST(Options, AConfigThatIsNotARegularFileIsRefusedSayingWhatItIs) {
  const TempFile dir("", "dir.ini");
  std::filesystem::remove(dir.str());
  std::filesystem::create_directory(dir.str());
  auto [code, msg] = parse_within_10s({"--batch-size", "10", "--config", dir.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("--config " + quote_input(dir.str()) + " is a directory, not a regular file"), std::string::npos)
      << msg;
  const TempFile fifo("", "fifo.ini");
  std::filesystem::remove(fifo.str());
  ASSERT_EQ(::mkfifo(fifo.str().c_str(), 0600), 0);
  std::tie(code, msg) = parse_within_10s({"--batch-size", "10", "--config", fifo.str()});  // no writer: would block
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("is a FIFO (named pipe), not a regular file"), std::string::npos) << msg;
  std::tie(code, msg) = parse_within_10s({"--batch-size", "10", "--config", fifo.str() + ".missing"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("does not exist"), std::string::npos) << msg;
}

// --shard-optimizer: auto unless given; alone it means on (as the switch it was); on / off (and the
// true / false / yes / no / 1 / 0 the switch took) in a config file; anything else is refused.
TEST(Options, ShardOptimizerIsAutoOnOrOff) {
  const auto parse = [](std::vector<std::string> args, Options& o) {
    args.insert(args.begin(), {"mnist_mpi", "--batch-size", "8"});
    std::vector<const char*> argv;
    for (const std::string& a : args) argv.push_back(a.c_str());
    std::string text;
    return parse_options(static_cast<int>(argv.size()), argv.data(), o, text);
  };
  struct Case {
    std::vector<std::string> args;
    Options::Sharding want;
  };
  for (const Case& k : std::vector<Case>{{{}, Options::Sharding::kAuto},
                                         {{"--shard-optimizer"}, Options::Sharding::kOn},
                                         {{"--shard-optimizer", "on"}, Options::Sharding::kOn},
                                         {{"--shard-optimizer", "off"}, Options::Sharding::kOff},
                                         {{"--shard-optimizer=auto"}, Options::Sharding::kAuto}}) {
    Options o;
    ASSERT_EQ(parse(k.args, o), ParseOutcome::kRun);
    EXPECT_EQ(o.shard_optimizer, k.want) << (k.args.empty() ? "(none)" : k.args.back());
  }
  const TempFile ini("shard-optimizer = false\n");
  Options o;
  ASSERT_EQ(parse({"--config", ini.str()}, o), ParseOutcome::kRun);
  EXPECT_EQ(o.shard_optimizer, Options::Sharding::kOff);
  const auto [code, msg] = parse_within_10s({"--batch-size", "8", "--shard-optimizer", "sometimes"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("--shard-optimizer must be auto, on or off, got 'sometimes'"), std::string::npos) << msg;
}

// --optimizer names one of the kinds of include/mnist_mpi/optimizer_kind.hpp, from the command
// line or a config file; any other name is refused at parse time, listing the names.
TEST(Options, OptimizerIsOneOfTheKnownKinds) {
  for (const OptimizerTraits& t : kOptimizerTraits) {
    const TempFile ini(std::string("optimizer = ") + t.name + "\n");
    for (const std::vector<std::string>& args :
         {std::vector<std::string>{"mnist_mpi", "--batch-size", "8", "--optimizer", t.name},
          std::vector<std::string>{"mnist_mpi", "--batch-size", "8", "--config", ini.str()}}) {
      std::vector<const char*> argv;
      for (const std::string& a : args) argv.push_back(a.c_str());
      Options o;
      std::string text;
      ASSERT_EQ(parse_options(static_cast<int>(argv.size()), argv.data(), o, text), ParseOutcome::kRun);
      EXPECT_EQ(o.optimizer.kind, t.kind) << t.name;
      EXPECT_NE(o.resolved.find(std::string("optimizer = ") + t.name + "\n"), std::string::npos) << o.resolved;
    }
  }
  const auto [code, msg] = parse_within_10s({"--batch-size", "8", "--optimizer", "rmsprop"});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find("--optimizer must be adam or sgd or lamb, got 'rmsprop'"), std::string::npos) << msg;
}

// 0 is --batch-size's and --global-batch-size's "not given"; one given as 0, on the command line
// or in a config file, is a usage error naming it, and the command line's 0 does not fall back to
// the default over a config file's value (it once trained silently with a global batch of 100).
TEST(Options, AnExplicitZeroBatchIsRefusedNamingTheOption) {
  const TempFile ini("batch-size = 128\n");
  for (const std::string name : {"batch-size", "global-batch-size"}) {
    const TempFile zero(name + " = 0\n");
    for (const auto& args : std::vector<std::vector<std::string>>{
             {"--" + name, "0"}, {"--config", zero.str()}, {"--config", ini.str(), "--" + name, "0"}}) {
      const auto [code, msg] = parse_within_10s(args);
      EXPECT_EQ(code, ExitCode::kUsage) << args.back();
      EXPECT_NE(msg.find("--" + name + " must be > 0, got 0"), std::string::npos) << msg;
    }
  }
  // Neither given: the default global batch; a config file's value: that value.
  for (const auto& [args, want] : std::vector<std::pair<std::vector<std::string>, std::int64_t>>{
           {{}, kDefaultGlobalBatch}, {{"--config", ini.str()}, 0}}) {
    std::vector<const char*> argv{"mnist_mpi"};
    for (const std::string& a : args) argv.push_back(a.c_str());
    Options o;
    std::string text;
    ASSERT_EQ(parse_options(static_cast<int>(argv.size()), argv.data(), o, text), ParseOutcome::kRun);
    EXPECT_EQ(o.global_batch_size, want);
    EXPECT_EQ(o.batch_size, args.empty() ? 0 : 128);
  }
}

// One table of the pairs of options (src/config/combinations.cpp): the parser refuses the pairs of
// options alone, naming both and the fix; the rows about the machine wait for the trainer's place,
// and refuse there what the parser let through.
TEST(Combinations, ThePairsAreRefusedOnceAndTheMachineRowsWaitForThePlace) {
  for (const auto& [args, want] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--exact-sums", "--precision", "bf16"}, "--precision bf16 with --exact-sums"},
           {{"--exact-sums", "--cuda-graph", "--device", "cuda"}, "--exact-sums with --cuda-graph"},
           {{"--cuda-graph", "--device", "cpu"}, "--cuda-graph needs --device cuda"},
           {{"--batch-size", "8", "--global-batch-size", "16"}, "give one of --batch-size (per rank) and --global-batch-size"},
           {{"--checkpoint-every", "5"}, "--checkpoint-every needs --checkpoint-dir DIR"},
           {{"--conv-algos", "measured", "--device", "cpu"}, "--device cpu has none"}}) {
    const auto [code, msg] = parse_within_10s(args);
    EXPECT_EQ(code, ExitCode::kUsage) << want;
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
  Options o;
  o.exact_sums = true;
  o.threads = 2;
  check_combinations(o);  // threads are a question for the machine: not refused without it
  const RunPlace cpu{false, false, "node7"}, gpu{true, false, "node7"}, shared{true, true, "node7"};
  check_combinations(o, &gpu);  // a GPU rank's threads change none of its kernels
  try {
    check_combinations(o, &cpu);
    ADD_FAILURE() << "--exact-sums --threads 2 on a CPU rank was let through";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(e.what()).find("drop --threads 2"), std::string::npos) << e.what();
  }
  Options g;
  g.device = "auto";  // --device cpu with --cuda-graph is refused by the options alone
  g.cuda_graph = true;
  check_combinations(g);
  check_combinations(g, &gpu);
  for (const RunPlace* p : {&cpu, &shared}) {
    try {
      check_combinations(g, p);
      ADD_FAILURE() << "--cuda-graph let through on a place with cuda " << p->cuda << ", shared " << p->shared_gpus;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ExitCode::kUsage);
      EXPECT_NE(std::string(e.what()).find(p->cuda ? "ranks sharing a GPU" : "found none on node7"), std::string::npos)
          << e.what();
    }
  }
}

// The INI forms Boost's parser took still parse the same: comments, blank lines, CRLF line ends,
// and the command line wins over the file. The resolved text (it goes into checkpoints and is
// compared on resume) is unchanged for configs/tiny.ini: the expected text below was printed by
// the parser before it read --config itself (but for shard-optimizer, a switch then, auto since).
TEST(Options, ConfigFilesParseAsBeforeAndTheCommandLineWins) {
  const TempFile tiny(
      "# The blog post's network: two small convolutions without activations and one fc layer.\r\n"
      "model = conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10\r\n"
      "weight-init = xavier\n"
      "bias-init = zeros   # trailing comment\n"
      "\n"
      "   optimizer=adam\n"
      "lr = 0.01\n"
      "lr-schedule = step\n"
      "lr-gamma = 0.7\n"
      "lr-step-epochs = 1\n"
      "lr-min = 0.00001\n"
      "batch-size = 128\n"
      "epochs = 2\n"
      "log-every = 50");  // no newline at the end
  std::vector<std::string> args{"mnist_mpi", "--config", tiny.str(), "--epochs", "3"};
  std::vector<const char*> argv;
  for (const std::string& a : args) argv.push_back(a.c_str());
  Options o;
  std::string text;
  ASSERT_EQ(parse_options(static_cast<int>(argv.size()), argv.data(), o, text), ParseOutcome::kRun);
  EXPECT_EQ(o.epochs, 3);  // the command line wins
  EXPECT_EQ(o.batch_size, 128);
  EXPECT_EQ(o.schedule.gamma, 0.7);
  EXPECT_EQ(o.bias_init, "zeros");
  EXPECT_EQ(o.optimizer.kind, OptimizerKind::kAdam);
  EXPECT_EQ(o.resolved,
            "accumulation-steps = 1\nallow-gpu-sharing = false\nbatch-size = 128\nbeta1 = 0.9\nbeta2 = "
            "0.999\nbias-init = zeros\n"
            "bucket-mb = 4\ncheck-replicas-every = 100\ncheckpoint-async = true\ncheckpoint-every = 0\n"
            "collective-timeout = 300\ncompression-start-steps = -1\nconv-algos = heuristic\ncuda-graph = false\ndevice = "
            "cpu\nepochs = 3\neps = 1e-08\n"
            "eval-batch-size = 100\neval-every = 0\nexact-chunk = 0\nexact-sums = false\nfirst-bucket-mb = 1\nglobal-batch-size = 0\n"
            "grad-compression = none\n"
            "keep-checkpoints = 3\nlog-every = 50\nlr = 0.01\nlr-gamma = 0.7\nlr-min = 1e-05\n"
            "lr-schedule = step\nlr-step-epochs = 1\nmax-steps = 0\nmodel = "
            "conv:3x3:8:same,maxpool:2,conv:3x3:16:same,maxpool:2,flatten,fc:10\nmomentum = 0\n"
            "nesterov = false\nno-overlap = false\noptimizer = adam\nprecision = fp32\nprogress = auto\n"
            "quiet = false\nseed = 42\nshard-optimizer = auto\nskip-nonfinite-steps = false\ntarget-accuracy = 0\n"
            "threads = 0\n"
            "train-limit = 0\n"
            "validation-size = 5000\nwarmup-steps = 0\nweight-decay = 0\nweight-init = xavier\n");
}

// A key given twice in one file was refused by Boost ("cannot be specified more than once"); it
// still is, naming both lines. A line that is not key = value names its line.
TEST(Options, ConfigMistakesNameTheLine) {
  const TempFile twice("lr = 0.1\n# comment\nlr = 0.2\n");
  auto [code, msg] = parse_within_10s({"--batch-size", "10", "--config", twice.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find(" line 3: 'lr' is set again (first on line 1)"), std::string::npos) << msg;
  const TempFile no_eq("lr = 0.1\njust some words\n");
  std::tie(code, msg) = parse_within_10s({"--batch-size", "10", "--config", no_eq.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find(" line 2: 'just some words' is not a line of the form key = value"), std::string::npos) << msg;
  const TempFile unknown("\n\nbogus-key = 1\n");
  std::tie(code, msg) = parse_within_10s({"--batch-size", "10", "--config", unknown.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find(" line 3: unknown option 'bogus-key'"), std::string::npos) << msg;
  // Found by fuzz_options: Boost's find_nothrow() threw ambiguous_option for an empty name.
  const TempFile no_key("lr = 0.1\n = 3\n");
  std::tie(code, msg) = parse_within_10s({"--batch-size", "10", "--config", no_key.str()});
  EXPECT_EQ(code, ExitCode::kUsage);
  EXPECT_NE(msg.find(" line 2: no option name before the '='"), std::string::npos) << msg;
}

}  // namespace
}  // namespace mnist_mpi
