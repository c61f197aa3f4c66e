// Where loom's non-template functions are defined. loom is header-only: by default each is an `inline` function of
// its header. A program built with LOOM_EXTERN_KERNELS (linking loom::cpu_kernels) sees only their declarations, and
// src/compiled.cpp, which defines LOOM_COMPILED_HERE, holds the one definition of each: the Local backend's
// waiting, matching and messages, and the trace's writer, compiled once instead of in every translation unit.
//
//   LOOM_COMPILED            the specifier a definition starts with: `inline`, or nothing where compiled once
//   LOOM_DEFINE_COMPILED     1 where this translation unit sees the definitions, 0 where it links them
#pragma once

#if defined(LOOM_COMPILED_HERE)
#define LOOM_COMPILED
#define LOOM_DEFINE_COMPILED 1
#elif defined(LOOM_EXTERN_KERNELS) || defined(LOOM_BUILDING_KERNELS)
#define LOOM_COMPILED
#define LOOM_DEFINE_COMPILED 0
#else
#define LOOM_COMPILED inline
#define LOOM_DEFINE_COMPILED 1
#endif
