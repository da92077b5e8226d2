"""tools/device/gap15_gaps.py, the reader of a vision-cycle log: each of the largest gaps (one of the
pair two streams of a batch share) with the worker lines stamped within it, in ms after the image was
sent, and the call's short summary."""
import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "device" / "gap15_gaps.py"
LOG = """\
2026-12-03 06:44:46,405 moebus.worker[1] INFO gpu0 VRAM 1536.0: 508 expert slots, 1.9 ms (0.2 waiting for admissions, -31 segments, 7 experts moved down)
2026-12-03 06:44:46,431 moebus.worker[1] INFO gpu0: INFO took 21.0 ms (the driver's free memory 20.2 ms)
2026-12-03 06:44:46,432 moebus.worker[1] INFO gpu0 step 228: 2 tokens, 5.10 ms, 21.30 ms after the last
2026-12-03 06:44:46,432 moebus.worker[1] INFO gpu0: step 228 came 21.3 ms after the last one ended
2026-12-03 06:44:46,433 moebus.cublas[2] INFO cuBLAS gemm m 1152 n 729 k 588 batch 1 took 44.9 ms of host time
2026-12-03 06:44:47,900 moebus.worker[1] INFO gpu0 step 400: 512 tokens, 16.40 ms, 0.30 ms after the last
cold image request 2 of 2: handback 287.5 ms, start 342.5 ms, encode 279.2 ms, prefill 1897.5 ms, first_token 2809.9 ms (24 hand-back requests)
  start                 342.5    86        7.2     25.6       3.56              42      8.0       7.3             23.9  296.6    9.1
  largest gaps by phase (ms: from - to after the image was sent, phase): 25.6: 296 - 322 start, 25.5: 296 - 323 start, 20.4: 1766 - 1786 prefill
  the image was sent at 2026-12-03 06:44:46,110 (the log lines' clock)
text streams' largest gap through hand-back, start and encode / their median before (worst stream): 4.74 (target <= 2): False
text streams' largest gap through the whole cold start, to the image's last token / their median before (worst stream): 4.74 (target <= 2): False
"""


def _reader():
    spec = importlib.util.spec_from_file_location("gap15_gaps", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_largest_gap_gets_the_lines_stamped_within_it(tmp_path, capsys):
    path = tmp_path / "cycle.log"
    path.write_text(LOG)
    reader = _reader()
    sent, gaps, lines = reader.read(str(path))
    assert [g[3] for g in reader.distinct(gaps, 3)] == ["start", "prefill"]  # the pair of streams counted once
    assert len(lines) == 5  # the vision worker's cuBLAS loads are gap12.py's
    assert reader.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "gap 25.6 ms, 296 - 322 ms after the image was sent, in start:" in out
    assert "228 2t: 5.1 (+21.3)" in out and "  321.0  worker: gpu0: INFO took 21.0 ms" in out
    assert "gap 20.4 ms" in out and "400 512t: 16.4 (+0.3)" in out  # stamped at its end, 1790 ms: in the margin
    summary = reader.summary(str(path), "default", 3, 6.0)
    assert summary[0].startswith("default: 4.74x until encoded, 4.74x whole; handback 287, start 342")
    assert "start 7.2/25.6 (step 8.0, miss 23.9)" in summary[1]
    assert summary[2].startswith("  25.6 start 296-322: 295 VRAM 1536.0: 508 expert slots, 1.9 ms; 321 INFO took 21.0 ms "
                                 "(the driver's free memory 20.2 ms); 322 step 228 came 21.3")
