// The MNIST_MPI_FAULT testing hook (see include/mnist_mpi/resilience/fault.hpp): parsing, and the
// faults that end or freeze the process.
#include "mnist_mpi/resilience/fault.hpp"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "mnist_mpi/check.hpp"

namespace mnist_mpi {

Fault parse_fault(const std::string& text) {
  const auto bad = [&]() -> Fault {
    throw_error(ExitCode::kUsage,
                "MNIST_MPI_FAULT=" + quote_input(text) +
                    " is not RANK:STEP:KIND with KIND one of kill, segv, throw, stop, hang, nan, diverge, "
                    "nor RANK:thread:NAME with NAME one of checkpoint-writer, communication, watchdog, "
                    "nor RANK:slow:MS with MS from 1 to 10000, nor RANK:dropout:local (a testing hook; unset it "
                    "for a normal run)");
  };
  Fault f;
  if (text.size() > 200) return bad();
  const auto c1 = text.find(':');
  const auto c2 = c1 == std::string::npos ? std::string::npos : text.find(':', c1 + 1);
  if (c2 == std::string::npos) return bad();
  try {
    std::size_t used = 0;
    const std::string r = text.substr(0, c1), s = text.substr(c1 + 1, c2 - c1 - 1);
    f.rank = std::stoi(r, &used);
    if (used != r.size() || f.rank < 0) return bad();
    if (s == "thread") {
      f.kind = FaultKind::kThreadStart;
      f.thread = text.substr(c2 + 1);
      if (f.thread != "checkpoint-writer" && f.thread != "communication" && f.thread != "watchdog") return bad();
      return f;
    }
    if (s == "slow") {
      const std::string ms = text.substr(c2 + 1);
      f.kind = FaultKind::kSlow;
      f.slow_ms = std::stoll(ms, &used);
      if (used != ms.size() || f.slow_ms < 1 || f.slow_ms > 10000) return bad();
      return f;
    }
    if (s == "dropout") {
      if (text.substr(c2 + 1) != "local") return bad();
      f.kind = FaultKind::kLocalDropoutKey;
      return f;
    }
    f.step = std::stoll(s, &used);
    if (used != s.size() || f.step < 1) return bad();
  } catch (const std::logic_error&) {
    return bad();
  }
  const std::string k = text.substr(c2 + 1);
  if (k == "kill")
    f.kind = FaultKind::kKill;
  else if (k == "segv")
    f.kind = FaultKind::kSegv;
  else if (k == "throw")
    f.kind = FaultKind::kThrow;
  else if (k == "stop")
    f.kind = FaultKind::kStop;
  else if (k == "hang")
    f.kind = FaultKind::kHang;
  else if (k == "nan")
    f.kind = FaultKind::kNan;
  else if (k == "diverge")
    f.kind = FaultKind::kDiverge;
  else
    return bad();
  return f;
}

Fault fault_from_env() {
  const char* v = std::getenv("MNIST_MPI_FAULT");
  if (v == nullptr || *v == '\0') return {};
  return parse_fault(v);
}

void fault_after_thread_start(const char* name, int rank) {
  static const Fault f = [] {
    try {
      return fault_from_env();
    } catch (const Error&) {
      return Fault{};  // a malformed value is reported by the trainer, with its usage exit code
    }
  }();
  if (f.kind == FaultKind::kThreadStart && f.rank == rank && f.thread == name)
    throw_error(ExitCode::kRuntime, "MNIST_MPI_FAULT: rank " + std::to_string(rank) +
                                        " fails right after starting its " + name +
                                        " thread, on purpose (a testing hook)");
}

void fire_fault(const Fault& f) {
  const std::string what = "MNIST_MPI_FAULT: rank " + std::to_string(f.rank) + " fails in step " +
                           std::to_string(f.step) + " on purpose (a testing hook)";
  switch (f.kind) {
    case FaultKind::kKill:
    case FaultKind::kSegv:
    case FaultKind::kStop:
    case FaultKind::kHang:
      std::fprintf(stderr, "%s\n", what.c_str());
      std::fflush(stderr);
      break;
    default:
      break;
  }
  switch (f.kind) {
    case FaultKind::kKill:
      std::raise(SIGKILL);
      break;
    case FaultKind::kSegv:
      std::raise(SIGSEGV);
      break;
    case FaultKind::kStop:
      std::raise(SIGSTOP);
      break;
    case FaultKind::kHang:
      for (;;) pause();  // never returns: no signal handler of ours ends it
    case FaultKind::kThrow:
      throw_error(ExitCode::kRuntime, what);
    case FaultKind::kNone:
    case FaultKind::kNan:
    case FaultKind::kDiverge:
    case FaultKind::kThreadStart:
    case FaultKind::kSlow:
    case FaultKind::kLocalDropoutKey:
      break;
  }
}

void check_fault_rank(const Fault& fault, std::int64_t world) {
  MNIST_CHECK(fault.kind == FaultKind::kNone || fault.rank < world, ExitCode::kUsage,
              "MNIST_MPI_FAULT names rank " + std::to_string(fault.rank) + " but the job has " + std::to_string(world) +
                  " rank(s)");
}

void flip_last_bit(float& x) {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits ^= 1u;
  std::memcpy(&x, &bits, sizeof bits);
}

}  // namespace mnist_mpi
