// A stand-in libcuda.so for machines without a GPU: the CUDA driver calls that
// pdxfer makes, implemented on the CPU, with kernel launches run by the host
// harness (the very same cuda/relayout.cu source). "Device" memory is host
// memory. tests/gpu/fake_driver.rs builds it with g++ as libcuda.so and runs the
// device code paths in child processes whose LD_LIBRARY_PATH finds it.
//
// What it models (the part a missing wait or a wrong assumption breaks):
// - Stream order without progress: every operation enqueued on a stream
//   (host-to-device, device-to-host into pinned memory, device-to-device,
//   memset, kernel launch, event record) runs only when something waits for
//   it: cuStreamSynchronize, cuEventSynchronize of an event recorded after it,
//   cuEventQuery of such an event (which first answers CUDA_ERROR_NOT_READY
//   and lets the work run, so the next query sees it complete), a stream that
//   waits on such an event and is itself waited, cuCtxSynchronize, or a free
//   (the driver synchronises). Host bytes of a pageable host-to-device copy
//   are staged at the call; a pinned source or destination is read or
//   written when the copy runs, as DMA does; a device-to-host copy into
//   pageable memory blocks until the stream's earlier work ran (as the
//   driver does). Calls on the null stream run at once.
// - Steps that wait (pdx_fake_enqueue_step, used by the fake libnccl): an
//   NCCL op stays at the head of its stream until its peer posts the match;
//   queries answer not-ready, synchronisation blocks as on a GPU, and
//   cuMemFree of memory such a pending op uses stops the process.
// - Faults inside enqueued work (a kernel row outside device memory) surface
//   at the next synchronisation as a sticky CUDA_ERROR_ILLEGAL_ADDRESS.
// - Driver version (PDXFER_FAKE_CUDA_DRIVER_VERSION, default 12080, or
//   pdx_fake_set_driver_version): PTX whose `.version` needs a newer driver
//   is refused with CUDA_ERROR_UNSUPPORTED_PTX_VERSION (ISA 9.x is CUDA 13.x,
//   8.x is 12.x, 7.x is 11.x); a cubin in the CUDA 13 ELF format (OS/ABI
//   0x41) on a 12.x driver, or whose toolkit note names a newer major than
//   the driver's, is refused with CUDA_ERROR_NO_BINARY_FOR_GPU.
// - VMM mappings (PDXFER_FAKE_CUDA_VMM_CHUNK bytes, or
//   pdx_fake_set_vmm_chunk): allocations made while it is set are one VA
//   range backed by chunks of that size, and CU_POINTER_ATTRIBUTE_RANGE_*
//   and cuMemGetAddressRange answer the chunk holding the address only.
// - The VMM API itself: cuMemCreate (a pinned device allocation of the
//   location's device; allocFlags.gpuDirectRDMACapable recorded),
//   cuMemAddressReserve, cuMemMap (a handle's whole size at offset 0),
//   cuMemSetAccess, cuMemUnmap, cuMemRelease, cuMemAddressFree; each mapping
//   is one range (a copy or kernel row may not cross two) and cuMemFree of
//   one is CUDA_ERROR_INVALID_VALUE, as on a GPU.
// - CU_POINTER_ATTRIBUTE_IS_GPU_DIRECT_RDMA_CAPABLE: 1 for cuMemAlloc
//   memory; for a cuMemCreate mapping its gpuDirectRDMACapable flag; for the
//   chunked allocations above, the flag set by pdx_fake_set_vmm_gdr
//   (PDXFER_FAKE_CUDA_VMM_GDR, default 1) when they were made.
// - GPUDirect RDMA attributes: writes ordering (PDXFER_FAKE_CUDA_RDMA_ORDERING
//   0/100/200, default 100 = owner; pdx_fake_set_rdma_ordering), flush
//   options (PDXFER_FAKE_CUDA_RDMA_FLUSH_OPTIONS, default 1 = host flush
//   supported; pdx_fake_set_rdma_flush_options), dma-buf support
//   (PDXFER_FAKE_CUDA_DMA_BUF, default 1); cuFlushGPUDirectRDMAWrites counts
//   its calls (pdx_fake_rdma_flushes) and fails with CUDA_ERROR_NOT_SUPPORTED
//   where the flush options lack the host flush.
// - pdx_fake_device_frees counts the cuMemFree calls that freed memory.
// - One device (ordinal 0; any other is CUDA_ERROR_INVALID_DEVICE) of compute
//   capability 9.0 and 80 GiB, whose free memory (cuMemGetInfo) is what its
//   allocations leave; device attributes other than those above read 0.
//   PDXFER_FAKE_CUDA_DEVICES=N (at most 8) makes N such devices, ordinals
//   0..N-1, PCI bus ids 0000:c1:00.0, 0000:c2:00.0, ...; each has its own
//   primary context, an allocation remembers the device of the context it
//   was made in (CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, cuCtxGetDevice), and
//   they share one memory, one free count and one stream table.
// It refuses what a real driver would where it is cheap to check: launches of
// functions it did not hand out, unknown streams/events, copies touching
// memory it did not allocate, tables outside device memory, a wrong kernel
// block size, allocation or flush without a current context, and freeing
// pinned host memory it did not hand out. cuPointerGetAttribute answers for
// its own allocations (device or pinned host) and refuses any other address,
// as the driver does for pageable memory.
//
// What this fake does not model:
// - concurrency: enqueued work runs on the thread that waits for it, one
//   operation at a time, never in parallel with the host or other streams;
//   so races between streams that a real GPU shows as torn data cannot show
//   here, only missing waits (work that has not run at all);
// - separate memories of several devices, peer access, unified or managed memory, memory
//   pools, graphs, cuMemGetHandleForAddressRange (dma-buf export: only the
//   attribute that says it is supported is answered) and nvidia-peermem;
//   a real PCI address (cuDeviceGetPCIBusId answers "0000:c1:00.0" for
//   device 0, which no sysfs tree of the tests names, so the RDMA NIC
//   choice sees a GPU of unknown locality); the exact error code a real
//   driver gives a too-new cubin;
// - that a kernel image holds the functions asked for, or its architecture
//   (any image of a supported version yields pdx_gather, pdx_scatter and
//   pdx_spin, whose spin is a sleep of the thread that runs the work);
// - occupancy, registers, timing (event times are host clock readings when
//   the record runs) and the legacy default stream's implicit synchronisation
//   (calls on the null stream just run);
// - contexts beyond "one primary context is current or not": streams, events
//   and launches work without a current context.
#include "host_harness.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef void* CUcontext;
typedef void* CUstream;
typedef void* CUevent;
typedef void* CUmodule;
typedef void* CUfunction;

enum {
    OK = 0,
    ERR_INVALID_VALUE = 1,
    ERR_OOM = 2,
    ERR_NOT_INIT = 3,
    ERR_INVALID_DEVICE = 101,
    ERR_INVALID_IMAGE = 200,
    ERR_INVALID_CONTEXT = 201,
    ERR_NO_BINARY_FOR_GPU = 209,
    ERR_UNSUPPORTED_PTX_VERSION = 222,
    ERR_INVALID_HANDLE = 400,
    ERR_NOT_FOUND = 500,
    ERR_NOT_READY = 600,
    ERR_ILLEGAL_ADDRESS = 700,
    ERR_LAUNCH_FAILED = 719,
    ERR_NOT_SUPPORTED = 801,
};

static const int MAX_DEVICES = 8;
static int g_ctx_tokens[MAX_DEVICES];  // device d's primary context is &g_ctx_tokens[d]
static int g_devices = 1;
static int g_gather_token;
static int g_scatter_token;
static int g_spin_token;
static int g_module_token;
static thread_local CUcontext g_current = nullptr;
static std::mutex g_mu;                 // guards every table below
static std::recursive_mutex g_exec;     // one executor of enqueued work at a time
static std::map<CUdeviceptr, size_t> g_allocs;       // device base -> size
static std::map<CUdeviceptr, size_t> g_vmm;          // device base -> chunk size (VMM)
static std::map<CUdeviceptr, size_t> g_host_allocs;  // pinned host base -> size
static std::map<CUdeviceptr, int> g_alloc_device;    // device base -> its context's device
static std::map<CUdeviceptr, int> g_alloc_gdr;       // device base -> 0 where not GPUDirect capable
static std::map<CUdeviceptr, size_t> g_reserved;     // VMM VA reservation base -> size
static std::map<CUdeviceptr, size_t> g_mapped;       // cuMemMap base -> size (also in g_allocs)
static int g_vmm_gdr = 1;  // gpuDirectRDMACapable of later chunked allocations
static bool g_inited = false;
static int g_driver_version = 12080;
static size_t g_vmm_chunk = 0;
static int g_rdma_ordering = 100;
static int g_rdma_flush_options = 1;  // CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST
static int g_dma_buf = 1;
static CUresult g_sticky = OK;                // a fault of enqueued work
static unsigned long long g_pinned_dtoh = 0;  // async DtoH copies into pinned memory
static unsigned long long g_launches = 0;     // kernel launches enqueued
static unsigned long long g_htod_landed = 0;  // stream-ordered HtoD copies applied
static unsigned long long g_pinned_htod = 0;  // stream-ordered HtoD copies from pinned memory
static unsigned long long g_not_ready = 0;    // cuEventQuery answers of NOT_READY
static unsigned long long g_rdma_flushes = 0; // cuFlushGPUDirectRDMAWrites calls
static unsigned long long g_device_frees = 0; // cuMemFree calls that freed

// A stream: work not yet run, in order; `done` of `enq` operations have run.
struct Stream {
    std::deque<std::function<bool()>> q;
    unsigned long long enq = 0, done = 0;
};
static std::map<void*, Stream> g_streams;
// An event: complete once its stream has run `seq` operations.
struct Event {
    CUstream stream = nullptr;
    unsigned long long seq = 0;
    double t = 0.0;
};
static std::map<void*, Event> g_events;

static double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

static void fault(CUresult rc) {
    std::lock_guard<std::mutex> l(g_mu);
    if (g_sticky == OK) g_sticky = rc;
}

static CUresult sticky() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_sticky;
}

// The allocation holding `p` in `m`: its base and size, or false (caller locks).
static bool find_alloc(const std::map<CUdeviceptr, size_t>& m, CUdeviceptr p, CUdeviceptr* base,
                       size_t* size) {
    auto it = m.upper_bound(p);
    if (it == m.begin()) return false;
    --it;
    if (p >= it->first + it->second) return false;
    *base = it->first;
    *size = it->second;
    return true;
}

// True when [p, p + n) lies inside one device allocation.
static bool owned(CUdeviceptr p, size_t n) {
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr base;
    size_t size;
    return find_alloc(g_allocs, p, &base, &size) && p + n <= base + size;
}

// True when `p` is pinned host memory of this driver holding `n` bytes; sets
// `bad` when it starts in pinned memory but runs past it.
static bool pinned(const void* p, size_t n, bool* bad) {
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr base;
    size_t size;
    *bad = false;
    if (!find_alloc(g_host_allocs, (CUdeviceptr)p, &base, &size)) return false;
    *bad = (CUdeviceptr)p + n > base + size;
    return true;
}

static bool stream_ok(CUstream s) {
    std::lock_guard<std::mutex> l(g_mu);
    return s == nullptr || g_streams.count(s) > 0;
}

// Appends `op` to stream `s` (which must exist and not be null).
static void enqueue_step(CUstream s, std::function<bool()> op) {
    std::lock_guard<std::mutex> l(g_mu);
    Stream& st = g_streams[s];
    st.q.push_back(std::move(op));
    st.enq++;
}
static void enqueue(CUstream s, std::function<void()> op) {
    enqueue_step(s, [op] {
        op();
        return true;
    });
}

// Runs the work of stream `s` until it has run `seq` operations (all of it
// when `seq` is ~0). Work may wait on other streams (cuStreamWaitEvent). A
// step that cannot finish yet (an NCCL op whose peer has not posted) stays at
// the head of the queue: false is returned, and a later drain retries it.
static bool drain(CUstream s, unsigned long long seq = ~0ull) {
    if (s == nullptr) return true;
    std::lock_guard<std::recursive_mutex> ex(g_exec);
    for (;;) {
        std::function<bool()> op;
        {
            std::lock_guard<std::mutex> l(g_mu);
            auto it = g_streams.find(s);
            if (it == g_streams.end() || it->second.done >= seq || it->second.q.empty())
                return true;
            op = std::move(it->second.q.front());
            it->second.q.pop_front();
        }
        bool finished = op();
        std::lock_guard<std::mutex> l(g_mu);
        auto it = g_streams.find(s);
        if (it == g_streams.end()) return true;
        if (!finished) {
            it->second.q.push_front(std::move(op));
            return false;
        }
        it->second.done++;
    }
}

// Blocks until the work is done, as the driver does (forever, when an
// enqueued NCCL op never finds its peer: a real GPU spins the same way).
static void drain_wait(CUstream s, unsigned long long seq = ~0ull) {
    while (!drain(s, seq)) std::this_thread::sleep_for(std::chrono::microseconds(200));
}

// Runs what can run on every stream (without waiting for blocked steps).
static void drain_all() {
    std::vector<void*> all;
    {
        std::lock_guard<std::mutex> l(g_mu);
        for (auto& kv : g_streams) all.push_back(kv.first);
    }
    for (void* s : all) drain(s);
}

// Device ranges that enqueued steps (NCCL ops) still read or write.
struct StepRange {
    unsigned long long id, ptr, len;
};
static std::vector<StepRange> g_step_ranges;
static unsigned long long g_step_ids = 0;

// Freeing memory an enqueued step still uses is the bug a real GPU shows as
// corruption or a fault: here it stops the process with a message.
static void refuse_free_in_use(unsigned long long p, const char* what) {
    std::lock_guard<std::mutex> l(g_mu);
    for (auto& r : g_step_ranges) {
        if (p >= r.ptr && p < r.ptr + (r.len ? r.len : 1)) {
            fprintf(stderr,
                    "fake libcuda: %s(0x%llx) while an enqueued NCCL op still uses "
                    "[0x%llx, +%llu)\n",
                    what, p, r.ptr, r.len);
            abort();
        }
    }
}

// The stream and position of event `e`; false for an unknown event.
static bool event_pos(CUevent e, CUstream* s, unsigned long long* seq) {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_events.find(e);
    if (it == g_events.end()) return false;
    *s = it->second.stream;
    *seq = it->second.seq;
    return true;
}

static bool event_done(CUstream s, unsigned long long seq) {
    if (s == nullptr) return true;
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_streams.find(s);
    return it == g_streams.end() || it->second.done >= seq;
}

static long env_or(const char* name, long dflt) {
    const char* v = getenv(name);
    return v && *v ? strtol(v, nullptr, 0) : dflt;
}

// The device whose primary context `c` is, or -1.
static int ctx_device(CUcontext c) {
    for (int d = 0; d < MAX_DEVICES; d++)
        if (c == &g_ctx_tokens[d]) return d < g_devices ? d : -1;
    return -1;
}

static bool device_ok(CUdevice d) { return d >= 0 && d < g_devices; }

extern "C" {

CUresult cuInit(unsigned int) {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_inited) {
        g_driver_version = (int)env_or("PDXFER_FAKE_CUDA_DRIVER_VERSION", g_driver_version);
        g_vmm_chunk = (size_t)env_or("PDXFER_FAKE_CUDA_VMM_CHUNK", (long)g_vmm_chunk);
        g_rdma_ordering = (int)env_or("PDXFER_FAKE_CUDA_RDMA_ORDERING", g_rdma_ordering);
        g_rdma_flush_options =
            (int)env_or("PDXFER_FAKE_CUDA_RDMA_FLUSH_OPTIONS", g_rdma_flush_options);
        g_dma_buf = (int)env_or("PDXFER_FAKE_CUDA_DMA_BUF", g_dma_buf);
        g_vmm_gdr = (int)env_or("PDXFER_FAKE_CUDA_VMM_GDR", g_vmm_gdr);
        long n = env_or("PDXFER_FAKE_CUDA_DEVICES", 1);
        g_devices = n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : (int)n;
    }
    g_inited = true;
    return OK;
}
CUresult cuDriverGetVersion(int* v) {
    std::lock_guard<std::mutex> l(g_mu);
    *v = g_driver_version;
    return OK;
}
CUresult cuDeviceGetCount(int* n) {
    if (!g_inited) return ERR_NOT_INIT;
    *n = g_devices;
    return OK;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (!g_inited) return ERR_NOT_INIT;
    if (!device_ok(ordinal)) return ERR_INVALID_DEVICE;
    *d = ordinal;
    return OK;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    snprintf(name, (size_t)len, "pdxfer fake CUDA device (CPU)");
    return OK;
}
CUresult cuDeviceGetPCIBusId(char* id, int len, CUdevice d) {
    if (!g_inited) return ERR_NOT_INIT;
    if (!device_ok(d)) return ERR_INVALID_DEVICE;
    if (len < 13) return ERR_INVALID_VALUE;
    snprintf(id, (size_t)len, "0000:%02x:00.0", 0xc1 + d);
    return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    if (!device_ok(d)) return ERR_INVALID_DEVICE;
    std::lock_guard<std::mutex> l(g_mu);
    switch (attr) {
        case 75: *v = 9; break;                 // compute capability major
        case 76: *v = 0; break;                 // minor
        case 116: *v = 1; break;                // GPUDirect RDMA supported
        case 117: *v = g_rdma_flush_options; break;  // flush options (1: host flush)
        case 118: *v = g_rdma_ordering; break;  // GPUDirect RDMA writes ordering
        case 124: *v = g_dma_buf; break;        // dma-buf supported
        case 102: *v = 1; break;                // virtual memory management supported
        case 110: *v = 1; break;                // GPUDirect RDMA with CUDA VMM supported
        default: *v = 0; break;                 // no memory pools, nothing else
    }
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    if (!device_ok(d)) return ERR_INVALID_DEVICE;
    *c = &g_ctx_tokens[d];
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = g_current;
    return OK;
}
CUresult cuCtxSetCurrent(CUcontext c) {
    if (c != nullptr && ctx_device(c) < 0) return ERR_INVALID_HANDLE;
    g_current = c;
    return OK;
}
CUresult cuCtxGetDevice(CUdevice* d) {
    int dev = ctx_device(g_current);
    if (dev < 0) return ERR_INVALID_CONTEXT;
    *d = dev;
    return OK;
}
CUresult cuCtxSynchronize() {
    {
        std::vector<void*> all;
        {
            std::lock_guard<std::mutex> l(g_mu);
            for (auto& kv : g_streams) all.push_back(kv.first);
        }
        for (void* s : all) drain_wait(s);
    }
    return sticky();
}

CUresult cuStreamCreate(CUstream* s, unsigned int) {
    std::lock_guard<std::mutex> l(g_mu);
    *s = malloc(1);
    g_streams[*s];
    return OK;
}
CUresult cuStreamDestroy_v2(CUstream s) {
    if (!stream_ok(s) || s == nullptr) return ERR_INVALID_HANDLE;
    drain(s);  // its work that can run completes; a step still blocked is dropped
    std::lock_guard<std::mutex> l(g_mu);
    g_streams.erase(s);
    for (auto& kv : g_events)
        if (kv.second.stream == s) kv.second.stream = nullptr;
    free(s);
    return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
    if (!stream_ok(s)) return ERR_INVALID_HANDLE;
    drain_wait(s);
    return sticky();
}
CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int) {
    if (!stream_ok(s)) return ERR_INVALID_HANDLE;
    CUstream es;
    unsigned long long seq;
    if (!event_pos(e, &es, &seq)) return ERR_INVALID_HANDLE;
    if (s == nullptr) {
        drain_wait(es, seq);
        return OK;
    }
    // later work on `s` runs after the event's work (run when `s` is waited)
    enqueue_step(s, [es, seq] { return drain(es, seq); });
    return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    int dev = ctx_device(g_current);
    if (dev < 0) return ERR_INVALID_CONTEXT;  // no context bound
    void* m = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!m) return ERR_OOM;
    std::lock_guard<std::mutex> l(g_mu);
    *p = (CUdeviceptr)m;
    g_allocs[*p] = n;
    g_alloc_device[*p] = dev;
    if (g_vmm_chunk > 0 && n > g_vmm_chunk) {
        g_vmm[*p] = g_vmm_chunk;
        if (!g_vmm_gdr) g_alloc_gdr[*p] = 0;
    }
    return OK;
}
// A 80 GiB device: free is what the allocations made here leave.
CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> l(g_mu);
    size_t used = 0;
    for (auto& kv : g_allocs) used += kv.second;
    *total = (size_t)80 << 30;
    *free_bytes = *total > used ? *total - used : 0;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    drain_all();  // the driver synchronises before freeing
    refuse_free_in_use(p, "cuMemFree");
    std::lock_guard<std::mutex> l(g_mu);
    if (g_mapped.count(p)) return ERR_INVALID_VALUE;  // a cuMemMap mapping: cuMemUnmap it
    if (!g_allocs.erase(p)) return ERR_INVALID_VALUE;
    ++g_device_frees;
    g_vmm.erase(p);
    g_alloc_device.erase(p);
    g_alloc_gdr.erase(p);
    free((void*)p);
    return OK;
}
CUresult cuMemHostAlloc(void** p, size_t n, unsigned int) {
    if (ctx_device(g_current) < 0) return ERR_INVALID_CONTEXT;  // no context bound
    void* m = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!m) return ERR_OOM;
    std::lock_guard<std::mutex> l(g_mu);
    *p = m;
    g_host_allocs[(CUdeviceptr)m] = n;
    return OK;
}
CUresult cuMemFreeHost(void* p) {
    drain_all();  // the driver synchronises before freeing
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_host_allocs.erase((CUdeviceptr)p)) return ERR_INVALID_VALUE;
    free(p);
    return OK;
}
// The mapped range holding device address `p`: its allocation, or with VMM
// the chunk of it (caller locks).
static bool mapped_range(CUdeviceptr p, CUdeviceptr* base, size_t* size) {
    if (!find_alloc(g_allocs, p, base, size)) return false;
    auto v = g_vmm.find(*base);
    if (v != g_vmm.end()) {
        size_t chunk = v->second;
        CUdeviceptr end = *base + *size;
        *base += (p - *base) / chunk * chunk;
        *size = end - *base < chunk ? end - *base : chunk;
    }
    return true;
}
// Attributes: 2 memory type (1 host, 2 device), 9 device ordinal, 11 range
// start, 12 range size.
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
    if (!g_inited) return ERR_NOT_INIT;
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr base = 0;
    size_t size = 0;
    bool device = mapped_range(p, &base, &size);
    if (!device && !find_alloc(g_host_allocs, p, &base, &size)) return ERR_INVALID_VALUE;
    switch (attr) {
        case 2: *(unsigned int*)data = device ? 2 : 1; break;
        case 9: {
            CUdeviceptr ab = 0;
            size_t as = 0;
            int dev = 0;
            if (device && find_alloc(g_allocs, p, &ab, &as)) {
                auto d = g_alloc_device.find(ab);
                if (d != g_alloc_device.end()) dev = d->second;
            }
            *(int*)data = dev;
            break;
        }
        case 11: *(CUdeviceptr*)data = base; break;
        case 12: *(size_t*)data = size; break;
        case 15: {  // IS_GPU_DIRECT_RDMA_CAPABLE
            CUdeviceptr ab = 0;
            size_t as = 0;
            int gdr = device ? 1 : 0;
            if (device && find_alloc(g_allocs, p, &ab, &as)) {
                auto g = g_alloc_gdr.find(ab);
                if (g != g_alloc_gdr.end()) gdr = g->second;
            }
            *(int*)data = gdr;
            break;
        }
        default: return ERR_INVALID_VALUE;
    }
    return OK;
}
// The VMM API (CUmemAllocationProp read at its C offsets: type 0, location
// type 8 and id 12, allocFlags.gpuDirectRDMACapable 25).
struct VmmHandle {
    size_t size;
    int device;
    int gdr;
};
CUresult cuMemCreate(unsigned long long* handle, size_t size, const unsigned char* prop,
                     unsigned long long flags) {
    if (!g_inited) return ERR_NOT_INIT;
    if (handle == nullptr || prop == nullptr || size == 0 || flags != 0) return ERR_INVALID_VALUE;
    int type, loc_type, loc_id;
    memcpy(&type, prop, 4);
    memcpy(&loc_type, prop + 8, 4);
    memcpy(&loc_id, prop + 12, 4);
    if (type != 1 || loc_type != 1) return ERR_INVALID_VALUE;  // pinned, on a device
    if (!device_ok(loc_id)) return ERR_INVALID_DEVICE;
    *handle = (unsigned long long)new VmmHandle{size, loc_id, prop[25] ? 1 : 0};
    return OK;
}
CUresult cuMemGetAllocationGranularity(size_t* g, const unsigned char* prop, int) {
    if (g == nullptr || prop == nullptr) return ERR_INVALID_VALUE;
    *g = (size_t)2 << 20;
    return OK;
}
CUresult cuMemRelease(unsigned long long handle) {
    if (handle == 0) return ERR_INVALID_VALUE;
    delete (VmmHandle*)handle;
    return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr* ptr, size_t size, size_t align, CUdeviceptr addr,
                             unsigned long long) {
    if (ptr == nullptr || size == 0 || addr != 0) return ERR_INVALID_VALUE;
    size_t a = align > 4096 ? align : 4096;
    void* m = aligned_alloc(a, (size + a - 1) / a * a);
    if (!m) return ERR_OOM;
    std::lock_guard<std::mutex> l(g_mu);
    *ptr = (CUdeviceptr)m;
    g_reserved[*ptr] = size;
    return OK;
}
CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    std::lock_guard<std::mutex> l(g_mu);
    auto r = g_reserved.find(ptr);
    if (r == g_reserved.end() || r->second != size) return ERR_INVALID_VALUE;
    for (auto& m : g_mapped)
        if (m.first >= ptr && m.first < ptr + size) return ERR_INVALID_VALUE;  // still mapped
    g_reserved.erase(r);
    free((void*)ptr);
    return OK;
}
CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, unsigned long long handle,
                  unsigned long long flags) {
    auto* h = (VmmHandle*)handle;
    if (h == nullptr || offset != 0 || size != h->size || flags != 0) return ERR_INVALID_VALUE;
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr base;
    size_t rsize;
    if (!find_alloc(g_reserved, ptr, &base, &rsize) || ptr + size > base + rsize)
        return ERR_INVALID_VALUE;
    CUdeviceptr ab;
    size_t as;
    if (find_alloc(g_allocs, ptr, &ab, &as) || find_alloc(g_allocs, ptr + size - 1, &ab, &as))
        return ERR_INVALID_VALUE;  // already mapped
    g_allocs[ptr] = size;
    g_mapped[ptr] = size;
    g_alloc_device[ptr] = h->device;
    g_alloc_gdr[ptr] = h->gdr;
    return OK;
}
CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const void* desc, size_t count) {
    if (desc == nullptr || count == 0) return ERR_INVALID_VALUE;
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr ab;
    size_t as;
    if (!find_alloc(g_allocs, ptr, &ab, &as) || ptr + size > ab + as) return ERR_INVALID_VALUE;
    return OK;
}
CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    drain_all();  // the driver synchronises
    refuse_free_in_use(ptr, "cuMemUnmap");
    std::lock_guard<std::mutex> l(g_mu);
    auto m = g_mapped.find(ptr);
    if (m == g_mapped.end() || m->second != size) return ERR_INVALID_VALUE;
    g_mapped.erase(m);
    g_allocs.erase(ptr);
    g_alloc_device.erase(ptr);
    g_alloc_gdr.erase(ptr);
    return OK;
}
CUresult cuMemGetAddressRange_v2(CUdeviceptr* pbase, size_t* psize, CUdeviceptr p) {
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr base = 0;
    size_t size = 0;
    if (!mapped_range(p, &base, &size)) return ERR_NOT_FOUND;
    if (pbase) *pbase = base;
    if (psize) *psize = size;
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, size_t n, CUstream s) {
    if (!stream_ok(s) || !owned(d, n)) return ERR_INVALID_VALUE;
    if (s == nullptr) {
        memcpy((void*)d, h, n);
        return OK;
    }
    bool bad;
    const unsigned char* b = (const unsigned char*)h;
    if (pinned(h, n, &bad)) {
        if (bad) return ERR_INVALID_VALUE;
        {
            std::lock_guard<std::mutex> l(g_mu);
            ++g_pinned_htod;
        }
        // read when the copy runs, as the DMA engine does
        enqueue(s, [d, b, n] {
            memcpy((void*)d, b, n);
            std::lock_guard<std::mutex> l(g_mu);
            ++g_htod_landed;
        });
    } else {
        auto staged = std::make_shared<std::vector<unsigned char>>(b, b + n);
        enqueue(s, [d, staged] {
            memcpy((void*)d, staged->data(), staged->size());
            std::lock_guard<std::mutex> l(g_mu);
            ++g_htod_landed;
        });
    }
    return OK;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, size_t n) {
    return cuMemcpyHtoDAsync_v2(d, h, n, nullptr);
}
CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, size_t n, CUstream s) {
    if (!stream_ok(s) || !owned(d, n)) return ERR_INVALID_VALUE;
    bool bad;
    if (s != nullptr && pinned(h, n, &bad)) {
        if (bad) return ERR_INVALID_VALUE;
        {
            std::lock_guard<std::mutex> l(g_mu);
            ++g_pinned_dtoh;
        }
        enqueue(s, [h, d, n] { memcpy(h, (const void*)d, n); });
        return OK;
    }
    // into pageable memory the copy is synchronous: after the stream's work
    drain_wait(s);
    memcpy(h, (const void*)d, n);
    return s == nullptr ? OK : sticky();
}
CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, size_t n) {
    return cuMemcpyDtoHAsync_v2(h, d, n, nullptr);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    if (!stream_ok(st) || !owned(d, n) || !owned(s, n)) return ERR_INVALID_VALUE;
    if (st == nullptr) {
        memmove((void*)d, (const void*)s, n);
        return OK;
    }
    enqueue(st, [d, s, n] { memmove((void*)d, (const void*)s, n); });
    return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    if (!stream_ok(s) || !owned(d, n)) return ERR_INVALID_VALUE;
    if (s == nullptr) {
        memset((void*)d, v, n);
        return OK;
    }
    enqueue(s, [d, v, n] { memset((void*)d, v, n); });
    return OK;
}

CUresult cuEventCreate(CUevent* e, unsigned int) {
    std::lock_guard<std::mutex> l(g_mu);
    *e = malloc(1);
    g_events[*e] = Event{};
    return OK;
}
CUresult cuEventDestroy_v2(CUevent e) {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_events.erase(e)) return ERR_INVALID_HANDLE;  // destroying waits for nothing
    free(e);
    return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    if (!stream_ok(s)) return ERR_INVALID_HANDLE;
    {
        std::lock_guard<std::mutex> l(g_mu);
        auto it = g_events.find(e);
        if (it == g_events.end()) return ERR_INVALID_HANDLE;
        if (s == nullptr) {
            it->second = Event{nullptr, 0, now_ms()};
            return OK;
        }
    }
    // the event completes when the work before it has run
    enqueue(s, [e] {
        std::lock_guard<std::mutex> l(g_mu);
        auto it = g_events.find(e);
        if (it != g_events.end()) it->second.t = now_ms();
    });
    std::lock_guard<std::mutex> l(g_mu);
    g_events[e] = Event{s, g_streams[s].enq, 0.0};
    return OK;
}
CUresult cuEventQuery(CUevent e) {
    CUstream s;
    unsigned long long seq;
    if (!event_pos(e, &s, &seq)) return ERR_INVALID_HANDLE;
    if (!event_done(s, seq)) {
        // not yet: the device makes progress, a later query sees it
        drain(s, seq);
        std::lock_guard<std::mutex> l(g_mu);
        ++g_not_ready;
        return ERR_NOT_READY;
    }
    return sticky();
}
CUresult cuEventSynchronize(CUevent e) {
    CUstream s;
    unsigned long long seq;
    if (!event_pos(e, &s, &seq)) return ERR_INVALID_HANDLE;
    drain_wait(s, seq);
    return sticky();
}
CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    std::lock_guard<std::mutex> l(g_mu);
    auto ia = g_events.find(a), ib = g_events.find(b);
    if (ia == g_events.end() || ib == g_events.end()) return ERR_INVALID_HANDLE;
    *ms = (float)(ib->second.t - ia->second.t);
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) {
    return cuEventElapsedTime(ms, a, b);
}

// The driver version a PTX image's `.version M.m` needs (ISA 9.x came with
// CUDA 13.x, 8.x with 12.x, 7.x with 11.x), or 0 when it names none.
static int ptx_needs(const char* text) {
    const char* v = strstr(text, ".version ");
    if (v == nullptr) return 0;
    int major = 0, minor = 0;
    if (sscanf(v + 9, "%d.%d", &major, &minor) != 2) return 0;
    return (major + 4) * 1000 + minor * 10;
}

// The CUDA major a cubin's toolkit was: 13 for the CUDA 13 ELF format (OS/ABI
// 0x41), else the major its `.note.nv.tkinfo` names ("release M.m"), else 12.
static int cubin_major(const unsigned char* img) {
    if (img[7] == 0x41) return 13;
    // e_shoff and section headers, to read the toolkit note when present
    unsigned long long shoff;
    unsigned short shentsize, shnum;
    memcpy(&shoff, img + 0x28, 8);
    memcpy(&shentsize, img + 0x3a, 2);
    memcpy(&shnum, img + 0x3c, 2);
    for (unsigned i = 0; i < shnum && shoff != 0; ++i) {
        const unsigned char* sh = img + shoff + (unsigned long long)i * shentsize;
        unsigned int type;
        unsigned long long off, size;
        memcpy(&type, sh + 4, 4);
        memcpy(&off, sh + 0x18, 8);
        memcpy(&size, sh + 0x20, 8);
        if (type != 7) continue;  // SHT_NOTE
        std::string note((const char*)img + off, size);
        size_t r = note.find("release ");
        if (r != std::string::npos) return atoi(note.c_str() + r + 8);
    }
    return 12;
}

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    if (image == nullptr) return ERR_INVALID_VALUE;
    const unsigned char* img = (const unsigned char*)image;
    int driver;
    {
        std::lock_guard<std::mutex> l(g_mu);
        driver = g_driver_version;
    }
    if (memcmp(img, "\x7f" "ELF", 4) == 0) {
        if (img[4] != 2) return ERR_INVALID_IMAGE;  // 64-bit ELF only
        if (cubin_major(img) > driver / 1000) return ERR_NO_BINARY_FOR_GPU;
    } else if (ptx_needs((const char*)image) > driver) {
        return ERR_UNSUPPORTED_PTX_VERSION;
    }
    *m = &g_module_token;
    return OK;
}
CUresult cuModuleUnload(CUmodule m) { return m == &g_module_token ? OK : ERR_INVALID_HANDLE; }
CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    if (m != &g_module_token) return ERR_INVALID_HANDLE;
    if (strcmp(name, "pdx_gather") == 0)
        *f = &g_gather_token;
    else if (strcmp(name, "pdx_scatter") == 0)
        *f = &g_scatter_token;
    else if (strcmp(name, "pdx_spin") == 0)
        *f = &g_spin_token;
    else
        return ERR_NOT_FOUND;
    return OK;
}

typedef void (*Kernel)(const PdxCopyEntry*, pdx_u32, const PdxSpan*, pdx_u64);

// Runs one launch: checks every row it touches lies in device memory (a
// fault otherwise, as an illegal address on the device), then the kernel.
static void run_launch(Kernel k, pdx_dim3 grid, pdx_dim3 block, const PdxCopyEntry* entries,
                       pdx_u32 ne, const PdxSpan* spans, pdx_u64 ns) {
    for (pdx_u32 e = 0; e < ne; ++e)
        for (pdx_u64 i = 0; i < ns; ++i) {
            const PdxCopyEntry& en = entries[e];
            const PdxSpan& sp = spans[i];
            size_t n = (size_t)(sp.rows * en.row_bytes);
            if (!owned(en.src + sp.src_row * en.row_bytes, n) ||
                !owned(en.dst + sp.dst_row * en.row_bytes, n)) {
                fault(ERR_ILLEGAL_ADDRESS);
                return;
            }
        }
    pdx_host_launch(k, grid, block, entries, ne, spans, ns);
}

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, CUstream s, void** params,
                        void** extra) {
    if (!stream_ok(s) || extra != nullptr || params == nullptr) return ERR_INVALID_VALUE;
    if (bx * by * bz > PDX_THREADS_PER_BLOCK || shmem != 0) return ERR_LAUNCH_FAILED;
    if (f == &g_spin_token) {
        // pdx_spin(ns): the stream is busy for `ns` when the work runs
        pdx_u64 ns = *(const pdx_u64*)params[0];
        {
            std::lock_guard<std::mutex> l(g_mu);
            ++g_launches;
        }
        auto spin = [ns] { std::this_thread::sleep_for(std::chrono::nanoseconds(ns)); };
        if (s == nullptr)
            spin();
        else
            enqueue(s, spin);
        return OK;
    }
    Kernel k;
    if (f == &g_gather_token)
        k = pdx_gather;
    else if (f == &g_scatter_token)
        k = pdx_scatter;
    else
        return ERR_INVALID_HANDLE;
    // the argument values are taken at the call, as the driver does
    const PdxCopyEntry* entries = (const PdxCopyEntry*)*(const pdx_u64*)params[0];
    pdx_u32 ne = *(const pdx_u32*)params[1];
    const PdxSpan* spans = (const PdxSpan*)*(const pdx_u64*)params[2];
    pdx_u64 ns = *(const pdx_u64*)params[3];
    if (!owned((CUdeviceptr)entries, sizeof(PdxCopyEntry) * ne) ||
        !owned((CUdeviceptr)spans, sizeof(PdxSpan) * ns))
        return ERR_INVALID_VALUE;  // tables must live in device memory
    {
        std::lock_guard<std::mutex> l(g_mu);
        ++g_launches;
    }
    pdx_dim3 grid{gx, gy, gz}, block{bx, by, bz};
    if (s == nullptr) {
        run_launch(k, grid, block, entries, ne, spans, ns);
        return OK;
    }
    enqueue(s, [=] { run_launch(k, grid, block, entries, ne, spans, ns); });
    return OK;
}

CUresult cuFlushGPUDirectRDMAWrites(int target, int scope) {
    if (ctx_device(g_current) < 0) return ERR_INVALID_CONTEXT;
    if (target != 0 || (scope != 100 && scope != 200)) return ERR_INVALID_VALUE;
    std::lock_guard<std::mutex> l(g_mu);
    if (!(g_rdma_flush_options & 1)) return ERR_NOT_SUPPORTED;
    ++g_rdma_flushes;
    return OK;
}

// Not driver calls: counters and knobs for the tests.

// Stream-ordered device-to-host copies into pinned host memory enqueued
// (tests check that the engine's copies are asynchronous).
unsigned long long pdx_fake_pinned_dtoh_copies() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_pinned_dtoh;
}
// Stream-ordered host-to-device copies that ran (tests check that received
// bytes went through waited-on device copies).
unsigned long long pdx_fake_htod_copies() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_htod_landed;
}
// Stream-ordered host-to-device copies from pinned memory enqueued.
unsigned long long pdx_fake_pinned_htod_copies() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_pinned_htod;
}
// Kernel launches enqueued so far (tests check what was enqueued when).
unsigned long long pdx_fake_launches() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_launches;
}
// cuEventQuery answers of CUDA_ERROR_NOT_READY so far.
unsigned long long pdx_fake_not_ready_queries() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_not_ready;
}
// cuFlushGPUDirectRDMAWrites calls so far.
unsigned long long pdx_fake_rdma_flushes() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_rdma_flushes;
}
// Operations enqueued on streams that have not run yet.
unsigned long long pdx_fake_pending_ops() {
    std::lock_guard<std::mutex> l(g_mu);
    unsigned long long n = 0;
    for (auto& kv : g_streams) n += kv.second.q.size();
    return n;
}
// Enqueues a step on `s` (the fake libnccl's ops): `step(arg)` runs when the
// stream reaches it and is retried until it returns nonzero; `ranges` holds
// `n` (device pointer, length) pairs it uses, which cuMemFree refuses while
// the step is pending. A null stream runs it to completion now.
int pdx_fake_enqueue_step(CUstream s, int (*step)(void*), void* arg,
                          const unsigned long long* ranges, int n) {
    if (!stream_ok(s)) return ERR_INVALID_HANDLE;
    unsigned long long id;
    {
        std::lock_guard<std::mutex> l(g_mu);
        id = ++g_step_ids;
        for (int i = 0; i < n; i++) g_step_ranges.push_back({id, ranges[2 * i], ranges[2 * i + 1]});
    }
    auto run = [step, arg, id] {
        if (step(arg) == 0) return false;
        std::lock_guard<std::mutex> l(g_mu);
        std::vector<StepRange> keep;
        for (auto& r : g_step_ranges)
            if (r.id != id) keep.push_back(r);
        g_step_ranges.swap(keep);
        return true;
    };
    if (s == nullptr) {
        while (!run()) std::this_thread::sleep_for(std::chrono::microseconds(200));
        return OK;
    }
    enqueue_step(s, run);
    return OK;
}
void pdx_fake_set_driver_version(int v) {
    std::lock_guard<std::mutex> l(g_mu);
    g_driver_version = v;
}
// Later allocations larger than `chunk` bytes are VMM-style mappings of
// `chunk`-byte pieces (0: one range per allocation).
void pdx_fake_set_vmm_chunk(unsigned long long chunk) {
    std::lock_guard<std::mutex> l(g_mu);
    g_vmm_chunk = (size_t)chunk;
}
// cuMemFree calls that freed device memory (each synchronises the device).
unsigned long long pdx_fake_device_frees() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_device_frees;
}
// gpuDirectRDMACapable of later chunked (VMM-style) allocations (0 or 1).
void pdx_fake_set_vmm_gdr(int v) {
    std::lock_guard<std::mutex> l(g_mu);
    g_vmm_gdr = v;
}
void pdx_fake_set_rdma_ordering(int v) {
    std::lock_guard<std::mutex> l(g_mu);
    g_rdma_ordering = v;
}
// CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS (0: no flush).
void pdx_fake_set_rdma_flush_options(int v) {
    std::lock_guard<std::mutex> l(g_mu);
    g_rdma_flush_options = v;
}

CUresult cuGetErrorName(CUresult rc, const char** s) {
    switch (rc) {
        case OK: *s = "CUDA_SUCCESS"; break;
        case ERR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; break;
        case ERR_OOM: *s = "CUDA_ERROR_OUT_OF_MEMORY"; break;
        case ERR_NOT_INIT: *s = "CUDA_ERROR_NOT_INITIALIZED"; break;
        case ERR_INVALID_DEVICE: *s = "CUDA_ERROR_INVALID_DEVICE"; break;
        case ERR_INVALID_IMAGE: *s = "CUDA_ERROR_INVALID_IMAGE"; break;
        case ERR_INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; break;
        case ERR_NO_BINARY_FOR_GPU: *s = "CUDA_ERROR_NO_BINARY_FOR_GPU"; break;
        case ERR_UNSUPPORTED_PTX_VERSION: *s = "CUDA_ERROR_UNSUPPORTED_PTX_VERSION"; break;
        case ERR_INVALID_HANDLE: *s = "CUDA_ERROR_INVALID_HANDLE"; break;
        case ERR_NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; break;
        case ERR_NOT_READY: *s = "CUDA_ERROR_NOT_READY"; break;
        case ERR_ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; break;
        case ERR_LAUNCH_FAILED: *s = "CUDA_ERROR_LAUNCH_FAILED"; break;
        case ERR_NOT_SUPPORTED: *s = "CUDA_ERROR_NOT_SUPPORTED"; break;
        default: *s = "CUDA_ERROR_UNKNOWN"; break;
    }
    return OK;
}
CUresult cuGetErrorString(CUresult rc, const char** s) { return cuGetErrorName(rc, s); }
}
