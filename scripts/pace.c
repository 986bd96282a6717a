/*
 * A link of a given rate in front of one process: every byte the process writes to a TCP
 * socket leaves at no more than SSF_PACE_BYTES_PER_S, after a burst of SSF_PACE_BURST
 * bytes (default 256 KiB, tbf's burst in scripts/cluster.py). Loaded with LD_PRELOAD into
 * each rank of a job, it puts each rank behind its own egress link where `tc` cannot be
 * used (a container without iproute2 or without the kernel's qdiscs, e.g. the lent GPU
 * machines). scripts/bench_e2e.py --shaper pace builds and loads it.
 *
 *   cc -O2 -shared -fPIC -o libssfpace.so scripts/pace.c -ldl -lpthread
 *   LD_PRELOAD=$PWD/libssfpace.so SSF_PACE_BYTES_PER_S=125000000 python ...
 *
 * What it models and what not:
 * - The process's egress only, shared by all its TCP sockets and threads (one NIC). A
 *   collective whose ranks each send what they receive (ring allreduce, ring allgather,
 *   torch's gloo algorithms) is then paced as on full-duplex links of that rate; ingress
 *   beyond the peers' egress is not limited.
 * - No added delay and no loss: the round trip is the loopback's.
 * - Writes are cut into pieces of at most SSF_PACE_CHUNK bytes (default 64 KiB), each sent
 *   when the bucket allows it; a socket that takes fewer bytes than offered (non-blocking,
 *   buffer full) gets the unsent part's time back. The caller sees a short write, which
 *   every TCP user handles.
 * Sockets are recognized once per descriptor (SOCK_STREAM of AF_INET/AF_INET6) and
 * forgotten at close(), socket(), accept() and dup2() of that descriptor.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define MAX_FD 65536
enum { UNKNOWN = 0, PACED = 1, NOT_PACED = 2 };

static unsigned char kind[MAX_FD];
static double rate;                 /* bytes per ns; 0: pacing off */
static double burst_ns;             /* the burst, as time at `rate` */
static size_t chunk = 64 << 10;
static int64_t free_at;             /* virtual time the link has sent everything given so far */
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static ssize_t (*real_write)(int, const void *, size_t);
static ssize_t (*real_writev)(int, const struct iovec *, int);
static ssize_t (*real_send)(int, const void *, size_t, int);
static ssize_t (*real_sendto)(int, const void *, size_t, int, const struct sockaddr *, socklen_t);
static ssize_t (*real_sendmsg)(int, const struct msghdr *, int);
static int (*real_close)(int);
static int (*real_dup2)(int, int);
static int (*real_socket)(int, int, int);
static int (*real_accept)(int, struct sockaddr *, socklen_t *);
static int (*real_accept4)(int, struct sockaddr *, socklen_t *, int);

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static double env_number(const char *name, double fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    double x = strtod(v, &end);
    return end == v ? fallback : x;
}

__attribute__((constructor)) static void init(void) {
    real_write = dlsym(RTLD_NEXT, "write");
    real_writev = dlsym(RTLD_NEXT, "writev");
    real_send = dlsym(RTLD_NEXT, "send");
    real_sendto = dlsym(RTLD_NEXT, "sendto");
    real_sendmsg = dlsym(RTLD_NEXT, "sendmsg");
    real_close = dlsym(RTLD_NEXT, "close");
    real_dup2 = dlsym(RTLD_NEXT, "dup2");
    real_socket = dlsym(RTLD_NEXT, "socket");
    real_accept = dlsym(RTLD_NEXT, "accept");
    real_accept4 = dlsym(RTLD_NEXT, "accept4");
    double bps = env_number("SSF_PACE_BYTES_PER_S", 0);
    rate = bps > 0 ? bps / 1e9 : 0;
    if (rate > 0) burst_ns = env_number("SSF_PACE_BURST", 256 << 10) / rate;
    double c = env_number("SSF_PACE_CHUNK", 0);
    if (c >= 1) chunk = (size_t)c;
    free_at = now_ns();
}

static void forget(int fd) {
    if (fd >= 0 && fd < MAX_FD) kind[fd] = UNKNOWN;
}

static int paced(int fd) {
    if (rate <= 0 || fd < 0) return 0;
    if (fd >= MAX_FD) return 0;
    if (kind[fd] == UNKNOWN) {
        int type = 0;
        socklen_t len = sizeof type;
        struct sockaddr_storage a;
        socklen_t alen = sizeof a;
        int tcp = getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) == 0 && type == SOCK_STREAM
                  && getsockname(fd, (struct sockaddr *)&a, &alen) == 0
                  && (a.ss_family == AF_INET || a.ss_family == AF_INET6);
        kind[fd] = tcp ? PACED : NOT_PACED;
    }
    return kind[fd] == PACED;
}

/* Reserves n bytes of the link and sleeps until they may leave. */
static void take(size_t n) {
    pthread_mutex_lock(&lock);
    int64_t t = now_ns();
    /* free_at: when the link will have sent all it was given (an idle link: now); a write
     * leaves once what is ahead of its end fits in a burst */
    if (free_at < t) free_at = t;
    free_at += (int64_t)(n / rate);
    int64_t leave = free_at - (int64_t)burst_ns;
    pthread_mutex_unlock(&lock);
    if (leave > t) {
        struct timespec d = {(leave - t) / 1000000000LL, (leave - t) % 1000000000LL};
        while (nanosleep(&d, &d) != 0 && errno == EINTR) {}
    }
}

/* Gives back the time of bytes reserved but not taken by the socket; returns the write's
 * result with its errno as the write left it. */
static ssize_t settle(size_t reserved, ssize_t sent) {
    size_t unsent = sent < 0 ? reserved : reserved - (size_t)sent;
    if (!unsent) return sent;
    int saved = errno;
    pthread_mutex_lock(&lock);
    free_at -= (int64_t)(unsent / rate);
    pthread_mutex_unlock(&lock);
    errno = saved;
    return sent;
}

ssize_t write(int fd, const void *buf, size_t n) {
    if (!paced(fd) || n == 0) return real_write(fd, buf, n);
    if (n > chunk) n = chunk;
    take(n);
    return settle(n, real_write(fd, buf, n));
}

ssize_t send(int fd, const void *buf, size_t n, int flags) {
    if (!paced(fd) || n == 0) return real_send(fd, buf, n, flags);
    if (n > chunk) n = chunk;
    take(n);
    return settle(n, real_send(fd, buf, n, flags));
}

ssize_t sendto(int fd, const void *buf, size_t n, int flags, const struct sockaddr *to, socklen_t tl) {
    if (!paced(fd) || n == 0) return real_sendto(fd, buf, n, flags, to, tl);
    if (n > chunk) n = chunk;
    take(n);
    return settle(n, real_sendto(fd, buf, n, flags, to, tl));
}

/* The first entries of iov that hold at most `chunk` bytes, the last one cut: written to
 * `out` (at most IOV_MAX entries); returns the count and sets *bytes. */
static int trim(const struct iovec *iov, int cnt, struct iovec *out, size_t *bytes) {
    size_t total = 0;
    int k = 0;
    for (int i = 0; i < cnt && total < chunk && k < 1024; i++) {
        if (iov[i].iov_len == 0) continue;
        out[k] = iov[i];
        if (total + out[k].iov_len > chunk) out[k].iov_len = chunk - total;
        total += out[k].iov_len;
        k++;
    }
    *bytes = total;
    return k;
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    if (!paced(fd) || cnt <= 0) return real_writev(fd, iov, cnt);
    struct iovec cut[1024];
    size_t n;
    int k = trim(iov, cnt, cut, &n);
    if (n == 0) return real_writev(fd, iov, cnt);
    take(n);
    return settle(n, real_writev(fd, cut, k));
}

ssize_t sendmsg(int fd, const struct msghdr *msg, int flags) {
    if (!paced(fd) || msg->msg_iovlen == 0) return real_sendmsg(fd, msg, flags);
    struct iovec cut[1024];
    size_t n;
    int k = trim(msg->msg_iov, (int)msg->msg_iovlen, cut, &n);
    if (n == 0) return real_sendmsg(fd, msg, flags);
    struct msghdr m = *msg;
    m.msg_iov = cut;
    m.msg_iovlen = k;
    take(n);
    return settle(n, real_sendmsg(fd, &m, flags));
}

int close(int fd) {
    forget(fd);
    return real_close(fd);
}

int dup2(int from, int to) {
    forget(to);
    return real_dup2(from, to);
}

int socket(int domain, int type, int protocol) {
    int fd = real_socket(domain, type, protocol);
    forget(fd);
    return fd;
}

int accept(int fd, struct sockaddr *a, socklen_t *l) {
    int c = real_accept(fd, a, l);
    forget(c);
    return c;
}

int accept4(int fd, struct sockaddr *a, socklen_t *l, int flags) {
    int c = real_accept4(fd, a, l, flags);
    forget(c);
    return c;
}
