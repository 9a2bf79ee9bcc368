/* flock made unavailable, as on Lustre mounted without `flock` or a FUSE file system without lock support:
   LD_PRELOADed into a test's processes, flock() fails with ENOSYS (tests/test_locks.py) on every file, or with
   NO_FLOCK_UNDER=PATH set, on the files under PATH only (a shared file system beside a node-local /tmp). */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int flock(int fd, int operation) {
    const char *under = getenv("NO_FLOCK_UNDER");
    if (under && *under) {
        char link[64], path[4096];
        snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
        ssize_t n = readlink(link, path, sizeof path - 1);
        path[n > 0 ? n : 0] = '\0';
        if (strncmp(path, under, strlen(under)) != 0) {
            int (*real_flock)(int, int) = (int (*)(int, int))dlsym(RTLD_NEXT, "flock");
            return real_flock(fd, operation);
        }
    }
    errno = ENOSYS;
    return -1;
}
