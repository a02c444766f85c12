// Preloaded before libfaketime into a gateway under test (Tests/RedisTestSupport/SkewedClock.swift).
//
// libfaketime shifts every absolute timerfd deadline by its offset, whatever the timer's clock and
// even with FAKETIME_DONT_FAKE_MONOTONIC=1. Swift's Dispatch arms its timers that way on the
// monotonic clock, so under FAKETIME=-30s a one-second Task.sleep took 31 s, and under +30s it
// fired at once and spun a core. A machine whose wall clock is off does neither: its monotonic
// timers keep true time. Here, timers on any clock but the wall clock go straight to the kernel;
// wall-clock timers still go through libfaketime.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

enum { tracked = 65536 };
static clockid_t clocks[tracked];

int timerfd_create(int clockid, int flags) {
    int fd = (int)syscall(SYS_timerfd_create, clockid, flags);
    if (fd >= 0 && fd < tracked) clocks[fd] = clockid;
    return fd;
}

int timerfd_settime(int fd, int flags, const struct itimerspec *value, struct itimerspec *old) {
    if (fd >= 0 && fd < tracked && clocks[fd] != CLOCK_REALTIME && clocks[fd] != CLOCK_REALTIME_ALARM) {
        return (int)syscall(SYS_timerfd_settime, fd, flags, value, old);
    }
    int (*next)(int, int, const struct itimerspec *, struct itimerspec *) = dlsym(RTLD_NEXT, "timerfd_settime");
    return next(fd, flags, value, old);
}
