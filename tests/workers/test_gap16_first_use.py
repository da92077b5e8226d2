"""tools/device/gap16_first_use.py, the reader of a worker's slow steps: the start lines' kernel counts,
each slow step with the kernels it loaded or compiled and its stack samples grouped, the full collections."""
import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "device" / "gap16_first_use.py"
LOG = """\
2026-12-03 08:34:42,288 moebus.worker[2948] INFO gpu0 kernels: 42 loaded from the disk cache, 1 compiled (rope_kernel)
2026-12-03 08:34:44,215 moebus.vision[2960] INFO vision worker kernels: 1 loaded from the disk cache, 0 compiled
2026-12-03 08:34:46,000 moebus.worker[2948] INFO gpu0: step 2 running for 512 ms: compiler.py:10 compile < dispatcher.py:5 call < stage.py:3 forward
2026-12-03 08:34:46,500 moebus.worker[2948] INFO gpu0: step 2 running for 1012 ms: compiler.py:11 compile < dispatcher.py:5 call | stage.py:3 forward
2026-12-03 08:34:47,000 moebus.worker[2948] INFO gpu0: step 2 running for 1512 ms: compiler.py:11 compile < dispatcher.py:5 call | stage.py:3 forward
2026-12-03 08:34:47,338 moebus.worker[2948] INFO gpu0: a garbage collection of generation 2 took 250.1 ms (163959 objects collected)
2026-12-03 08:34:48,391 moebus.worker[2948] INFO gpu0 step 2: 9 tokens, 2471.50 ms, 1362.60 ms after the last
2026-12-03 08:34:48,391 moebus.worker[2948] INFO gpu0: step 2 took 2471.5 ms; kernels loaded / compiled since the last report: prefill +0/+2
2026-12-03 08:34:48,418 moebus.worker[2948] INFO gpu0 step 3: 3 tokens, 27.22 ms, 0.22 ms after the last
"""


def test_slow_steps_with_their_kernels_samples_and_collections(tmp_path):
    spec = importlib.util.spec_from_file_location("gap16_first_use", SCRIPT)
    reader = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reader)
    log = tmp_path / "cycle.log"
    log.write_text(LOG)
    out = reader.read(str(log), 300.0, 2)
    assert out[0] == "starts: gpu0 kernels: 42 loaded from the disk cache, 1 compiled (rope_kernel)"
    assert out[1] == "starts: vision worker kernels: 1 loaded from the disk cache, 0 compiled"
    assert out[2] == "gpu0 step 2: 9 tokens, 2472 ms; kernels +loaded/+compiled: prefill +0/+2"
    assert out[3] == "  2 x compiler.py:11 compile < dispatcher.py:5 call | stage.py:3 forward"
    assert out[4] == "  1 x compiler.py:10 compile < dispatcher.py:5 call"
    assert out[5] == "1 steps over 300 ms; full collections: 1, at most 163959 objects, the longest 250.1 ms"
