"""Device code in three rooms: ``kernels/`` (numba.cuda kernels beside their numpy references),
``memory/`` (arena, VMM segments, emulated ledger, step buffers) and ``backends/`` (the cpu and cuda
backends that a stage calls). dtypes.py: how bf16 weights are held in numpy."""
