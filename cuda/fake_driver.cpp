// A stand-in libcuda.so for machines without a GPU: the CUDA driver calls that
// pdxfer's relayout makes, implemented on the CPU, with kernel launches run by
// the host harness (the very same cuda/relayout.cu source). "Device" memory
// is host memory and every operation completes before it returns, so events
// are always complete, except one: a host-to-device copy on a stream is
// deferred (its host bytes taken at the call, as the driver stages pageable
// memory; read when it lands from pinned memory, as DMA does) until that
// stream is synchronised or given later work, an event recorded after it is
// synchronised, queried or waited by a stream, the context is synchronised,
// or memory is freed; so a caller that reports bytes as landed without
// waiting for its copy (or for an event after it) is caught, and so is one
// that rewrites a pinned source before its copy was waited.
// tests/fake_driver.rs builds it with g++ as
// libcuda.so and runs the device code path (GpuRelayout, the self-check and
// the benchmark loop) in a child process whose LD_LIBRARY_PATH finds it.
//
// It checks what a real driver would reject where it is cheap to do so:
// launches of functions it did not hand out, unknown streams/events, copies
// touching memory it did not allocate, kernel rows outside device
// allocations, a wrong kernel block size, and freeing pinned host memory it
// did not hand out. cuPointerGetAttribute answers for its own allocations
// (device or pinned host) and refuses any other address, as the driver does
// for pageable memory.
#include "host_harness.h"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
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
    ERR_INVALID_HANDLE = 400,
    ERR_NOT_FOUND = 500,
    ERR_LAUNCH_FAILED = 719,
};

static int g_ctx_token;
static int g_gather_token;
static int g_scatter_token;
static int g_module_token;
static thread_local CUcontext g_current = nullptr;
static std::mutex g_mu;
static std::map<CUdeviceptr, size_t> g_allocs;  // base -> size
static std::map<void*, double> g_events;        // event -> record time (ms)
static std::map<void*, int> g_streams;
static std::map<void*, void*> g_event_stream;  // event -> stream it was last recorded on
static std::map<CUdeviceptr, size_t> g_host_allocs;  // pinned host base -> size
static bool g_inited = false;
static unsigned long long g_pinned_dtoh = 0;  // async DtoH copies into pinned memory
static unsigned long long g_launches = 0;     // kernel launches
static unsigned long long g_htod_landed = 0;  // stream-ordered HtoD copies applied
static unsigned long long g_pinned_htod = 0;  // stream-ordered HtoD copies from pinned memory
// A host-to-device copy not yet applied: from pageable memory its host bytes
// were staged at the call; from pinned memory they are read when it lands
// (as the DMA engine does), so rewriting the source before waiting shows.
struct PendingCopy {
    CUdeviceptr dst;
    const unsigned char* pinned;        // source, when pinned
    std::vector<unsigned char> staged;  // staged bytes, when pageable
    size_t n;
};
// Stream -> HtoD copies not yet applied.
static std::map<void*, std::vector<PendingCopy>> g_pending;

static double now_ms() {
    using namespace std::chrono;
    return duration<double, std::milli>(steady_clock::now().time_since_epoch()).count();
}

// True when [p, p + n) lies inside one allocation.
static bool owned(CUdeviceptr p, size_t n) {
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}

// The allocation holding `p` in `m`: its base and size, or false.
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

// Applies the deferred host-to-device copies of stream `s` (every stream when
// `all`), in order.
static void flush(CUstream s, bool all = false) {
    std::lock_guard<std::mutex> l(g_mu);
    for (auto it = g_pending.begin(); it != g_pending.end();) {
        if (!all && it->first != s) {
            ++it;
            continue;
        }
        for (auto& c : it->second) {
            memcpy((void*)c.dst, c.pinned ? c.pinned : c.staged.data(), c.n);
            ++g_htod_landed;
        }
        it = g_pending.erase(it);
    }
}

static bool stream_ok(CUstream s) {
    std::lock_guard<std::mutex> l(g_mu);
    return s == nullptr || g_streams.count(s) > 0;
}

extern "C" {

CUresult cuInit(unsigned int) {
    g_inited = true;
    return OK;
}
CUresult cuDriverGetVersion(int* v) {
    *v = 12080;
    return OK;
}
CUresult cuDeviceGetCount(int* n) {
    if (!g_inited) return ERR_NOT_INIT;
    *n = 1;
    return OK;
}
CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (!g_inited) return ERR_NOT_INIT;
    if (ordinal != 0) return ERR_INVALID_DEVICE;
    *d = 0;
    return OK;
}
CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    snprintf(name, (size_t)len, "pdxfer fake CUDA device (CPU)");
    return OK;
}
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice) {
    switch (attr) {
        case 75: *v = 9; break;   // compute capability major
        case 76: *v = 0; break;   // minor
        default: *v = 0; break;   // no memory pools, nothing else
    }
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    if (d != 0) return ERR_INVALID_DEVICE;
    *c = &g_ctx_token;
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = g_current;
    return OK;
}
CUresult cuCtxSetCurrent(CUcontext c) {
    if (c != nullptr && c != &g_ctx_token) return ERR_INVALID_HANDLE;
    g_current = c;
    return OK;
}
CUresult cuCtxSynchronize() {
    flush(nullptr, true);
    return OK;
}

CUresult cuStreamCreate(CUstream* s, unsigned int) {
    std::lock_guard<std::mutex> l(g_mu);
    *s = malloc(1);
    g_streams[*s] = 1;
    return OK;
}
CUresult cuStreamDestroy_v2(CUstream s) {
    flush(s);
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_streams.erase(s)) return ERR_INVALID_HANDLE;
    free(s);
    return OK;
}
CUresult cuStreamSynchronize(CUstream s) {
    if (!stream_ok(s)) return ERR_INVALID_HANDLE;
    flush(s);
    return OK;
}
// Applies the deferred copies of the stream event `e` was recorded on.
static void flush_event(CUevent e) {
    CUstream s = nullptr;
    {
        std::lock_guard<std::mutex> l(g_mu);
        auto it = g_event_stream.find(e);
        if (it == g_event_stream.end()) return;
        s = it->second;
    }
    flush(s);
}

CUresult cuStreamWaitEvent(CUstream s, CUevent e, unsigned int) {
    if (!stream_ok(s)) return ERR_INVALID_HANDLE;
    flush_event(e);
    flush(s);
    return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t n) {
    if (g_current != &g_ctx_token) return ERR_INVALID_HANDLE;  // no context bound
    void* m = aligned_alloc(256, (n + 255) / 256 * 256);
    if (!m) return ERR_OOM;
    std::lock_guard<std::mutex> l(g_mu);
    *p = (CUdeviceptr)m;
    g_allocs[*p] = n;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    flush(nullptr, true);  // the driver synchronises before freeing
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_allocs.erase(p)) return ERR_INVALID_VALUE;
    free((void*)p);
    return OK;
}
CUresult cuMemHostAlloc(void** p, size_t n, unsigned int) {
    if (g_current != &g_ctx_token) return ERR_INVALID_HANDLE;  // no context bound
    void* m = aligned_alloc(4096, (n + 4095) / 4096 * 4096);
    if (!m) return ERR_OOM;
    std::lock_guard<std::mutex> l(g_mu);
    *p = m;
    g_host_allocs[(CUdeviceptr)m] = n;
    return OK;
}
CUresult cuMemFreeHost(void* p) {
    flush(nullptr, true);  // the driver synchronises before freeing
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_host_allocs.erase((CUdeviceptr)p)) return ERR_INVALID_VALUE;
    free(p);
    return OK;
}
// Attributes: 2 memory type (1 host, 2 device), 9 device ordinal, 11 range
// start, 12 range size.
CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
    if (!g_inited) return ERR_NOT_INIT;
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr base = 0;
    size_t size = 0;
    bool device = find_alloc(g_allocs, p, &base, &size);
    if (!device && !find_alloc(g_host_allocs, p, &base, &size)) return ERR_INVALID_VALUE;
    switch (attr) {
        case 2: *(unsigned int*)data = device ? 2 : 1; break;
        case 9: *(int*)data = 0; break;
        case 11: *(CUdeviceptr*)data = base; break;
        case 12: *(size_t*)data = size; break;
        default: return ERR_INVALID_VALUE;
    }
    return OK;
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void* h, size_t n, CUstream s) {
    if (!stream_ok(s) || !owned(d, n)) return ERR_INVALID_VALUE;
    if (s == nullptr) {
        memcpy((void*)d, h, n);
        return OK;
    }
    const unsigned char* b = (const unsigned char*)h;
    std::lock_guard<std::mutex> l(g_mu);
    CUdeviceptr base;
    size_t size;
    if (find_alloc(g_host_allocs, (CUdeviceptr)h, &base, &size)) {
        if ((CUdeviceptr)h + n > base + size) return ERR_INVALID_VALUE;
        ++g_pinned_htod;
        g_pending[s].push_back(PendingCopy{d, b, {}, n});
    } else {
        g_pending[s].push_back(PendingCopy{d, nullptr, std::vector<unsigned char>(b, b + n), n});
    }
    return OK;
}
CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void* h, size_t n) {
    return cuMemcpyHtoDAsync_v2(d, h, n, nullptr);
}
CUresult cuMemcpyDtoHAsync_v2(void* h, CUdeviceptr d, size_t n, CUstream s) {
    if (!stream_ok(s) || !owned(d, n)) return ERR_INVALID_VALUE;
    if (s != nullptr) flush(s);
    {
        std::lock_guard<std::mutex> l(g_mu);
        CUdeviceptr base;
        size_t size;
        if (s != nullptr && find_alloc(g_host_allocs, (CUdeviceptr)h, &base, &size)) {
            if ((CUdeviceptr)h + n > base + size) return ERR_INVALID_VALUE;
            ++g_pinned_dtoh;
        }
    }
    memcpy(h, (const void*)d, n);
    return OK;
}
CUresult cuMemcpyDtoH_v2(void* h, CUdeviceptr d, size_t n) {
    return cuMemcpyDtoHAsync_v2(h, d, n, nullptr);
}
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, CUstream st) {
    if (!stream_ok(st) || !owned(d, n) || !owned(s, n)) return ERR_INVALID_VALUE;
    if (st != nullptr) flush(st);
    memmove((void*)d, (const void*)s, n);
    return OK;
}
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    if (!stream_ok(s) || !owned(d, n)) return ERR_INVALID_VALUE;
    if (s != nullptr) flush(s);
    memset((void*)d, v, n);
    return OK;
}

CUresult cuEventCreate(CUevent* e, unsigned int) {
    std::lock_guard<std::mutex> l(g_mu);
    *e = malloc(1);
    g_events[*e] = 0.0;
    return OK;
}
CUresult cuEventDestroy_v2(CUevent e) {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_events.erase(e)) return ERR_INVALID_HANDLE;
    g_event_stream.erase(e);  // destroying an event waits for nothing
    free(e);
    return OK;
}
CUresult cuEventRecord(CUevent e, CUstream s) {
    if (!stream_ok(s)) return ERR_INVALID_HANDLE;
    // The stream's deferred copies stay deferred: they land when this event
    // (or the stream) is waited.
    std::lock_guard<std::mutex> l(g_mu);
    auto it = g_events.find(e);
    if (it == g_events.end()) return ERR_INVALID_HANDLE;
    it->second = now_ms();
    g_event_stream[e] = s;
    return OK;
}
CUresult cuEventQuery(CUevent e) {
    {
        std::lock_guard<std::mutex> l(g_mu);
        if (!g_events.count(e)) return ERR_INVALID_HANDLE;
    }
    flush_event(e);  // observed complete: the work before it has landed
    return OK;
}
CUresult cuEventSynchronize(CUevent e) { return cuEventQuery(e); }
CUresult cuEventElapsedTime(float* ms, CUevent a, CUevent b) {
    std::lock_guard<std::mutex> l(g_mu);
    auto ia = g_events.find(a), ib = g_events.find(b);
    if (ia == g_events.end() || ib == g_events.end()) return ERR_INVALID_HANDLE;
    *ms = (float)(ib->second - ia->second);
    return OK;
}
CUresult cuEventElapsedTime_v2(float* ms, CUevent a, CUevent b) {
    return cuEventElapsedTime(ms, a, b);
}

CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    if (image == nullptr) return ERR_INVALID_VALUE;
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
    else
        return ERR_NOT_FOUND;
    return OK;
}
CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shmem, CUstream s, void** params,
                        void** extra) {
    if (!stream_ok(s) || extra != nullptr || params == nullptr) return ERR_INVALID_VALUE;
    flush(s);
    if (bx * by * bz > PDX_THREADS_PER_BLOCK || shmem != 0) return ERR_LAUNCH_FAILED;
    void (*k)(const PdxCopyEntry*, pdx_u32, const PdxSpan*, pdx_u64);
    if (f == &g_gather_token)
        k = pdx_gather;
    else if (f == &g_scatter_token)
        k = pdx_scatter;
    else
        return ERR_INVALID_HANDLE;
    const PdxCopyEntry* entries = (const PdxCopyEntry*)*(const pdx_u64*)params[0];
    pdx_u32 ne = *(const pdx_u32*)params[1];
    const PdxSpan* spans = (const PdxSpan*)*(const pdx_u64*)params[2];
    pdx_u64 ns = *(const pdx_u64*)params[3];
    if (!owned((CUdeviceptr)entries, sizeof(PdxCopyEntry) * ne) ||
        !owned((CUdeviceptr)spans, sizeof(PdxSpan) * ns))
        return ERR_INVALID_VALUE;  // tables must live in device memory
    // every row the launch reads or writes must lie in device memory
    for (pdx_u32 e = 0; e < ne; ++e)
        for (pdx_u64 i = 0; i < ns; ++i) {
            const PdxCopyEntry& en = entries[e];
            const PdxSpan& sp = spans[i];
            size_t n = (size_t)(sp.rows * en.row_bytes);
            if (!owned(en.src + sp.src_row * en.row_bytes, n) ||
                !owned(en.dst + sp.dst_row * en.row_bytes, n))
                return ERR_INVALID_VALUE;
        }
    pdx_host_launch(k, pdx_dim3{gx, gy, gz}, pdx_dim3{bx, by, bz}, entries, ne, spans, ns);
    std::lock_guard<std::mutex> l(g_mu);
    ++g_launches;
    return OK;
}

// Not a driver call: how many stream-ordered device-to-host copies landed in
// pinned host memory (tests check that the engine's copies are asynchronous).
unsigned long long pdx_fake_pinned_dtoh_copies() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_pinned_dtoh;
}

// Not a driver call: stream-ordered host-to-device copies applied so far
// (tests check that received bytes went through waited-on device copies).
unsigned long long pdx_fake_htod_copies() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_htod_landed;
}

// Not a driver call: stream-ordered host-to-device copies from pinned memory.
unsigned long long pdx_fake_pinned_htod_copies() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_pinned_htod;
}

// Not a driver call: kernel launches so far (tests check what was enqueued when).
unsigned long long pdx_fake_launches() {
    std::lock_guard<std::mutex> l(g_mu);
    return g_launches;
}

CUresult cuGetErrorString(CUresult, const char** s) {
    *s = "fake CUDA driver error";
    return OK;
}
CUresult cuGetErrorName(CUresult, const char** s) {
    *s = "CUDA_ERROR_FAKE";
    return OK;
}
}
