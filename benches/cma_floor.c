/* The floor of a same-host write on this machine: what the kernel and the memory bus give a
 * batch of BATCH blocks of BLOCK bytes with no engine, no protocol and no threads hand-off.
 *
 * Modes (each on 1 and on 2 threads; every thread moves its own batches, so 2 threads is the
 * most two cores can do, not one batch split in two):
 *   memcpy-heap     memcpy into a private, pre-faulted buffer of this process
 *   memcpy-shared   memcpy into a MAP_SHARED memfd mapping (what cma does to a peer's shared
 *                   region after mapping it), pre-faulted with MADV_POPULATE_WRITE
 *   stream-shared   the same with non-temporal AVX2 stores per block, as the engine's one-copy
 *                   path moves rows (skipped unless AVX2 and BLOCK a multiple of 64)
 *   vm-writev       process_vm_writev of BATCH iovecs (1024 per call) into a child process's
 *                   pre-faulted private buffer (what cma does to a peer's heap region)
 * BLOCK 1152 and BATCH 499712 is one PD request's 575.7 MB in KV rows (8192 tokens x 61
 * layers x 1152 B): the per-row floor of `pdxfer bench-request`.
 * Per mode: batches, Mops/s (blocks per second over the run), GB/s, the per-batch p50 in
 * microseconds and the Mops/s at that p50 (BATCH / p50: what one thread gives when it is not
 * preempted, the figure to read on a loaded machine).
 * Every destination is checked against the source after the run (a wrong copy exits 1).
 *
 *   cc -O2 -pthread -o cma_floor benches/cma_floor.c
 *   ./cma_floor [BLOCK_BYTES=4096] [BATCH=256] [MS_PER_MODE=1500] [--json]
 *
 * scripts/bench-floor.sh builds and runs it. Not part of the tests. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

enum mode { MEMCPY_HEAP, MEMCPY_SHARED, STREAM_SHARED, VM_WRITEV };
static const char *mode_name[] = {"memcpy-heap", "memcpy-shared", "stream-shared", "vm-writev"};

/* Most iovecs per process_vm_writev call (Linux IOV_MAX). */
#define IOV_MAX_CALL 1024

#if defined(__x86_64__)
#include <immintrin.h>
/* One block with non-temporal 32-byte stores, as the engine's one-copy path moves a row
 * (src/relayout/cpu.rs, copy_spans_streaming): dst 32-byte aligned, len a multiple of 64. */
__attribute__((target("avx2"))) static void stream_block(unsigned char *dst,
                                                           const unsigned char *src,
                                                           size_t len) {
    for (size_t i = 0; i < len; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + i + 32));
        _mm256_stream_si256((__m256i *)(dst + i), a);
        _mm256_stream_si256((__m256i *)(dst + i + 32), b);
    }
}
static int can_stream(size_t block) {
    return __builtin_cpu_supports("avx2") && block % 64 == 0;
}
static void stream_fence(void) { _mm_sfence(); }
#else
static void stream_block(unsigned char *dst, const unsigned char *src, size_t len) {
    memcpy(dst, src, len);
}
static int can_stream(size_t block) {
    (void)block;
    return 0;
}
static void stream_fence(void) {}
#endif

struct job {
    enum mode mode;
    size_t block, batch;
    const unsigned char *src;
    unsigned char *dst; /* this process's view of the destination (memcpy modes) */
    unsigned long remote; /* the child's address of the destination (vm-writev) */
    pid_t child;
    double budget_s;
    /* results */
    size_t batches;
    double secs;
    double *lat_us;
    size_t lat_cap;
    int err;
};

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static void *run_job(void *arg) {
    struct job *j = arg;
    struct iovec *local = calloc(j->batch, sizeof *local);
    struct iovec *remote = calloc(j->batch, sizeof *remote);
    if (!local || !remote) {
        j->err = ENOMEM;
        return NULL;
    }
    for (size_t i = 0; i < j->batch; i++) {
        local[i].iov_base = (void *)(j->src + i * j->block);
        local[i].iov_len = j->block;
        remote[i].iov_base = (void *)(j->remote + i * j->block);
        remote[i].iov_len = j->block;
    }
    double t0 = now_s(), end = t0 + j->budget_s;
    size_t n = 0;
    for (;;) {
        double s = now_s();
        if (s >= end && n >= 3)
            break;
        if (j->mode == VM_WRITEV) {
            size_t k = 0, skip = 0; /* next iovec, bytes of it already written */
            while (k < j->batch) {
                size_t cnt = j->batch - k < IOV_MAX_CALL ? j->batch - k : IOV_MAX_CALL;
                struct iovec l0 = local[k], r0 = remote[k];
                local[k].iov_base = (char *)local[k].iov_base + skip;
                local[k].iov_len -= skip;
                remote[k].iov_base = (char *)remote[k].iov_base + skip;
                remote[k].iov_len -= skip;
                ssize_t w = process_vm_writev(j->child, local + k, cnt, remote + k, cnt, 0);
                local[k] = l0;
                remote[k] = r0;
                if (w <= 0) {
                    j->err = w < 0 ? errno : EIO;
                    goto out;
                }
                /* advance by w bytes; a short write resumes mid-iovec */
                size_t left = (size_t)w + skip;
                while (k < j->batch && left >= local[k].iov_len) {
                    left -= local[k].iov_len;
                    k++;
                }
                skip = left;
            }
        } else if (j->mode == STREAM_SHARED) {
            for (size_t i = 0; i < j->batch; i++)
                stream_block(j->dst + i * j->block, j->src + i * j->block, j->block);
            stream_fence();
        } else {
            for (size_t i = 0; i < j->batch; i++)
                memcpy(j->dst + i * j->block, j->src + i * j->block, j->block);
            __asm__ volatile("" ::: "memory");
        }
        if (n < j->lat_cap)
            j->lat_us[n] = (now_s() - s) * 1e6;
        n++;
    }
out:
    j->secs = now_s() - t0;
    j->batches = n;
    free(local);
    free(remote);
    return NULL;
}

/* The child: holds `len` bytes at `addr` (inherited from the parent's mapping, made private
 * to it by writing every page), then waits for the parent to read it back or kill it. */
static pid_t spawn_child(unsigned char *addr, size_t len, int ready_fd[2], int go_fd[2]) {
    pid_t pid = fork();
    if (pid != 0)
        return pid;
    close(ready_fd[0]);
    close(go_fd[1]);
    for (size_t i = 0; i < len; i += 4096)
        addr[i] = 0;
    char c = 'r';
    if (write(ready_fd[1], &c, 1) != 1)
        _exit(2);
    /* 'c': compare the buffer with the pattern and answer; end of file: exit */
    while (read(go_fd[0], &c, 1) == 1) {
        int ok = 1;
        for (size_t i = 0; i < len; i++)
            if (addr[i] != (unsigned char)(i * 31 + 7)) {
                ok = 0;
                break;
            }
        c = ok ? 'y' : 'n';
        if (write(ready_fd[1], &c, 1) != 1)
            _exit(2);
    }
    _exit(0);
}

static int check(const unsigned char *dst, size_t len) {
    for (size_t i = 0; i < len; i++)
        if (dst[i] != (unsigned char)(i * 31 + 7))
            return 0;
    return 1;
}

int main(int argc, char **argv) {
    size_t block = 4096, batch = 256;
    double ms = 1500;
    int json = 0, pos = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json")) {
            json = 1;
            continue;
        }
        char *e;
        double v = strtod(argv[i], &e);
        if (*e || v <= 0) {
            fprintf(stderr, "usage: %s [BLOCK_BYTES] [BATCH] [MS_PER_MODE] [--json]\n", argv[0]);
            return 2;
        }
        if (pos == 0)
            block = (size_t)v;
        else if (pos == 1)
            batch = (size_t)v;
        else
            ms = v;
        pos++;
    }
    const int max_threads = 2;
    size_t len = block * batch;
    /* each thread: its own source and destination (no false sharing, no shared lines) */
    unsigned char *src[2], *heap[2], *shared[2];
    for (int t = 0; t < max_threads; t++) {
        src[t] = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
        heap[t] = aligned_alloc(4096, (len + 4095) / 4096 * 4096);
        if (!src[t] || !heap[t]) {
            perror("alloc");
            return 1;
        }
        for (size_t i = 0; i < len; i++)
            src[t][i] = (unsigned char)(i * 31 + 7);
        memset(heap[t], 0, len);
        int fd = memfd_create("pdxfer-floor", 0);
        if (fd < 0 || ftruncate(fd, (off_t)len) != 0) {
            perror("memfd");
            return 1;
        }
        shared[t] = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (shared[t] == MAP_FAILED) {
            perror("mmap");
            return 1;
        }
        if (madvise(shared[t], len, MADV_POPULATE_WRITE) != 0)
            memset(shared[t], 0, len);
        close(fd);
    }
    /* the child's destinations: private pages of the child at the parent's addresses */
    unsigned char *remote[2];
    pid_t child[2];
    int ready[2][2], go[2][2];
    for (int t = 0; t < max_threads; t++) {
        remote[t] = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (remote[t] == MAP_FAILED || pipe(ready[t]) || pipe(go[t])) {
            perror("child buffer");
            return 1;
        }
        child[t] = spawn_child(remote[t], len, ready[t], go[t]);
        if (child[t] < 0) {
            perror("fork");
            return 1;
        }
        close(ready[t][1]);
        close(go[t][0]);
        char c;
        if (read(ready[t][0], &c, 1) != 1) {
            fprintf(stderr, "child did not start\n");
            return 1;
        }
    }
    int bad = 0;
    if (json)
        printf("{\"block\":%zu,\"batch\":%zu,\"modes\":[", block, batch);
    int first = 1;
    for (int m = MEMCPY_HEAP; m <= VM_WRITEV; m++) {
        if (m == STREAM_SHARED && !can_stream(block))
            continue;
        for (int threads = 1; threads <= max_threads; threads++) {
            struct job jobs[2];
            pthread_t th[2];
            for (int t = 0; t < threads; t++) {
                if (m == MEMCPY_SHARED || m == STREAM_SHARED)
                    memset(shared[t], 0, len);
                jobs[t] = (struct job){
                    .mode = (enum mode)m,
                    .block = block,
                    .batch = batch,
                    .src = src[t],
                    .dst = m == MEMCPY_HEAP ? heap[t] : shared[t],
                    .remote = (unsigned long)remote[t],
                    .child = child[t],
                    .budget_s = ms / 1000.0,
                    .lat_cap = 1 << 20,
                };
                jobs[t].lat_us = malloc(jobs[t].lat_cap * sizeof(double));
                if (!jobs[t].lat_us || pthread_create(&th[t], NULL, run_job, &jobs[t])) {
                    perror("thread");
                    return 1;
                }
            }
            size_t batches = 0;
            double secs = 0, p50 = 0, p50_mops = 0;
            for (int t = 0; t < threads; t++) {
                pthread_join(th[t], NULL);
                if (jobs[t].err) {
                    fprintf(stderr, "%s: %s\n", mode_name[m], strerror(jobs[t].err));
                    return 1;
                }
                batches += jobs[t].batches;
                if (jobs[t].secs > secs)
                    secs = jobs[t].secs;
                size_t k = jobs[t].batches < jobs[t].lat_cap ? jobs[t].batches : jobs[t].lat_cap;
                qsort(jobs[t].lat_us, k, sizeof(double), cmp_double);
                double p = jobs[t].lat_us[k / 2];
                if (t == 0)
                    p50 = p;
                p50_mops += (double)batch / p;
                int ok;
                if (m == VM_WRITEV) {
                    char c = 'c';
                    ok = write(go[t][1], &c, 1) == 1 && read(ready[t][0], &c, 1) == 1 && c == 'y';
                } else {
                    ok = check(jobs[t].dst, len);
                }
                if (!ok) {
                    fprintf(stderr, "%s: the destination differs from the source\n", mode_name[m]);
                    bad = 1;
                }
                free(jobs[t].lat_us);
            }
            double mops = (double)(batches * batch) / secs / 1e6;
            double gbps = (double)(batches * len) / secs / 1e9;
            if (json) {
                printf("%s{\"mode\":\"%s\",\"threads\":%d,\"batches\":%zu,\"mops\":%.3f,"
                       "\"gb_per_s\":%.3f,\"p50_us\":%.2f,\"p50_mops\":%.3f}",
                       first ? "" : ",", mode_name[m], threads, batches, mops, gbps, p50, p50_mops);
                first = 0;
            } else {
                printf("%-14s threads=%d  batches=%8zu  %7.3f Mops/s  %7.3f GB/s  p50 %8.2f us"
                       "  %7.3f Mops/s at the p50\n",
                       mode_name[m], threads, batches, mops, gbps, p50, p50_mops);
            }
            fflush(stdout);
        }
    }
    if (json)
        printf("]}\n");
    for (int t = 0; t < max_threads; t++) {
        /* the second child holds the first one's pipe too: end both by signal */
        kill(child[t], SIGKILL);
        waitpid(child[t], NULL, 0);
    }
    return bad;
}
