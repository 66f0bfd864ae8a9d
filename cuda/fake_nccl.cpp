// A stand-in libnccl.so.2 for tests without GPUs. The two ranks of a pair
// communicator are two processes (or two threads of one) that meet in a
// shared-memory file named after the unique id ($PDXFER_FAKE_NCCL_DIR,
// default /dev/shm). It works with cuda/fake_driver.cpp ("device" memory is
// host memory): each ncclGroupEnd enqueues one step per stream on the fake
// libcuda (pdx_fake_enqueue_step), so the ops run only when the stream is
// waited, after the work enqueued before them (a send reads what an earlier
// gather wrote).
//
// What it models:
// - Rendezvous: the k-th send of a rank matches the peer's k-th recv. A send
//   completes only when that recv was posted and both streams ran to it; the
//   recv copies the bytes out of the sender's memory (process_vm_readv, or
//   memcpy within one process). An unmatched send or recv never completes:
//   its stream stays blocked (event queries answer not-ready) until the
//   communicator is aborted.
// - Non-blocking init: ncclCommInitRankConfig with `blocking = 0` returns
//   ncclInProgress, and ncclCommGetAsyncError stays ncclInProgress until the
//   peer joined (forever, if it never does). Blocking init (and
//   ncclCommInitRank) waits up to 10 s and then fails with ncclSystemError.
// - Faults: PDXFER_FAKE_NCCL_FAULT=<ncclResult_t> (with
//   PDXFER_FAKE_NCCL_FAULT_AFTER_GROUPS=N, default 0: once this process
//   enqueued more than N groups), or pdx_fake_nccl_set_fault(code): every
//   communicator's ncclCommGetAsyncError reports it and its pending ops make
//   no progress (as a failed network leaves NCCL's kernels), until aborted.
//   A size mismatch between a send and its recv is ncclInvalidUsage on both
//   sides; a peer that aborted is ncclRemoteError.
// - ncclCommAbort makes the communicator's pending ops finish at once (their
//   streams drain) without moving bytes; ncclCommFinalize is ncclInProgress
//   while ops are pending, then ncclSuccess; ncclCommDestroy frees.
// - Bounds a real NCCL also has: a rank's ops go to its one peer (any other
//   peer is ncclInvalidArgument), data types are bytes (ncclInt8/ncclUint8),
//   an op posted after ncclCommAbort is ncclInvalidUsage, and a recv whose
//   read of the sender's memory fails is ncclSystemError. At most 4096 sends
//   of a direction wait for their recvs at once; ncclGetVersion says 2.29.99.
// - Two ranks on one GPU: each rank records its host (boot id) and the PCI
//   bus id of its current context's device (cuCtxGetDevice on the fake
//   libcuda, PDXFER_FAKE_CUDA_DEVICES); once both joined, equal ones are
//   ncclInvalidUsage (non-blocking: from ncclCommGetAsyncError; blocking: from
//   init) with "Duplicate GPU detected" as ncclGetLastError, as NCCL's init
//   refuses two ranks of one communicator with one host hash and bus id.
// - ncclGroupEnd of a group with ops of a non-blocking communicator returns
//   ncclInProgress (its ops are enqueued), and that communicator's next two
//   ncclCommGetAsyncError answer ncclInProgress before its real state, as a
//   non-blocking NCCL may; pdx_fake_nccl_groups_in_progress counts them.
// - pdx_fake_nccl_counts reports aborts, destroys and live communicators;
//   pdx_fake_nccl_rank_aborts the aborts of each rank's communicators.
//
// What this fake does not model:
// - a peer process that dies: nothing notices (as with NVLink P2P, where
//   NCCL hangs); the caller's own liveness check must;
// - more than two ranks, collectives, data types other than bytes, and the
//   concurrency of ops inside one group (they complete in posting order);
// - NCCL's GPU memory use, channels, proxies, transports and timing;
// - which device an op's buffers are on (only the rank's current device is
//   compared with its peer's);
// - ncclCommInitRankConfig's other config fields (only `blocking` is read).
#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

extern "C" {
typedef struct {
    char internal[128];
} ncclUniqueId;
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
} ncclConfigPrefix;
}

enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
};

constexpr uint64_t kSlots = 4096;
struct Desc {
    uint64_t addr;
    uint64_t len;
};
struct Chan {                      // messages to one rank
    std::atomic<uint64_t> posted;  // sends published, in order
    std::atomic<uint64_t> taken;   // recvs done, in order
    Desc d[kSlots];
};
struct Shared {
    std::atomic<int> joined;  // bit r: rank r joined
    std::atomic<int> pid[2];
    std::atomic<int> aborted[2];
    std::atomic<int> error;  // a fault both ranks see (size mismatch)
    std::atomic<int> users;
    char gpu[2][96];  // rank r's "host bus-id", written before it joins ("" unknown)
    Chan ch[2];
};

struct State {
    Shared* sh = nullptr;
    std::string path;
    int rank = 0;
    std::atomic<bool> aborted{false};
    std::atomic<bool> finalizing{false};
    std::atomic<int> pending{0};  // enqueued steps not finished
    bool blocking = true;
    std::atomic<int> launch_polls{0};  // async-error polls still answering in-progress
    uint64_t next_send = 0, next_recv = 0;
    ~State() {
        if (sh == nullptr) return;
        if (sh->users.fetch_sub(1) == 1) unlink(path.c_str());
        munmap(sh, sizeof(Shared));
    }
};
struct Handle {
    std::shared_ptr<State> st;
};

struct Op {
    bool send;
    void* buf;
    size_t len;
    uint64_t seq = 0;
    bool done = false;
    bool published = false;
};
struct Task {
    std::shared_ptr<State> st;
    std::vector<Op> ops;
};
struct Pending {
    Handle* h;
    void* stream;
    Op op;
};

static std::mutex g_mu;
static thread_local int g_depth = 0;
static thread_local std::vector<Pending> g_pending;
static unsigned long long g_counter = 0;
static std::atomic<int> g_fault{0};
static std::atomic<long> g_groups{0};
static std::atomic<unsigned long long> g_aborts{0}, g_destroys{0}, g_live{0};
static std::atomic<unsigned long long> g_rank_aborts[2] = {{0}, {0}};
static std::atomic<unsigned long long> g_groups_in_progress{0};
static char g_last_error[256] = "";  // ncclGetLastError: the last warning, none yet

static long env_or(const char* name, long dflt) {
    const char* v = getenv(name);
    return v && *v ? strtol(v, nullptr, 0) : dflt;
}

// The injected fault in force (0 for none).
static int fault() {
    int f = g_fault.load();
    if (f != 0) return f;
    static long code = env_or("PDXFER_FAKE_NCCL_FAULT", 0);
    static long after = env_or("PDXFER_FAKE_NCCL_FAULT_AFTER_GROUPS", 0);
    return code != 0 && g_groups.load() > after ? (int)code : 0;
}

static std::string shm_dir() {
    const char* d = getenv("PDXFER_FAKE_NCCL_DIR");
    return d && *d ? d : "/dev/shm";
}

// Copies `len` bytes at `remote` in process `pid` into `local`.
static bool read_peer(int pid, void* local, uint64_t remote, uint64_t len) {
    if (pid == getpid()) {
        memcpy(local, (const void*)remote, len);
        return true;
    }
    uint64_t off = 0;
    while (off < len) {
        struct iovec l = {(char*)local + off, (size_t)(len - off)};
        struct iovec r = {(void*)(remote + off), (size_t)(len - off)};
        ssize_t n = process_vm_readv(pid, &l, 1, &r, 1, 0);
        if (n <= 0) return false;
        off += (uint64_t)n;
    }
    return true;
}

// One pass over a group's ops; nonzero once every op is done.
static int step(void* arg) {
    Task* t = (Task*)arg;
    State& s = *t->st;
    bool all = true;
    if (!s.aborted.load() && fault() == 0) {
        Shared& sh = *s.sh;
        int peer = 1 - s.rank;
        for (auto& op : t->ops) {
            if (op.done) continue;
            if (op.send) {
                Chan& c = sh.ch[peer];
                if (!op.published) {
                    if (c.posted.load() != op.seq || op.seq - c.taken.load() >= kSlots) {
                        all = false;
                        continue;
                    }
                    c.d[op.seq % kSlots] = Desc{(uint64_t)op.buf, op.len};
                    c.posted.store(op.seq + 1);
                    op.published = true;
                }
                if (c.taken.load() > op.seq) op.done = true;
            } else {
                Chan& c = sh.ch[s.rank];
                if (c.posted.load() > op.seq && c.taken.load() == op.seq) {
                    Desc d = c.d[op.seq % kSlots];
                    if (d.len != op.len) {
                        int z = 0;
                        sh.error.compare_exchange_strong(z, ncclInvalidUsage);
                    } else if (!read_peer(sh.pid[peer].load(), op.buf, d.addr, d.len)) {
                        int z = 0;
                        sh.error.compare_exchange_strong(z, ncclSystemError);
                    }
                    c.taken.store(op.seq + 1);
                    op.done = true;
                }
            }
            all = all && op.done;
        }
    } else {
        all = s.aborted.load();  // a fault leaves the ops stuck until the abort
    }
    if (!all) return 0;
    s.pending.fetch_sub(1);
    delete t;
    return 1;
}

static int (*enqueue_step())(void*, int (*)(void*), void*, const unsigned long long*, int) {
    static auto f = [] {
        void* h = dlopen("libcuda.so", RTLD_NOW | RTLD_NOLOAD);
        if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        return h ? (int (*)(void*, int (*)(void*), void*, const unsigned long long*,
                            int))dlsym(h, "pdx_fake_enqueue_step")
                 : nullptr;
    }();
    return f;
}

// "boot-id bus-id" of the calling thread's current CUDA device ("" when the
// fake libcuda or a context is missing).
static std::string current_gpu() {
    void* h = dlopen("libcuda.so", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (h == nullptr) return "";
    auto get_dev = (int (*)(int*))dlsym(h, "cuCtxGetDevice");
    auto bus_id = (int (*)(char*, int, int))dlsym(h, "cuDeviceGetPCIBusId");
    int dev = -1;
    char bus[32] = {0};
    if (get_dev == nullptr || bus_id == nullptr || get_dev(&dev) != 0 ||
        bus_id(bus, (int)sizeof bus, dev) != 0)
        return "";
    char boot[64] = {0};
    FILE* f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f != nullptr) {
        if (fgets(boot, sizeof boot, f) == nullptr) boot[0] = 0;
        fclose(f);
    }
    boot[strcspn(boot, "\n")] = 0;
    return std::string(boot) + " " + bus;
}

// True once both ranks joined from one GPU (then recorded as the last error).
static bool duplicate_gpu(Shared& sh) {
    if (sh.joined.load() != 3 || sh.gpu[0][0] == 0 || strcmp(sh.gpu[0], sh.gpu[1]) != 0)
        return false;
    std::lock_guard<std::mutex> l(g_mu);
    const char* bus = strchr(sh.gpu[0], ' ');
    snprintf(g_last_error, sizeof g_last_error,
             "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device %s",
             bus ? bus + 1 : sh.gpu[0]);
    return true;
}

// Enqueues the ops of one group: one step per (communicator, stream).
static int launch(std::vector<Pending>& ops) {
    auto enq = enqueue_step();
    if (enq == nullptr) {
        ops.clear();
        return ncclUnhandledCudaError;  // not the fake libcuda
    }
    std::map<std::pair<Handle*, void*>, Task*> tasks;
    for (auto& p : ops) {
        Task*& t = tasks[{p.h, p.stream}];
        if (t == nullptr) t = new Task{p.h->st, {}};
        Op op = p.op;
        op.seq = op.send ? p.h->st->next_send++ : p.h->st->next_recv++;
        t->ops.push_back(op);
    }
    ops.clear();
    g_groups.fetch_add(1);
    int rc = ncclSuccess;
    bool in_progress = false;
    for (auto& kv : tasks) {
        Task* t = kv.second;
        if (!t->st->blocking) {
            t->st->launch_polls.store(2);
            in_progress = true;
        }
        std::vector<unsigned long long> ranges;
        for (auto& op : t->ops) {
            ranges.push_back((unsigned long long)op.buf);
            ranges.push_back(op.len);
        }
        t->st->pending.fetch_add(1);
        if (enq(kv.first.second, step, t, ranges.data(), (int)t->ops.size()) != 0) {
            t->st->pending.fetch_sub(1);
            delete t;
            rc = ncclUnhandledCudaError;
        }
    }
    if (rc == ncclSuccess && in_progress) {
        g_groups_in_progress.fetch_add(1);
        return ncclInProgress;
    }
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
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(id->internal, sizeof id->internal, "pdxfer-fake-nccl-%d-%llu-%ld%09ld", (int)getpid(),
             ++g_counter, (long)ts.tv_sec, ts.tv_nsec);
    return ncclSuccess;
}
const char* ncclGetErrorString(int rc) {
    switch (rc) {
        case ncclSuccess: return "no error";
        case ncclSystemError: return "fake: system error";
        case ncclInvalidUsage: return "fake: invalid usage (size mismatch, or two ranks on one GPU)";
        case ncclRemoteError: return "fake: remote process exited or there was a network error";
        case ncclInProgress: return "fake: operation in progress";
        default: return "fake NCCL error";
    }
}
const char* ncclGetLastError(void*) { return g_last_error; }

int ncclCommInitRankConfig(void** comm, int nranks, ncclUniqueId id, int rank, void* config) {
    if (nranks != 2 || rank < 0 || rank > 1 || comm == nullptr) return ncclInvalidArgument;
    int blocking = 1;
    if (config != nullptr) {
        auto* c = (const ncclConfigPrefix*)config;
        if (c->magic != 0xcafebeef || c->size < sizeof(ncclConfigPrefix))
            return ncclInvalidArgument;
        if (c->blocking != INT_MIN) blocking = c->blocking;
    }
    std::string key(id.internal, strnlen(id.internal, sizeof id.internal));
    for (char& ch : key)
        if (ch == '/') ch = '_';
    auto st = std::make_shared<State>();
    st->path = shm_dir() + "/" + key;
    st->rank = rank;
    int fd = open(st->path.c_str(), O_RDWR | O_CREAT, 0600);
    if (fd < 0) return ncclSystemError;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || (sb.st_size < (off_t)sizeof(Shared) &&
                                ftruncate(fd, sizeof(Shared)) != 0)) {
        close(fd);
        return ncclSystemError;
    }
    void* m = mmap(nullptr, sizeof(Shared), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return ncclSystemError;
    st->sh = (Shared*)m;
    st->sh->users.fetch_add(1);
    st->sh->pid[rank].store(getpid());
    st->blocking = blocking != 0;
    std::string gpu = current_gpu();
    snprintf(st->sh->gpu[rank], sizeof st->sh->gpu[rank], "%s", gpu.c_str());
    st->sh->joined.fetch_or(1 << rank);
    *comm = new Handle{st};
    g_live.fetch_add(1);
    if (!blocking) return ncclInProgress;
    auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (st->sh->joined.load() != 3) {
        if (std::chrono::steady_clock::now() > until) return ncclSystemError;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (duplicate_gpu(*st->sh)) return ncclInvalidUsage;
    return ncclSuccess;
}
int ncclCommInitRank(void** comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}
int ncclCommGetAsyncError(void* comm, int* out) {
    Handle* h = (Handle*)comm;
    if (h == nullptr || out == nullptr) return ncclInvalidArgument;
    State& s = *h->st;
    Shared& sh = *s.sh;
    int f = fault();
    if (f != 0) *out = f;
    else if (duplicate_gpu(sh)) *out = ncclInvalidUsage;
    else if (sh.error.load() != 0) *out = sh.error.load();
    else if (sh.aborted[1 - s.rank].load()) *out = ncclRemoteError;
    else if (sh.joined.load() != 3) *out = ncclInProgress;
    else if (s.finalizing.load() && s.pending.load() > 0) *out = ncclInProgress;
    else if (s.launch_polls.load() > 0) {
        s.launch_polls.fetch_sub(1);
        *out = ncclInProgress;
    } else *out = ncclSuccess;
    return ncclSuccess;
}
int ncclCommAbort(void* comm) {
    Handle* h = (Handle*)comm;
    if (h == nullptr) return ncclSuccess;
    h->st->aborted.store(true);
    h->st->sh->aborted[h->st->rank].store(1);
    g_rank_aborts[h->st->rank & 1].fetch_add(1);
    delete h;  // pending steps keep the state until they finish
    g_aborts.fetch_add(1);
    g_live.fetch_sub(1);
    return ncclSuccess;
}
int ncclCommFinalize(void* comm) {
    Handle* h = (Handle*)comm;
    if (h == nullptr) return ncclInvalidArgument;
    h->st->finalizing.store(true);
    return h->st->pending.load() > 0 ? ncclInProgress : ncclSuccess;
}
int ncclCommDestroy(void* comm) {
    Handle* h = (Handle*)comm;
    if (h == nullptr) return ncclInvalidArgument;
    if (h->st->pending.load() > 0) return ncclInvalidUsage;  // finalize first
    delete h;
    g_destroys.fetch_add(1);
    g_live.fetch_sub(1);
    return ncclSuccess;
}

int ncclGroupStart() {
    g_depth++;
    return ncclSuccess;
}
int ncclGroupEnd() {
    if (g_depth == 0) return ncclInvalidUsage;
    if (--g_depth > 0) return ncclSuccess;
    return launch(g_pending);
}

static int post(bool send, const void* buf, size_t count, int dtype, int peer, void* comm,
                void* stream) {
    Handle* h = (Handle*)comm;
    if (h == nullptr || peer != 1 - h->st->rank) return ncclInvalidArgument;
    if (dtype != 0 && dtype != 1) return ncclInvalidArgument;  // bytes only
    if (h->st->aborted.load()) return ncclInvalidUsage;
    g_pending.push_back(Pending{h, stream, Op{send, (void*)buf, count}});
    if (g_depth == 0) return launch(g_pending);
    return ncclSuccess;
}
int ncclSend(const void* buf, size_t count, int dtype, int peer, void* comm, void* stream) {
    return post(true, buf, count, dtype, peer, comm, stream);
}
int ncclRecv(void* buf, size_t count, int dtype, int peer, void* comm, void* stream) {
    return post(false, buf, count, dtype, peer, comm, stream);
}

// Knobs and counters for tests.
void pdx_fake_nccl_set_fault(int code) { g_fault.store(code); }
void pdx_fake_nccl_counts(unsigned long long* aborts, unsigned long long* destroys,
                          unsigned long long* live) {
    *aborts = g_aborts.load();
    *destroys = g_destroys.load();
    *live = g_live.load();
}
unsigned long long pdx_fake_nccl_groups_in_progress() { return g_groups_in_progress.load(); }
void pdx_fake_nccl_rank_aborts(unsigned long long* rank0, unsigned long long* rank1) {
    *rank0 = g_rank_aborts[0].load();
    *rank1 = g_rank_aborts[1].load();
}
}
