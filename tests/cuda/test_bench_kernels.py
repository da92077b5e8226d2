"""The GPU benchmark runs once, unattended: its --tiny mode runs every case under the simulator."""
from moebus.bench import kernels as bench_kernels


def test_tiny_bench_runs_every_case_without_errors(capsys):
    assert bench_kernels.main(["--tiny", "--reps", "1", "--warmup", "0"]) == 0
    table = capsys.readouterr().out.split("\n\nop ")[1]
    assert "ERROR" not in table
    for op in ("embedding", "embedding host", "rmsnorm", "linear lm_head", "expert_ffn", "attention", "sample greedy", "topk_softmax",
               "add_rmsnorm", "combine_add_rmsnorm", "route_pairs", "norm_route", "linear qkv", "gemm qkv", "gemm expert down"):
        assert op in table
