// Preloaded into a redis-server under test: shifts its wall clock by PRESENCE_CLOCK_OFFSET_MS
// milliseconds (may be negative) and nothing else, as a machine whose clock is off would be.
//
// libfaketime cannot be used here: redis-server's allocator reads the clock while libfaketime
// itself is starting, and libfaketime gives up on that recursion (the server never starts).
// This shim calls the kernel directly and reads its offset once, with no allocation.
#define _GNU_SOURCE
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static long long offset_ns(void) {
    static int read;
    static long long offset;
    if (!read) {
        const char *text = getenv("PRESENCE_CLOCK_OFFSET_MS");
        offset = text ? atoll(text) * 1000000LL : 0;
        read = 1;
    }
    return offset;
}

static int wall_clock(clockid_t id) {
    return id == CLOCK_REALTIME || id == CLOCK_REALTIME_COARSE || id == CLOCK_TAI;
}

int clock_gettime(clockid_t id, struct timespec *now) {
    int result = (int)syscall(SYS_clock_gettime, id, now);
    if (result == 0 && wall_clock(id)) {
        long long ns = (long long)now->tv_sec * 1000000000LL + now->tv_nsec + offset_ns();
        now->tv_sec = (time_t)(ns / 1000000000LL);
        now->tv_nsec = (long)(ns % 1000000000LL);
    }
    return result;
}

int gettimeofday(struct timeval *restrict now, void *restrict zone) {
    (void)zone;
    struct timespec spec;
    int result = clock_gettime(CLOCK_REALTIME, &spec);
    if (result == 0 && now) {
        now->tv_sec = spec.tv_sec;
        now->tv_usec = spec.tv_nsec / 1000;
    }
    return result;
}

time_t time(time_t *out) {
    struct timespec spec;
    clock_gettime(CLOCK_REALTIME, &spec);
    if (out) *out = spec.tv_sec;
    return spec.tv_sec;
}
