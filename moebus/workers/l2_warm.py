"""Weights asked into L2 on a second branch of a decode step (loads.l2_warm_cuda), while the main
branch runs kernels that leave most SMs idle: the o projection's during the attention (forked after
the qkv GEMV: qkv_rope_store, the attention's splits and their merge run meanwhile), and, behind its
own switch, the next layer's qkv during the experts. Nothing reads what the branch does, so the
results are the same with it or without; the GEMV after it finds its lines in L2. Switches:
loads.WARM_O_PROJ, loads.WARM_NEXT_QKV (read at each step, so a recaptured graph follows them)."""
from __future__ import annotations

from moebus.cuda.kernels import loads


class WarmBranch:
    def __init__(self, ops):
        self.ops = ops
        self.side = None  # graphs.SideBranch, made on first use
        self.open = False

    @staticmethod
    def wanted(ops) -> bool:
        return ops.name == "cuda" and (loads.WARM_O_PROJ or loads.WARM_NEXT_QKV or bool(loads.WARM_EXPERTS))

    def begin(self) -> None:
        """Start of a step's run: no branch is open (a failed capture may have left one)."""
        self.open = False
        if self.side is not None:
            self.side.forks = 0

    def ahead(self, weight) -> None:
        """Fork: ``weight`` into L2 on the side, after what the main branch has so far (the branch
        before it joined first: one open at a time)."""
        loads.l2_warm_cuda(weight, stream=self._fork())

    def experts_ahead(self, arena, pair_slot, hidden: int, inter: int) -> None:
        """Fork: the routed experts' weights (loads.WARM_EXPERTS: "down" or "all") from their arena
        slots into L2 while the expert GEMVs read them (arena: bf16 / f16 blobs, moe.py's layout)."""
        first = 2 * hidden * inter * arena.dtype.itemsize if loads.WARM_EXPERTS == "down" else 0
        loads.l2_warm_slots_cuda(arena, pair_slot, first, 3 * hidden * inter * arena.dtype.itemsize - first,
                                 stream=self._fork())

    def _fork(self):
        from moebus.cuda.backends.graphs import SideBranch

        self.join()
        self.side = self.side or SideBranch()
        self.side.fork(self.ops.stream)
        self.open = True
        return self.side.stream

    def join(self) -> None:
        """What the main branch launches from now on runs after the side branch's work."""
        if self.open:
            self.side.join(self.ops.stream)
            self.open = False
