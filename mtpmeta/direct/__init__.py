"""The CPU backend (``DirectBackend``): the device is the CPU, so the numba kernels write
the persistent buffers and the destination view in place, with no staging."""
