// The MPI Communicator on any MPI communicator (tests split MPI_COMM_WORLD to train with 1, 2 and
// 3 ranks inside one mpirun), and MPI start-up. Kept apart from communicator.hpp so that only MPI
// code sees mpi.h.
#pragma once

#include <mpi.h>

#include <memory>

#include "mnist_mpi/comm/communicator.hpp"

namespace mnist_mpi {

// comm is duplicated; the Communicator frees its duplicates and joins its thread.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

// MPI_Init_thread asking for MPI_THREAD_MULTIPLE (the communication thread calls MPI while the
// main thread may too); returns the level provided. With less, sums run inside wait() instead.
int init_mpi(int* argc, char*** argv);

// MPI_Finalize. Both it and init_mpi() keep what Open MPI allocates in them out of LeakSanitizer's
// report in a sanitized build (Note [Open MPI under LeakSanitizer], src/comm/mpi_communicator.cpp).
void finalize_mpi();

}  // namespace mnist_mpi
