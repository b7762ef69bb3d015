/* The tail of the simulated accelerator's wait (executor_svc/fakes/simulated.py): spin until a CLOCK_MONOTONIC deadline
 * (the clock of Python's time.perf_counter on Linux). ctypes calls it without the GIL, as a CUDA synchronize spins
 * without it; a kernel timer alone wakes late on the development VM, time no GPU adds to a step. */
#include <time.h>

void spin_until(double deadline_s) {
    struct timespec now;
    do {
        clock_gettime(CLOCK_MONOTONIC, &now);
    } while ((double)now.tv_sec + 1e-9 * (double)now.tv_nsec < deadline_s);
}
