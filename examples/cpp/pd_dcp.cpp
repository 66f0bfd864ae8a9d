// A prefill rank and decode DCP ranks in separate processes, through the C ABI
// (include/pdxfer.h, libpdxfer.so), from C++17.
//
//   ./pd_dcp [decode_dcp_size=2] [tokens=1000] [prefix=64]
//
// The program forks one prefill process and `decode_dcp_size` decode processes
// (before it starts any thread), then runs pdxfer's bootstrap server in-process
// and passes its URL to them. The prefill fills its MLA pools with a pattern
// per (layer, position), sends the request in chunks; every decode rank
// receives the positions it owns (position t lives on rank t % dcp_size) into
// its own pages and checks every byte.
#include "pdxfer.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

constexpr uint32_t kLayers = 4;
constexpr uint64_t kPage = 16;
constexpr uint64_t kRow = 576;  // one fp8 MLA token row (kv_lora_rank + rope dims)
constexpr uint64_t kPoolPages = 256;
constexpr uint64_t kAuxItem = 64;

// Throws on a failing status, with the library's detail text.
void check(PdxStatus st, const char* what) {
    if (st != PDX_STATUS_OK)
        throw std::runtime_error(std::string(what) + ": " + pdxfer_status_kind(st) + ": " + pdxfer_last_error());
}

// One rank's host memory and its C descriptors.
struct Pools {
    std::vector<std::vector<uint8_t>> kv;
    std::vector<uint8_t> aux = std::vector<uint8_t>(4 * kAuxItem);
    std::vector<uint32_t> ids;
    std::vector<uint64_t> rows;
    std::vector<PdxKvPool> pools;
    PdxAuxBuffer auxb{};
    PdxTopology topo{};

    Pools(uint32_t dcp, uint32_t rank) : kv(kLayers, std::vector<uint8_t>(kPoolPages * kPage * kRow)) {
        for (uint32_t l = 0; l < kLayers; l++) {
            ids.push_back(l);
            rows.push_back(kRow);
            pools.push_back(PdxKvPool{l, 0, kv[l].data(), kPage * kRow, kPoolPages});
        }
        auxb = PdxAuxBuffer{aux.data(), kAuxItem, 4};
        topo.struct_size = sizeof topo;
        topo.engine_rank = rank;
        topo.attn_tp_size = dcp;
        topo.attn_tp_rank = rank;
        topo.attn_cp_size = 1;
        topo.pp_size = 1;
        topo.dcp_size = dcp;
        topo.dcp_rank = rank;
        topo.dcp_interleave = 1;
        topo.page_size = kPage;
        topo.kv_dtype = 4;  // fp8_e4m3
        topo.pool_kind = 0;  // mla
        topo.num_entries = kLayers;
        topo.entry_layer_ids = ids.data();
        topo.entry_row_bytes = rows.data();
    }
};

// RAII engine handle.
class Engine {
  public:
    Engine(Pools& p, uint32_t role, const std::string& url) {
        PdxEngineConfig c{};
        c.struct_size = sizeof c;
        c.role = role;
        c.cluster = "cpp-example";
        c.bootstrap = url.c_str();
        c.topology = &p.topo;
        c.pools = p.pools.data();
        c.num_pools = p.pools.size();
        c.aux = &p.auxb;
        c.num_aux = 1;
        check(pdxfer_engine_create(&c, &h_), "pdxfer_engine_create");
    }
    ~Engine() { pdxfer_engine_destroy(h_); }
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;
    PdxEngine* get() const { return h_; }

    int32_t wait(uint64_t room, uint64_t ms) const {
        int32_t poll = 0;
        check(pdxfer_engine_wait(h_, room, ms, &poll), "pdxfer_engine_wait");
        return poll;
    }
    std::string failure(uint64_t room) const {
        int32_t st = 0;
        size_t need = 0;
        check(pdxfer_engine_failure(h_, room, &st, nullptr, 0, &need), "size query");
        std::string s(need, '\0');
        check(pdxfer_engine_failure(h_, room, &st, s.data(), s.size(), &need), "pdxfer_engine_failure");
        s.resize(need ? need - 1 : 0);
        return std::string(pdxfer_status_kind(st)) + ": " + s;
    }

  private:
    PdxEngine* h_ = nullptr;
};

uint8_t pattern(uint64_t layer, uint64_t pos, uint64_t byte) {
    return static_cast<uint8_t>((layer * 131 + pos * 31 + byte * 7 + (pos >> 8)) & 0xff);
}

// Pool row of position t on a rank of a DCP-d layout, through `pages` starting at `origin`.
uint64_t row_of(uint64_t t, uint64_t d, const std::vector<int64_t>& pages, uint64_t origin) {
    uint64_t v = kPage * d, li = (t - origin) / v * kPage + (t % v) / d;
    return static_cast<uint64_t>(pages[li / kPage]) * kPage + li % kPage;
}

std::vector<int64_t> page_list(uint64_t count, uint64_t stride, uint64_t first) {
    std::vector<int64_t> v;
    for (uint64_t i = 0; i < count; i++) v.push_back(static_cast<int64_t>((i * stride + first) % kPoolPages));
    return v;
}

constexpr uint64_t kRoom = 42;

int prefill(const std::string& url, uint64_t total, uint64_t prefix, int done_fd) {
    Pools p(1, 0);
    uint64_t n = total - prefix;
    auto pages = page_list((n + kPage - 1) / kPage, 7, 5);
    for (uint64_t t = prefix; t < total; t++)
        for (uint64_t l = 0; l < kLayers; l++)
            for (uint64_t b = 0; b < kRow; b++) p.kv[l][row_of(t, 1, pages, prefix) * kRow + b] = pattern(l, t, b);
    std::memset(p.aux.data(), 0xA5, kAuxItem);
    Engine e(p, PDXFER_ROLE_PREFILL, url);
    check(pdxfer_engine_sender(e.get(), kRoom), "pdxfer_engine_sender");
    int32_t poll = PDXFER_POLL_BOOTSTRAPPING;
    for (int i = 0; i < 2000 && poll == PDXFER_POLL_BOOTSTRAPPING; i++) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        check(pdxfer_engine_poll(e.get(), kRoom, &poll), "pdxfer_engine_poll");
    }
    if (poll != PDXFER_POLL_WAITING_FOR_INPUT) throw std::runtime_error("no decode metadata");
    auto t0 = std::chrono::steady_clock::now();
    const size_t chunk = 16;
    uint64_t sent = 0;
    for (size_t i = 0; i < pages.size(); i += chunk) {
        size_t k = std::min(chunk, pages.size() - i);
        bool last = i + k >= pages.size();
        uint64_t tokens = last ? n - sent : k * kPage;
        check(pdxfer_engine_send(e.get(), kRoom, pages.data() + i, k, tokens, last, 0), "pdxfer_engine_send");
        sent += tokens;
    }
    if (e.wait(kRoom, 30000) != PDXFER_POLL_SUCCESS) throw std::runtime_error(e.failure(kRoom));
    double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("prefill: %llu tokens x %u layers x %llu B sent in %.1f ms\n", (unsigned long long)n, kLayers,
                (unsigned long long)kRow, ms);
    std::fflush(stdout);
    char c;
    while (read(done_fd, &c, 1) > 0) {
    }
    return 0;
}

int decode(const std::string& url, uint32_t dcp, uint32_t rank, uint64_t total, uint64_t prefix) {
    Pools p(dcp, rank);
    uint64_t n = total - prefix, v = kPage * dcp;
    auto pages = page_list((n + v - 1) / v, 3, 1);
    Engine e(p, PDXFER_ROLE_DECODE, url);
    PdxStatus st = PDX_STATUS_NOT_READY;
    for (int i = 0; i < 500 && st == PDX_STATUS_NOT_READY; i++) {  // until the prefill is listed
        st = pdxfer_engine_receiver(e.get(), kRoom, 0, 0);
        if (st == PDX_STATUS_NOT_READY) {
            pdxfer_engine_clear(e.get(), kRoom);
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
        }
    }
    check(st, "pdxfer_engine_receiver");
    check(pdxfer_engine_send_metadata(e.get(), kRoom, pages.data(), pages.size(), prefix, 1),
          "pdxfer_engine_send_metadata");
    if (e.wait(kRoom, 30000) != PDXFER_POLL_SUCCESS) throw std::runtime_error(e.failure(kRoom));
    uint64_t checked = 0;
    for (uint64_t t = prefix; t < total; t++) {
        if (t % dcp != rank) continue;
        uint64_t row = row_of(t, dcp, pages, prefix);
        for (uint64_t l = 0; l < kLayers; l++)
            for (uint64_t b = 0; b < kRow; b++)
                if (p.kv[l][row * kRow + b] != pattern(l, t, b))
                    throw std::runtime_error("mismatch at position " + std::to_string(t) + " layer " +
                                             std::to_string(l));
        checked += kLayers * kRow;
    }
    for (uint64_t b = 0; b < kAuxItem; b++)
        if (p.aux[kAuxItem + b] != 0xA5) throw std::runtime_error("aux row mismatch");
    std::printf("decode rank %u/%u: %llu KV bytes + %llu aux bytes verified\n", rank, dcp,
                (unsigned long long)checked, (unsigned long long)kAuxItem);
    return 0;
}

int guarded(int (*f)()) {
    try {
        return f();
    } catch (const std::exception& ex) {
        std::fprintf(stderr, "[%d] error: %s\n", (int)getpid(), ex.what());
        return 1;
    }
}

}  // namespace

int main(int argc, char** argv) {
    static uint32_t dcp = argc > 1 ? static_cast<uint32_t>(std::stoul(argv[1])) : 2;
    static uint64_t total = argc > 2 ? std::stoull(argv[2]) : 1000;
    static uint64_t prefix = argc > 3 ? std::stoull(argv[3]) : 64;
    if (dcp < 1 || dcp > 8 || prefix % (kPage * dcp) != 0 || prefix >= total) {
        std::fprintf(stderr, "usage: pd_dcp [dcp 1..8] [tokens] [prefix: a multiple of %llu * dcp below tokens]\n",
                     (unsigned long long)kPage);
        return 2;
    }
    // fork the ranks first: this process has no threads yet
    int done[2];
    if (pipe(done) != 0) return 1;
    std::vector<std::pair<pid_t, int>> kids;  // pid, url pipe
    for (uint32_t i = 0; i <= dcp; i++) {
        int url_pipe[2];
        if (pipe(url_pipe) != 0) return 1;
        std::fflush(nullptr);
        pid_t pid = fork();
        if (pid == 0) {
            for (auto& k : kids) close(k.second);
            close(url_pipe[1]);
            close(done[1]);
            static std::string url;
            char buf[256];
            ssize_t r;
            while ((r = read(url_pipe[0], buf, sizeof buf)) > 0) url.append(buf, static_cast<size_t>(r));
            static int done_fd = done[0];
            static uint32_t rank = i - 1;
            int rc = i == 0 ? guarded([] { return prefill(url, total, prefix, done_fd); })
                            : guarded([] { return decode(url, dcp, rank, total, prefix); });
            std::fflush(nullptr);
            _exit(rc);
        }
        close(url_pipe[0]);
        kids.emplace_back(pid, url_pipe[1]);
    }
    close(done[0]);
    PdxBootstrapServerConfig sc{};
    sc.struct_size = sizeof sc;
    PdxBootstrapServer* srv = nullptr;
    char url[256];
    size_t need = 0;
    int failed = 0;
    try {
        check(pdxfer_bootstrap_server_start(&sc, &srv), "pdxfer_bootstrap_server_start");
        check(pdxfer_bootstrap_server_url(srv, url, sizeof url, &need), "pdxfer_bootstrap_server_url");
        std::printf("bootstrap server at %s; 1 prefill -> %u decode DCP ranks, %llu tokens, prefix %llu\n", url, dcp,
                    (unsigned long long)total, (unsigned long long)prefix);
        std::fflush(stdout);
    } catch (const std::exception& ex) {
        std::fprintf(stderr, "%s\n", ex.what());
        failed = 1;
    }
    for (auto& k : kids) {
        if (!failed && write(k.second, url, std::strlen(url)) < 0) failed = 1;
        close(k.second);
    }
    for (size_t i = 1; i < kids.size(); i++) {  // decode ranks first, then release the prefill
        int status = 0;
        waitpid(kids[i].first, &status, 0);
        failed |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    close(done[1]);
    int status = 0;
    waitpid(kids[0].first, &status, 0);
    failed |= !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    pdxfer_bootstrap_server_stop(srv);
    std::printf(failed ? "FAILED\n" : "OK: every byte landed where its DCP rank owns it\n");
    return failed;
}
