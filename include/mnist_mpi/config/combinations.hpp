// Which options a run can combine, in one table (src/config/combinations.cpp): every refusal of a
// pair of options, or of an option on the machine the run found, is a row there with its message
// and its fix, and nowhere else. Each option's own values are checked where it is parsed
// (src/config/options.cpp); what a pair means at run time is the code's business, not the table's.
#pragma once

#include <string>

#include "mnist_mpi/config/options.hpp"

namespace mnist_mpi {

// What the run found before it reads any data: the device chosen, the ranks per GPU, the threads
// per rank asked for. The rows that need it are checked by the trainer once it knows it.
struct RunPlace {
  bool cuda = false;         // the device chosen is a GPU
  bool shared_gpus = false;  // ranks of this host share a GPU (--allow-gpu-sharing)
  std::string host;          // for the messages
  int world = 1;             // ranks in the job
};

// Throws Error(kUsage) with the first row that refuses these options: the rows of options alone
// when `place` is null (parse_options), every row with it (the trainer, which also sees Options
// built in code).
void check_combinations(const Options& o, const RunPlace* place = nullptr);

}  // namespace mnist_mpi
