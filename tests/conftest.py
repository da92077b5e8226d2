"""Test-wide setup. numba reads NUMBA_ENABLE_CUDASIM when it is first imported, so it is set here,
before any test module imports numba: without a GPU the cuda kernels run in numba's simulator.
Set MOEBUS_TEST_GPU=1 to run the same tests on a real GPU."""
import os

if os.environ.get("MOEBUS_TEST_GPU") != "1":
    os.environ.setdefault("NUMBA_ENABLE_CUDASIM", "1")
