"""Device code: one op family per file (numba.cuda kernels, launch wrapper, numpy reference), the
device backends that the stage calls, and the expert arena."""
