// mnist_mpi: options, MPI set-up, and the one place that turns errors into messages and exit codes.
#include <mpi.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <iostream>
#include <memory>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/checkpoint/evaluate_checkpoint.hpp"
#include "mnist_mpi/comm/mpi_communicator.hpp"
#include "mnist_mpi/comm/watchdog.hpp"
#include "mnist_mpi/config/options.hpp"
#include "mnist_mpi/export/onnx_export.hpp"
#include "mnist_mpi/io/standard_streams.hpp"
#include "mnist_mpi/predict/predict.hpp"
#include "mnist_mpi/report/report_command.hpp"
#include "mnist_mpi/comm/consistency.hpp"
#include "mnist_mpi/resilience/preemption.hpp"
#include "mnist_mpi/train/trainer.hpp"

using namespace mnist_mpi;

// The commands that run as one process, without MPI; `train` is the rest of main(). Each is listed
// in kCommandList (include/mnist_mpi/config/options.hpp) for --help: tests/check_commands.sh
// checks that every name here is there, in --help and in docs/usage.md.
struct Subcommand {
  const char* name;
  int (*main)(int, char**);
};
constexpr Subcommand kSubcommands[] = {
    {"evaluate", evaluate_checkpoint_main},
    {"export", export_onnx_main},
    {"predict", predict_main},
    {"report", report_main},
};

// Note [Ending every rank]
// Setup (options, data files, model spec, kernels) does only local work, so each rank can fail on
// its own (a file missing on one node) without any rank blocking in a collective. At the end of
// setup all ranks agree on the outcome with two tiny allreduces: the worst exit code and the lowest
// failing rank. That rank alone prints its message; every rank then exits with the same code.
// The same agreement follows the check that every rank runs the same job (src/comm/consistency.cpp).
// Once training has started, an error on one rank can leave the others inside a collective, so
// the failing rank prints its message and calls MPI_Abort, which ends every rank (mpirun exits
// non-zero). Errors the ranks agreed on after training started (AgreedError: a failed checkpoint
// write, a non-finite gradient) and preemption (exit code 75) end every rank normally, through
// MPI_Finalize. A rank that dies, or hangs so that a collective never finishes, is handled by
// mpirun and the collective watchdog (src/comm/watchdog.cpp; docs/faults.md). Errors go to
// stderr, prefixed with the rank and host.
// Long on purpose (Note [Why a function is long] in docs/style.md): every way a rank can end is
// in this one function, in the order it can happen, so that each exit code and each MPI_Abort or
// MPI_Finalize can be checked against the others at a glance.
int main(int argc, char** argv) {
  const auto start = std::chrono::steady_clock::now();
  open_closed_standard_descriptors();  // before MPI or any file takes descriptor 0, 1 or 2
  // `mnist_mpi train ...` is `mnist_mpi ...`; `mnist_mpi evaluate|export|predict|report ...`: one process, no MPI.
  if (argc >= 2 && std::string(argv[1]) == "train") {
    argv[1] = argv[0];
    --argc;
    ++argv;
  }
  if (argc >= 2)
    for (const Subcommand& c : kSubcommands)
      if (std::string(argv[1]) == c.name) return c.main(argc - 1, argv + 1);
  install_preemption_handlers();  // first: a signal during start-up must not kill a rank either
  // A closed pipe on stdout is an output that cannot be written (exit 7), not a reason to die.
  std::signal(SIGPIPE, SIG_IGN);
  mnist_mpi::init_mpi(&argc, &argv);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);  // errors come back to MPI_CHECK
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char host[MPI_MAX_PROCESSOR_NAME] = {0};
  int host_len = 0;
  MPI_Get_processor_name(host, &host_len);
  auto report = [&](const std::string& msg) {
    std::fflush(stdout);
    std::fprintf(stderr, "mnist_mpi: error on rank %d (%s): %s\n", rank, host, msg.c_str());
    std::fflush(stderr);
  };

  std::unique_ptr<CollectiveWatch> watch;  // outlives the communicator that marks it
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Trainer> trainer;
  std::int64_t code = 0;
  std::string message;
  auto finish = [&](std::int64_t rc) {
    trainer.reset();
    comm.reset();
    watch.reset();
    finalize_mpi();
    return static_cast<int>(rc);
  };
  // Every rank learns the worst code; the lowest failing rank prints its message.
  auto agree = [&](const char* what) {
    WatchScope scope(watch.get(), what);
    std::int64_t worst = code, first_failing = code ? rank : INT64_MAX;
    MPI_Allreduce(MPI_IN_PLACE, &worst, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(MPI_IN_PLACE, &first_failing, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    if (worst != 0 && rank == first_failing) report(message);
    return worst;
  };
  auto catching = [&](auto&& body) {
    try {
      body();
    } catch (const Error& e) {
      code = static_cast<int>(e.code());
      message = e.what();
    } catch (const std::exception& e) {
      code = static_cast<int>(ExitCode::kRuntime);
      message = e.what();
    } catch (...) {
      code = static_cast<int>(ExitCode::kRuntime);
      message = "an unknown exception during set-up";
    }
  };

  bool exit_ok = false;
  // The communicator is made first, on every rank alike: MPI_Comm_dup is a collective, so making
  // it after work that can fail on one rank only (options) would leave the others waiting in it.
  catching([&] { comm = make_mpi_communicator(); });
  catching([&] {
    if (code != 0) return;
    Options options;
    std::string text;
    if (parse_options(argc, argv, options, text) == ParseOutcome::kExitOk) {
      if (rank == 0) std::cout << text;
      exit_ok = true;
      return;
    }
    watch = std::make_unique<CollectiveWatch>(options.collective_timeout, rank, host);
    comm = watch_communicator(std::move(comm), *watch);
    trainer = std::make_unique<Trainer>(options, *comm, start);
  });
  // Note [Every rank takes part in the set-up agreement]
  // A rank that leaves before the agreement (one rank of an MPMD launch given --version) would
  // leave the others waiting in it until --collective-timeout. So --help and --version take part
  // too: the ranks first learn whether all, none or only some of them were asked to exit, and a
  // mix is a usage error on every rank, at once.
  {
    WatchScope scope(watch.get(), "the setup agreement (allreduce)");
    std::int64_t asked[2] = {exit_ok ? 1 : 0, exit_ok ? 0 : 1};  // some said exit, some did not
    MPI_Allreduce(MPI_IN_PLACE, asked, 2, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    if (asked[0] != 0 && asked[1] != 0) {
      if (code == 0) {
        code = static_cast<int>(ExitCode::kUsage);
        message =
            "the ranks were started with different options: some were given --help or --version, others a run "
            "(this rank: " +
            std::string(exit_ok ? "--help/--version" : "a run") + "); give every rank of the job the same options";
      }
      exit_ok = false;
      trainer.reset();
    }
  }
  if (exit_ok) return finish(0);  // every rank parsed --help / --version
  if (const std::int64_t worst = agree("the setup agreement (allreduce)"); worst != 0) return finish(worst);
  catching([&] { check_ranks_agree(*comm, trainer->job_description()); });
  if (const std::int64_t worst = agree("the same-job agreement (allreduce)"); worst != 0) return finish(worst);
  catching([&] { check_same_data(*comm, trainer->data_files()); });  // all ranks throw, or none
  if (const std::int64_t worst = agree("the same-data agreement (allreduce)"); worst != 0) return finish(worst);

  int exit_code = 0;
  try {
    const RunResult r = trainer->run();
    if (r.preempted_signal != 0)
      exit_code = static_cast<int>(ExitCode::kPreempted);
    else if (r.outputs_lost)
      exit_code = static_cast<int>(ExitCode::kOutput);  // agreed by every rank
  } catch (const AgreedError& e) {                      // every rank threw it; the message is on one of them
    if (*e.what()) report(e.what());
    exit_code = static_cast<int>(e.code());
  } catch (const Error& e) {
    report(e.what());
    MPI_Abort(MPI_COMM_WORLD, static_cast<int>(e.code()));
  } catch (const std::exception& e) {
    report(e.what());
    MPI_Abort(MPI_COMM_WORLD, static_cast<int>(ExitCode::kRuntime));
  }
  return finish(exit_code);
}
