// Standard input, output and error: made safe to use before anything else runs, and standard
// output checked at the end of a command whose results are printed there.
//
// Note [Closed standard descriptors]
// A program started with a standard descriptor closed (`mnist_mpi >&-`, a daemon's child) gives
// descriptor 0, 1 or 2 to the next file it opens: MPI's pipes, a data file, a checkpoint. Its own
// progress lines and error messages then go into whatever took the number. So the first thing
// main() does is open /dev/null on each of 0, 1 and 2 that is closed, before MPI or any file is
// opened. A closed standard output is still a lost output (exit 7): it is remembered here, and
// the run reports it (OutputFile::standard_output() in include/mnist_mpi/report/output.hpp, and
// standard_output_error() for the one-process commands).
#pragma once

#include <string>

namespace mnist_mpi {

// Opens /dev/null on each of descriptors 0, 1 and 2 that is closed (Note [Closed standard descriptors]).
void open_closed_standard_descriptors();
// Whether descriptor 1 was closed when open_closed_standard_descriptors() ran.
bool stdout_was_closed();
// The file behind descriptor fd, for messages ("/dev/full", "/scratch/job.out"); "" when unknown.
std::string descriptor_target(int fd);

// Flushes stdout and says whether everything printed to it was written: "" when it was, else what
// failed, naming the file behind it ("standard output '/dev/full': write: No space left on
// device"). For `evaluate`, `export` and `predict`, whose results are their standard output.
std::string standard_output_error();

}  // namespace mnist_mpi
