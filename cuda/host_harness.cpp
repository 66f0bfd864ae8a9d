// C entry points of the CPU-emulated kernels, for the Rust tests
// (tests/gpu/kernel_harness.rs builds this file into a shared library with g++).
// Device addresses are host addresses here.
#include "host_harness.h"

extern "C" {

// Runs pdx_gather (which = 0) or pdx_scatter (which = 1) over a
// (grid_x, grid_y) grid of `block_x`-thread blocks. Returns 0, or -1 for an
// unknown kernel.
int pdx_harness_launch(int which, const PdxCopyEntry* entries, pdx_u32 num_entries,
                       const PdxSpan* spans, pdx_u64 num_spans, unsigned int grid_x,
                       unsigned int grid_y, unsigned int block_x) {
    void (*k)(const PdxCopyEntry*, pdx_u32, const PdxSpan*, pdx_u64);
    if (which == 0)
        k = pdx_gather;
    else if (which == 1)
        k = pdx_scatter;
    else
        return -1;
    pdx_host_launch(k, pdx_dim3{grid_x, grid_y, 1}, pdx_dim3{block_x, 1, 1}, entries,
                    num_entries, spans, num_spans);
    return 0;
}
}
