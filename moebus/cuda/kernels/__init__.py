"""numba.cuda kernels, one op family per file: the kernels, their launch wrapper (shape, dtype and
contiguity checks, the grid) and the plain-numpy reference the tests compare them with. compat.py is
where kernels meet numba (GPU vs simulator), loads.py the weight reads, launch.py the wrappers'
helpers, kernel_cache.py where compiled kernels are kept between processes."""
