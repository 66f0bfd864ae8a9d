// pdxfer relayout kernels: gather one decode rank's token rows from paged KV
// pools into an entry-major staging (pack) buffer, and scatter them back out.
//
// Both directions copy *spans*: `rows` consecutive rows from `src_row` of the
// source to `dst_row` of the destination, for every entry (layer) of a table.
// Row r of an entry lives at `base + r * row_bytes`. For a gather, the source
// is a pool entry and the destination is that entry's block of the pack buffer
// (reference 4.4: `pack + n * sum_{k<e} row_k`); for a scatter it is the other
// way round. Spans come from the plan (`layout::Run`, host-split to bounded
// length). The copy is bytes: no dtype conversion, any row size.
//
// Work split: one warp copies one (entry, span) pair. A span whose source and
// destination agree modulo 16 is copied with 16-byte vectors (unrolled 4x so
// each lane keeps up to 4 loads in flight), with byte head/tail; otherwise
// bytewise.
// Grid: x strides over spans (8 warps per block), y over entries; both loops
// are grid-stride, so any grid is correct.
//
// The kernels use no shared memory, barriers or warp intrinsics, so
// cuda/host_harness.h can run this very file on the CPU by looping over the
// grid, and compare it byte for byte with the Rust CPU relayout. The file
// needs no headers (NVRTC has no libc).

typedef unsigned long long pdx_u64;
typedef unsigned int pdx_u32;
typedef unsigned char pdx_u8;

// One entry (layer) of a launch; `src`/`dst` are device addresses of row 0.
// Matches `relayout::CopyEntry` (32 bytes).
struct PdxCopyEntry {
    pdx_u64 src;
    pdx_u64 dst;
    pdx_u64 row_bytes;
    pdx_u64 reserved;
};

// `rows` rows from `src_row` to `dst_row`. Matches `layout::Run` (24 bytes).
struct PdxSpan {
    pdx_u64 src_row;
    pdx_u64 dst_row;
    pdx_u64 rows;
};

#define PDX_THREADS_PER_BLOCK 256
#define PDX_WARP 32
// 16-byte loads each lane keeps in flight.
#define PDX_UNROLL_N 4
#ifndef PDX_UNROLL
#define PDX_UNROLL _Pragma("unroll")
#endif

// One warp copies `n` bytes from `src` to `dst`; `lane` is 0..31.
__device__ __forceinline__ void pdx_warp_copy(const pdx_u8* __restrict__ src,
                                              pdx_u8* __restrict__ dst, pdx_u64 n,
                                              pdx_u32 lane) {
    if ((((pdx_u64)src ^ (pdx_u64)dst) & 15) == 0) {
        // Same alignment: bytes up to the first 16-byte boundary, then vectors.
        pdx_u64 head = (16 - ((pdx_u64)src & 15)) & 15;
        if (head > n) head = n;
        if (lane < head) dst[lane] = src[lane];
        const pdx_u64 n4 = (n - head) >> 4;
        // Each lane issues up to PDX_UNROLL_N loads before its first store, so
        // a warp keeps a whole 2 KiB stretch (e.g. a 1152-byte MLA row) in
        // flight. __ldg/__stwb name the global space (ld.global.nc.v4 /
        // st.global.wb.v4, not generic ld/st); integer addresses keep the
        // kernel at 63 registers, i.e. 4 blocks of 256 threads per SM.
        const pdx_u64 lane_step = 16 * PDX_WARP;
        const pdx_u64 end = (pdx_u64)(src + head) + (n4 << 4);
        pdx_u64 sa = (pdx_u64)(src + head) + 16 * lane;
        pdx_u64 da = (pdx_u64)(dst + head) + 16 * lane;
        for (; sa < end; sa += PDX_UNROLL_N * lane_step, da += PDX_UNROLL_N * lane_step) {
            const pdx_u64 left = end - sa;
            uint4 v[PDX_UNROLL_N];
            PDX_UNROLL
            for (int k = 0; k < PDX_UNROLL_N; ++k) {
                if (k * lane_step < left) v[k] = __ldg((const uint4*)(sa + k * lane_step));
            }
            PDX_UNROLL
            for (int k = 0; k < PDX_UNROLL_N; ++k) {
                if (k * lane_step < left) __stwb((uint4*)(da + k * lane_step), v[k]);
            }
        }
        const pdx_u64 done = head + (n4 << 4);
        const pdx_u64 tail = n - done;
        if (lane < tail) dst[done + lane] = src[done + lane];
    } else {
        for (pdx_u64 i = lane; i < n; i += PDX_WARP) dst[i] = src[i];
    }
}

__device__ __forceinline__ void pdx_copy_spans(const PdxCopyEntry* __restrict__ entries,
                                               pdx_u32 num_entries,
                                               const PdxSpan* __restrict__ spans,
                                               pdx_u64 num_spans) {
    const pdx_u32 lane = threadIdx.x % PDX_WARP;
    const pdx_u64 warps_per_block = blockDim.x / PDX_WARP;
    const pdx_u64 warp = (pdx_u64)blockIdx.x * warps_per_block + threadIdx.x / PDX_WARP;
    const pdx_u64 num_warps = (pdx_u64)gridDim.x * warps_per_block;
    for (pdx_u32 e = blockIdx.y; e < num_entries; e += gridDim.y) {
        const PdxCopyEntry ent = entries[e];
        for (pdx_u64 s = warp; s < num_spans; s += num_warps) {
            const PdxSpan sp = spans[s];
            pdx_warp_copy((const pdx_u8*)(ent.src + sp.src_row * ent.row_bytes),
                          (pdx_u8*)(ent.dst + sp.dst_row * ent.row_bytes),
                          sp.rows * ent.row_bytes, lane);
        }
    }
}

// Gather: entries[e].src is pool entry e (row = pool token row), entries[e].dst
// is the pack block of entry e (row = packed index).
extern "C" __global__ void __launch_bounds__(PDX_THREADS_PER_BLOCK)
    pdx_gather(const PdxCopyEntry* __restrict__ entries, pdx_u32 num_entries,
               const PdxSpan* __restrict__ spans, pdx_u64 num_spans) {
    pdx_copy_spans(entries, num_entries, spans, num_spans);
}

// Scatter: entries[e].src is the pack block of entry e (row = packed index),
// entries[e].dst is pool entry e (row = pool token row).
extern "C" __global__ void __launch_bounds__(PDX_THREADS_PER_BLOCK)
    pdx_scatter(const PdxCopyEntry* __restrict__ entries, pdx_u32 num_entries,
                const PdxSpan* __restrict__ spans, pdx_u64 num_spans) {
    pdx_copy_spans(entries, num_entries, spans, num_spans);
}

// Spins one thread for `ns` nanoseconds of the global timer: the compute of
// one layer in the layer-wise benchmark (a synthetic prefill launches a
// gather that writes the layer's rows, then this, on its model stream). The
// host harness runs it as nothing (the fake driver sleeps instead).
extern "C" __global__ void pdx_spin(pdx_u64 ns) {
#ifndef PDX_HOST_HARNESS
    pdx_u64 t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < ns);
#else
    (void)ns;
#endif
}
