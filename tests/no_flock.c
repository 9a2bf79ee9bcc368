/* flock made unavailable, as on Lustre mounted without `flock` or a FUSE file system without lock support:
   LD_PRELOADed into a test's processes, every flock() fails with ENOSYS (tests/test_locks.py). */
#include <errno.h>

int flock(int fd, int operation) {
    (void)fd;
    (void)operation;
    errno = ENOSYS;
    return -1;
}
