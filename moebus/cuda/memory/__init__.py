"""Device memory: the expert arena (arena.py) over the VMM segments that really go back to the
driver (vmm.py), the emulated GPUs' cross-process ledger for the cpu device (ledger.py), per-step
buffers (step_pool.py, where the prompt-path loan's scratch is carved), and how much memory each
GPU has without creating a context (devices.py)."""
