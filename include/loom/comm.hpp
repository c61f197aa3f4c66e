// <loom/comm.hpp>: Communicators: the Communicator concept and its typed collectives, Context (a rank's communicator per
// group of a layout), and the Local backend (ranks as threads, run_local). The Mpi and Nccl backends need their
// libraries: include <loom/comm/mpi.hpp> (loom::mpi) or <loom/comm/nccl.hpp> (loom::cuda) for them.
#pragma once

#include <loom/config.hpp>
#include <loom/comm/communicator.hpp>
#include <loom/comm/context.hpp>
#include <loom/comm/local.hpp>
