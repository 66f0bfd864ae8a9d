// Runs the CUDA kernels of relayout.cu on the CPU: defines the few CUDA names
// they use, then includes the very same source. A "launch" loops over every
// block and thread of the grid, one at a time. This is exact for these kernels
// because they use no shared memory, barriers or warp intrinsics: each thread's
// bytes are disjoint from every other thread's, so execution order is free.
#ifndef PDX_HOST_HARNESS_H
#define PDX_HOST_HARNESS_H

#define PDX_HOST_HARNESS 1

struct uint4 {
    unsigned int x, y, z, w;
};

struct pdx_dim3 {
    unsigned int x, y, z;
};

// The built-in variables, set by pdx_host_launch before each thread runs.
static thread_local pdx_dim3 blockIdx, threadIdx, blockDim, gridDim;

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define PDX_UNROLL

// Global-memory load/store intrinsics the kernels use.
static inline uint4 __ldg(const uint4* p) { return *p; }
static inline void __stwb(uint4* p, uint4 v) { *p = v; }

#include "relayout.cu"

// Calls `kernel(args...)` once per (block, thread) of the grid.
template <typename... Args>
static void pdx_host_launch(void (*kernel)(Args...), pdx_dim3 grid, pdx_dim3 block,
                            Args... args) {
    gridDim = grid;
    blockDim = block;
    for (unsigned int bz = 0; bz < grid.z; ++bz)
        for (unsigned int by = 0; by < grid.y; ++by)
            for (unsigned int bx = 0; bx < grid.x; ++bx)
                for (unsigned int tz = 0; tz < block.z; ++tz)
                    for (unsigned int ty = 0; ty < block.y; ++ty)
                        for (unsigned int tx = 0; tx < block.x; ++tx) {
                            blockIdx = pdx_dim3{bx, by, bz};
                            threadIdx = pdx_dim3{tx, ty, tz};
                            kernel(args...);
                        }
}

#endif
