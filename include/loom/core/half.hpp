// bf16 and fp16 as complete types, with their arithmetic and conversions (Eigen's bfloat16 and half). Headers that
// compute with them include this one; <loom/core/dtype.hpp> only names them, so that code which merely moves them
// (the communicators) does not parse Eigen.
#pragma once

#include <loom/core/dtype.hpp>

#include <Eigen/Core>
