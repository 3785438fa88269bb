// The MPI Communicator on any MPI communicator (tests split MPI_COMM_WORLD to train with 1, 2 and
// 3 ranks inside one mpirun). Kept apart from communicator.hpp so that only MPI code sees mpi.h.
#pragma once

#include <mpi.h>

#include <memory>

#include "mnist_mpi/comm/communicator.hpp"

namespace mnist_mpi {

// comm is duplicated; the Communicator frees its duplicate.
std::unique_ptr<Communicator> make_mpi_communicator(MPI_Comm comm);

}  // namespace mnist_mpi
