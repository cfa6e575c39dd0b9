"""The worker's place: the launcher's layout, the process group, the checks before a multi-machine job, the CPU's
threads, and what keeps a worker up (signals, hangs, a dead launcher, the run lock)."""
