// A stand-in libnccl.so for tests without GPUs: two ranks of a communicator
// live in one process (two threads). Sends and recvs posted inside a group
// are matched in posting order per direction when the group ends; a recv
// copies the matching send's bytes (host memory, as with cuda/fake_driver.cpp).
// Mismatched sizes fail with ncclInvalidUsage; every wait is bounded (10 s)
// and fails with ncclSystemError instead of hanging. tests/fake_driver.rs
// uses it for end-to-end NCCL transfers of relayout plans. Each op is ordered
// after the work enqueued before it on its stream: the group first waits for
// those streams through the fake libcuda (which defers stream work until it is
// waited), then copies; so a send reads what an earlier gather wrote and a
// memset enqueued before a recv does not wipe what it delivered. (Real NCCL
// only enqueues and returns; this one completes the group before returning.)
#include <dlfcn.h>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

extern "C" {
typedef struct {
    char internal[128];
} ncclUniqueId;
}

enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
};

struct Msg {
    const void* buf;
    size_t len;
    bool taken = false;
};

struct Pair {
    std::mutex mu;
    std::condition_variable cv;
    int joined = 0;
    std::deque<std::shared_ptr<Msg>> q[2];  // q[r]: messages sent to rank r
};

struct Comm {
    std::shared_ptr<Pair> pair;
    int rank;
};

struct Op {
    bool send;
    void* buf;
    size_t len;
    Comm* comm;
    void* stream;
};

static std::mutex g_mu;
static std::map<std::string, std::shared_ptr<Pair>> g_pairs;
static thread_local int g_depth = 0;
static thread_local std::vector<Op> g_pending;
static unsigned long long g_counter = 0;
static const auto kWait = std::chrono::seconds(10);

// Runs the work enqueued on `stream` so far (cuStreamSynchronize of the
// libcuda this process loaded); false when it fails.
static bool stream_sync(void* stream) {
    if (stream == nullptr) return true;
    static int (*sync)(void*) = [] {
        void* h = dlopen("libcuda.so", RTLD_NOW | RTLD_NOLOAD);
        return h ? (int (*)(void*))dlsym(h, "cuStreamSynchronize") : nullptr;
    }();
    return sync != nullptr && sync(stream) == 0;
}

static int run(std::vector<Op>& ops) {
    int rc = ncclSuccess;
    for (auto& op : ops)
        if (!stream_sync(op.stream)) rc = ncclUnhandledCudaError;
    if (rc != ncclSuccess) {
        ops.clear();
        return rc;
    }
    std::vector<std::shared_ptr<Msg>> mine;
    for (auto& op : ops) {
        if (!op.send) continue;
        auto m = std::make_shared<Msg>(Msg{op.buf, op.len});
        std::lock_guard<std::mutex> l(op.comm->pair->mu);
        op.comm->pair->q[1 - op.comm->rank].push_back(m);
        mine.push_back(m);
        op.comm->pair->cv.notify_all();
    }
    for (auto& op : ops) {
        if (op.send || rc != ncclSuccess) continue;
        Pair& p = *op.comm->pair;
        std::unique_lock<std::mutex> l(p.mu);
        auto& q = p.q[op.comm->rank];
        if (!p.cv.wait_for(l, kWait, [&] { return !q.empty(); })) {
            rc = ncclSystemError;
            break;
        }
        auto m = q.front();
        q.pop_front();
        if (m->len != op.len) rc = ncclInvalidUsage;
        else memcpy(op.buf, m->buf, op.len);
        m->taken = true;
        p.cv.notify_all();
    }
    for (auto& m : mine) {  // a send completes once its recv has copied
        Pair& p = *ops[0].comm->pair;
        std::unique_lock<std::mutex> l(p.mu);
        if (!p.cv.wait_for(l, kWait, [&] { return m->taken; }) && rc == ncclSuccess)
            rc = ncclSystemError;
    }
    ops.clear();
    return rc;
}

extern "C" {

int ncclGetVersion(int* v) {
    *v = 22999;
    return ncclSuccess;
}
int ncclGetUniqueId(ncclUniqueId* id) {
    std::lock_guard<std::mutex> l(g_mu);
    memset(id->internal, 0, sizeof id->internal);
    snprintf(id->internal, sizeof id->internal, "fake-nccl-%llu", ++g_counter);
    return ncclSuccess;
}
const char* ncclGetErrorString(int) { return "fake NCCL error"; }
const char* ncclGetLastError(void*) { return "fake NCCL error"; }

int ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
    if (nranks != 2 || rank < 0 || rank > 1) return ncclInvalidArgument;
    std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
    std::shared_ptr<Pair> p;
    {
        std::lock_guard<std::mutex> l(g_mu);
        auto& slot = g_pairs[key];
        if (!slot) slot = std::make_shared<Pair>();
        p = slot;
    }
    std::unique_lock<std::mutex> l(p->mu);
    p->joined++;
    p->cv.notify_all();
    if (!p->cv.wait_for(l, kWait, [&] { return p->joined >= 2; })) return ncclSystemError;
    *comm = new Comm{p, rank};
    return ncclSuccess;
}
int ncclCommAbort(void* comm) {
    delete (Comm*)comm;
    return ncclSuccess;
}
int ncclCommDestroy(void* comm) { return ncclCommAbort(comm); }

int ncclGroupStart() {
    g_depth++;
    return ncclSuccess;
}
int ncclGroupEnd() {
    if (g_depth == 0) return ncclInvalidUsage;
    if (--g_depth > 0) return ncclSuccess;
    return run(g_pending);
}

static int post(bool send, const void* buf, size_t count, int dtype, int peer, void* comm,
                void* stream) {
    Comm* c = (Comm*)comm;
    if (c == nullptr || peer != 1 - c->rank) return ncclInvalidArgument;
    if (dtype != 0 && dtype != 1) return ncclInvalidArgument;  // bytes only
    g_pending.push_back(Op{send, (void*)buf, count, c, stream});
    if (g_depth == 0) return run(g_pending);
    return ncclSuccess;
}
int ncclSend(const void* buf, size_t count, int dtype, int peer, void* comm, void* stream) {
    return post(true, buf, count, dtype, peer, comm, stream);
}
int ncclRecv(void* buf, size_t count, int dtype, int peer, void* comm, void* stream) {
    return post(false, buf, count, dtype, peer, comm, stream);
}
}
