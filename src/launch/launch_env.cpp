// Reads the launcher's environment (see include/mnist_mpi/launch/launch_env.hpp): Slurm's job
// variables for the start-up log and the metrics file, and the launcher's node-local rank.
#include "mnist_mpi/launch/launch_env.hpp"

#include <cstdlib>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/json.hpp"

namespace mnist_mpi {
namespace {

std::string get(const std::function<const char*(const char*)>& lookup, const char* name) {
  const char* v = lookup(name);
  return v ? std::string(v) : std::string();
}

// A non-negative integer, or fallback when the variable is unset or not a number.
int get_int(const std::function<const char*(const char*)>& lookup, const char* name, int fallback) {
  const std::string s = get(lookup, name);
  if (s.empty() || s.size() > 9 || s.find_first_not_of("0123456789") != std::string::npos) return fallback;
  return std::stoi(s);
}

}  // namespace

// Note [Who started this rank]
// mpirun sets OMPI_COMM_WORLD_SIZE and OMPI_COMM_WORLD_LOCAL_RANK in each rank's environment;
// inside a Slurm allocation its ranks also inherit the batch shell's SLURM_LOCALID (0 for every
// rank on the first node, measured), so SLURM_LOCALID is trusted only when srun itself started the
// rank (SLURM_STEP_ID is set for srun steps and absent in the batch shell). A Slurm job variable
// without either means the batch shell ran the program itself, as one process.
const char* pml_for_launch(const std::function<const char*(const char*)>& lookup) {
  if (lookup("OMPI_MCA_pml")) return nullptr;  // the user's choice
  const int world = get_int(lookup, "OMPI_COMM_WORLD_SIZE", -1);
  if (world > 0) return get_int(lookup, "OMPI_COMM_WORLD_LOCAL_SIZE", -1) == world ? "ob1" : nullptr;
  const int step_nodes = get_int(lookup, "SLURM_STEP_NUM_NODES", -1);
  if (step_nodes > 0) return step_nodes == 1 ? "ob1" : nullptr;
  if (lookup("SLURM_JOB_ID")) return get_int(lookup, "SLURM_NNODES", -1) == 1 ? "ob1" : nullptr;
  return "ob1";  // a singleton: one process
}

// Note [A singleton's own session directory] (launch_env.hpp)
bool launched_alone(const std::function<const char*(const char*)>& lookup) {
  for (const char* launcher_variable : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_FD"})
    if (lookup(launcher_variable)) return false;
  return true;
}

LaunchEnv read_launch_env(const std::function<const char*(const char*)>& lookup) {
  LaunchEnv e;
  e.slurm_job_id = get(lookup, "SLURM_JOB_ID");
  e.slurm_job_name = get(lookup, "SLURM_JOB_NAME");
  e.slurm_nodelist = get(lookup, "SLURM_JOB_NODELIST");
  e.slurm_restart_count = get_int(lookup, "SLURM_RESTART_COUNT", 0);
  if (lookup("OMPI_COMM_WORLD_SIZE") != nullptr) {
    e.launcher = "mpirun";
    e.local_rank = get_int(lookup, "OMPI_COMM_WORLD_LOCAL_RANK", -1);
  } else if (lookup("SLURM_STEP_ID") != nullptr) {
    e.launcher = "srun";
    e.slurm_step_id = get(lookup, "SLURM_STEP_ID");
    e.step_tasks = get_int(lookup, "SLURM_STEP_NUM_TASKS", 0);
    e.local_rank = get_int(lookup, "SLURM_LOCALID", -1);
  } else if (e.in_slurm()) {
    e.launcher = "batch";
  }
  return e;
}

LaunchEnv read_launch_env() {
  return read_launch_env([](const char* name) -> const char* { return std::getenv(name); });
}

std::string LaunchEnv::describe() const {
  if (!in_slurm() && launcher == "direct") return {};
  std::string s = "launch: " + launcher;
  if (in_slurm()) {
    s += ", slurm job " + slurm_job_id + " '" + slurm_job_name + "'";
    if (!slurm_step_id.empty()) s += " step " + slurm_step_id;
    if (slurm_restart_count > 0) s += ", requeued " + std::to_string(slurm_restart_count) + " time(s)";
    if (!slurm_nodelist.empty()) s += ", nodes " + slurm_nodelist;
  }
  return s;
}

void LaunchEnv::add_json_fields(Json& event) const {
  if (!in_slurm()) return;
  event["slurm_job_id"] = slurm_job_id;
  event["slurm_job_name"] = slurm_job_name;
  event["slurm_restart_count"] = slurm_restart_count;
}

void LaunchEnv::check_world_size(int world_size) const {
  MNIST_CHECK(!(launcher == "srun" && step_tasks > 1 && world_size == 1), ExitCode::kUsage,
              "srun started " + std::to_string(step_tasks) +
                  " tasks but MPI sees a world of 1: this MPI did not take its ranks from srun's PMI; "
                  "launch with 'srun --mpi=pmix' (Debian's Open MPI has no PMI-2) or with mpirun inside the job");
}

// Note [Whose local rank]
// MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) gives the node-local rank whenever MPI joined several
// ranks, and that is the one used. A rank alone in its world (srun tasks run as separate
// single-rank trainings, each on its own GPU) cannot learn it from MPI; then the launcher's
// (SLURM_LOCALID under srun) is used, so that such tasks still pick different devices.
int LaunchEnv::choose_local_rank(int mpi_local_rank, int world_size) const {
  if (world_size > 1) return mpi_local_rank;
  return local_rank >= 0 ? local_rank : mpi_local_rank;
}

}  // namespace mnist_mpi
