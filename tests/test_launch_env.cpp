// Tests of reading the launcher's environment: who started the rank (srun, mpirun under Slurm, a
// batch shell, a user), which node-local rank is trusted (Note [Who started this rank]), the
// start-up line and metrics fields, and the usage error for srun tasks that MPI left alone.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <string>

#include "mnist_mpi/check.hpp"
#include "mnist_mpi/json.hpp"
#include "mnist_mpi/launch/launch_env.hpp"

namespace mnist_mpi {
namespace {

// getenv's contract over a map of variables.
std::function<const char*(const char*)> lookup_in(const std::map<std::string, std::string>& vars) {
  return [&vars](const char* name) -> const char* {
    const auto it = vars.find(name);
    return it == vars.end() ? nullptr : it->second.c_str();
  };
}

LaunchEnv read(const std::map<std::string, std::string>& vars) { return read_launch_env(lookup_in(vars)); }

// The members add_json_fields gives an event that already holds one, as the metrics line reads.
std::string json_fields(const LaunchEnv& e) {
  Json event{{"event", "start"}};
  e.add_json_fields(event);
  return json_text(event);
}

TEST(LaunchEnv, OutsideSlurmSaysNothing) {
  const LaunchEnv e = read({});
  EXPECT_EQ(e.launcher, "direct");
  EXPECT_FALSE(e.in_slurm());
  EXPECT_EQ(e.describe(), "");
  EXPECT_EQ(json_fields(e), "{\"event\":\"start\"}");
  EXPECT_EQ(e.local_rank, -1);
}

TEST(LaunchEnv, SrunTaskUsesSlurmLocalId) {
  const LaunchEnv e = read({{"SLURM_JOB_ID", "42"},
                            {"SLURM_JOB_NAME", "mnist-cpu"},
                            {"SLURM_STEP_ID", "0"},
                            {"SLURM_STEP_NUM_TASKS", "4"},
                            {"SLURM_LOCALID", "3"},
                            {"SLURM_RESTART_COUNT", "2"},
                            {"SLURM_JOB_NODELIST", "n[1-2]"}});
  EXPECT_EQ(e.launcher, "srun");
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.step_tasks, 4);
  EXPECT_EQ(e.describe(), "launch: srun, slurm job 42 'mnist-cpu' step 0, requeued 2 time(s), nodes n[1-2]");
  EXPECT_EQ(json_fields(e),
            "{\"event\":\"start\",\"slurm_job_id\":\"42\",\"slurm_job_name\":\"mnist-cpu\",\"slurm_restart_count\":2}");
}

// Measured: ranks that mpirun starts inside a job inherit the batch shell's SLURM_LOCALID=0.
TEST(LaunchEnv, MpirunInsideSlurmIgnoresInheritedLocalId) {
  const LaunchEnv e = read({{"SLURM_JOB_ID", "7"},
                            {"SLURM_JOB_NAME", "j"},
                            {"SLURM_LOCALID", "0"},
                            {"OMPI_COMM_WORLD_SIZE", "2"},
                            {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  EXPECT_EQ(e.launcher, "mpirun");
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.step_tasks, 0);
}

// Note [A singleton's own session directory]: any launcher's rank variable means MPI was started
// for this process by a launcher; none means a singleton.
TEST(LaunchEnv, LaunchedAloneOnlyWithoutALaunchersRankVariables) {
  auto alone = [](const std::map<std::string, std::string>& vars) { return launched_alone(lookup_in(vars)); };
  EXPECT_TRUE(alone({}));
  EXPECT_TRUE(alone({{"SLURM_JOB_ID", "8"}, {"SLURM_LOCALID", "0"}}));  // a batch shell running it
  EXPECT_FALSE(alone({{"OMPI_COMM_WORLD_SIZE", "1"}}));                 // mpirun -np 1
  EXPECT_FALSE(alone({{"PMIX_RANK", "0"}}));                            // srun --mpi=pmix
  EXPECT_FALSE(alone({{"PMI_RANK", "3"}}));                             // srun --mpi=pmi2
  EXPECT_FALSE(alone({{"PMI_FD", "5"}}));
}

TEST(LaunchEnv, BatchShellRunningTheProgramItself) {
  const LaunchEnv e = read({{"SLURM_JOB_ID", "8"}, {"SLURM_JOB_NAME", "x"}, {"SLURM_LOCALID", "0"}});
  EXPECT_EQ(e.launcher, "batch");
  EXPECT_EQ(e.local_rank, -1);
  EXPECT_EQ(e.describe(), "launch: batch, slurm job 8 'x'");
}

TEST(LaunchEnv, JobNameIsEscapedInJson) {
  const LaunchEnv e = read({{"SLURM_JOB_ID", "1"}, {"SLURM_JOB_NAME", "a\"b\\c\n\x01"}});
  EXPECT_EQ(json_fields(e),
            "{\"event\":\"start\",\"slurm_job_id\":\"1\",\"slurm_job_name\":\"a\\\"b\\\\c\\n\\u0001\","
            "\"slurm_restart_count\":0}");
}

TEST(LaunchEnv, GarbageNumbersAreIgnored) {
  const LaunchEnv e = read({{"SLURM_JOB_ID", "1"},
                            {"SLURM_STEP_ID", "0"},
                            {"SLURM_LOCALID", "-3"},
                            {"SLURM_RESTART_COUNT", "x"},
                            {"SLURM_STEP_NUM_TASKS", "99999999999"}});
  EXPECT_EQ(e.local_rank, -1);
  EXPECT_EQ(e.slurm_restart_count, 0);
  EXPECT_EQ(e.step_tasks, 0);
}

TEST(LaunchEnv, SrunTasksLeftAloneByMpiAreAUsageError) {
  const LaunchEnv e =
      read({{"SLURM_JOB_ID", "5"}, {"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NUM_TASKS", "2"}, {"SLURM_LOCALID", "1"}});
  try {
    e.check_world_size(1);
    FAIL() << "no error for 2 srun tasks in a world of 1";
  } catch (const Error& err) {
    EXPECT_EQ(err.code(), ExitCode::kUsage);
    EXPECT_NE(std::string(err.what()).find("srun started 2 tasks but MPI sees a world of 1"), std::string::npos);
    EXPECT_NE(std::string(err.what()).find("--mpi=pmix"), std::string::npos);
  }
  EXPECT_NO_THROW(e.check_world_size(2));
  EXPECT_NO_THROW(
      read({{"SLURM_JOB_ID", "5"}, {"SLURM_STEP_ID", "0"}, {"SLURM_STEP_NUM_TASKS", "1"}}).check_world_size(1));
  EXPECT_NO_THROW(read({{"OMPI_COMM_WORLD_SIZE", "1"}}).check_world_size(1));
}

TEST(LaunchEnv, LocalRankFromMpiUnlessTheRankIsAlone) {
  const LaunchEnv srun = read({{"SLURM_JOB_ID", "5"}, {"SLURM_STEP_ID", "0"}, {"SLURM_LOCALID", "3"}});
  EXPECT_EQ(srun.choose_local_rank(1, 4), 1);  // MPI joined the ranks: its answer
  EXPECT_EQ(srun.choose_local_rank(0, 1), 3);  // alone: the launcher's
  EXPECT_EQ(read({}).choose_local_rank(0, 1), 0);
}

// Note [Open MPI's point-to-point layer on one node]: ob1 exactly when the job is known to be on
// one node and the user chose no pml.
const char* pml(const std::map<std::string, std::string>& vars) { return pml_for_launch(lookup_in(vars)); }

TEST(LaunchEnv, Ob1OnlyForJobsOnOneNode) {
  const auto is = [](const char* got, const char* want) {
    return want == nullptr ? got == nullptr : got != nullptr && std::string(got) == want;
  };
  EXPECT_TRUE(is(pml({}), "ob1"));  // a singleton
  EXPECT_TRUE(is(pml({{"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}), "ob1"));
  EXPECT_TRUE(is(pml({{"OMPI_COMM_WORLD_SIZE", "4"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}), nullptr));
  EXPECT_TRUE(is(pml({{"OMPI_COMM_WORLD_SIZE", "2"}}), nullptr));  // no local size: unknown
  // mpirun inside a two-node allocation on one of its nodes: mpirun's variables decide.
  EXPECT_TRUE(is(pml({{"SLURM_JOB_ID", "7"},
                      {"SLURM_NNODES", "2"},
                      {"OMPI_COMM_WORLD_SIZE", "2"},
                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}),
                 "ob1"));
  EXPECT_TRUE(is(pml({{"SLURM_JOB_ID", "7"}, {"SLURM_STEP_NUM_NODES", "1"}, {"SLURM_NNODES", "2"}}), "ob1"));
  EXPECT_TRUE(is(pml({{"SLURM_JOB_ID", "7"}, {"SLURM_STEP_NUM_NODES", "2"}}), nullptr));
  EXPECT_TRUE(is(pml({{"SLURM_JOB_ID", "7"}, {"SLURM_NNODES", "1"}}), "ob1"));
  EXPECT_TRUE(is(pml({{"SLURM_JOB_ID", "7"}}), nullptr));
  EXPECT_TRUE(is(pml({{"OMPI_MCA_pml", "ucx"}}), nullptr));  // the user's choice stands
  EXPECT_TRUE(
      is(pml({{"OMPI_MCA_pml", "ucx"}, {"OMPI_COMM_WORLD_SIZE", "2"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}}), nullptr));
}

}  // namespace
}  // namespace mnist_mpi
