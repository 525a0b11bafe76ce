/* The chaos soak's slow disk (scripts/benchmarks/chaos_faults.py, `slow_disk`): preloaded into the server and its
 * workers, it delays every fsync and fdatasync by the milliseconds written in the file CHAOS_FSYNC_DELAY_FILE names
 * (0, or no file: no delay), so the harness can make the disk slow and fast again while they run. Why a preload and
 * not a slow device: this box has no device-mapper (dm-delay) and no FUSE library, and the delay belongs where the
 * server waits for durability: the journal's fsync before a 202, a checkpoint's before it counts. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static long delay_ms(void) {
    const char *path = getenv("CHAOS_FSYNC_DELAY_FILE");
    long ms = 0;
    FILE *file = path ? fopen(path, "r") : NULL;
    if (file) {
        if (fscanf(file, "%ld", &ms) != 1) ms = 0;
        fclose(file);
    }
    return ms;
}

static void wait_ms(long ms) {
    if (ms > 0) {
        struct timespec pause = {ms / 1000, (ms % 1000) * 1000000L};
        nanosleep(&pause, NULL);
    }
}

int fsync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fsync");
    wait_ms(delay_ms());
    return real(fd);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = (int (*)(int))dlsym(RTLD_NEXT, "fdatasync");
    wait_ms(delay_ms());
    return real(fd);
}
