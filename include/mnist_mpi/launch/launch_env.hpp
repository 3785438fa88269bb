// What the launcher tells each rank through the environment: Slurm's job id, name, requeue count
// and step, who started the rank (srun, mpirun, a batch shell or a user), and the node-local rank
// from mpirun (OMPI_COMM_WORLD_LOCAL_RANK) or srun (SLURM_LOCALID). Read once at start-up for the
// log and the metrics file; nothing here talks to MPI (the communicator knows the MPI ranks).
#pragma once

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <string>

namespace mnist_mpi {

struct LaunchEnv {
  std::string launcher = "direct";  // "srun", "mpirun", "batch" (run by a Slurm batch shell) or "direct"
  std::string slurm_job_id;         // SLURM_JOB_ID; empty outside Slurm
  std::string slurm_job_name;       // SLURM_JOB_NAME
  std::string slurm_step_id;        // SLURM_STEP_ID (srun steps only)
  std::string slurm_nodelist;       // SLURM_JOB_NODELIST
  int slurm_restart_count = 0;      // SLURM_RESTART_COUNT: how often the job was requeued
  int step_tasks = 0;               // SLURM_STEP_NUM_TASKS when srun started this rank, else 0
  int local_rank = -1;              // the launcher's node-local rank; -1 when it gave none

  bool in_slurm() const { return !slurm_job_id.empty(); }
  // One start-up log line ("launch: srun, slurm job 42 'mnist-cpu' ..."); empty when started directly.
  std::string describe() const;
  // Adds the job's members to a metrics event (slurm_job_id, slurm_job_name, slurm_restart_count);
  // nothing outside Slurm.
  void add_json_fields(nlohmann::ordered_json& event) const;
  // Throws Error(kUsage) when srun started several tasks but MPI made each its own world of one
  // (an MPI without the PMI that srun offered): N copies would otherwise train alone, silently.
  void check_world_size(int world_size) const;
  // The node-local rank to use: MPI's when MPI joined several ranks, the launcher's for a lone
  // rank (e.g. srun tasks each run as a world of one), else 0 (Note [Whose local rank]).
  int choose_local_rank(int mpi_local_rank, int world_size) const;
};

// Note [Open MPI's point-to-point layer on one node]
// Open MPI 4.1 chooses its pml in MPI_Init, and with the UCX pml installed (Debian's package has
// it) it first initialises UCX, which scans every transport and network device: MPI_Init took
// 0.28 s here, 0.07 s with the ob1 pml. Between ranks of one node ob1 runs over shared memory
// (the vader btl), which is what UCX would use there too. So a job that is known to be on one node
// asks for ob1 before MPI_Init, unless the user chose a pml (OMPI_MCA_pml); jobs across nodes keep
// Open MPI's choice (UCX on InfiniBand). One node: mpirun's OMPI_COMM_WORLD_LOCAL_SIZE equals
// OMPI_COMM_WORLD_SIZE; srun's SLURM_STEP_NUM_NODES (or, for a batch shell, SLURM_NNODES) is 1; or no
// launcher at all (a singleton). Returns the pml to ask for, or nullptr to leave it to Open MPI.
const char* pml_for_launch(const std::function<const char*(const char*)>& lookup);

// Note [A singleton's own session directory]
// A process started without a launcher is an Open MPI singleton. Open MPI 4.1 (Debian 12) then
// forks a helper daemon and both put their session directories under one shared tree,
// <tmp>/ompi.<host>.<uid>/, which the last process to finish removes. Two failures follow when
// singletons start and end side by side (CTest -j2, a predict next to a training run), each
// measured with 16 concurrent copies of one unit test on 2 cores:
//   - MPI_Init fails ("A call to mkdir was unable to create the desired directory ... No such file
//     or directory") when a neighbour removes the shared tree between this process's mkdirs (CI,
//     2026-12-04; open-mpi/ompi#8510);
//   - MPI_Finalize segfaults in Open MPI's progress thread after all work is done (1 in about
//     1000 processes; core: a libevent callback at an unmapped address while
//     opal_progress_thread_finalize joins it).
// So a singleton (no OMPI_COMM_WORLD_SIZE from mpirun, no PMIX_RANK or PMI_RANK from srun) asks
// for ess_singleton_isolated (no helper daemon: it could only serve MPI_Comm_spawn, never called
// here; MPI_Init also takes 27 ms instead of 113 ms) and gets a session tree of its own, a fresh
// directory under OMPI_MCA_orte_tmpdir_base, TMPDIR or /tmp, removed at exit. Both are needed:
// isolated singletons name their session directory jf.0/1/0, the same for all of them, and 189 of
// 3000 failed at MPI_Init with a shared tree; with their own trees, 0 of 3000 (against 2 of 2500
// before any change). A user's own ess_singleton_isolated is kept. Returns whether this process
// starts as a singleton.
bool launched_alone(const std::function<const char*(const char*)>& lookup);

// Reads the variables through lookup (getenv's contract: nullptr when unset), for tests.
LaunchEnv read_launch_env(const std::function<const char*(const char*)>& lookup);
// Reads this process's environment.
LaunchEnv read_launch_env();

}  // namespace mnist_mpi
