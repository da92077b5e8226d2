"""tools/device/vis18_capture.py, the reader of a vision-cycle log: for each vision worker's first encode,
the deferred capture's ms and parts and the text steps beside its window (or, where no capture followed within
a second, beside the same length after the reply) against their kind's median in the second after."""
import importlib.util
import pathlib

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "tools" / "device" / "vis18_capture.py"
STEPS = """\
2026-12-03 14:30:16,300 moebus.worker[1] INFO gpu0 step 314: 2 tokens, 6.00 ms, 0.16 ms after the last
2026-12-03 14:30:16,312 moebus.vision[2] INFO encode 1: 1 image(s), decode and preprocess 13.9 ms, tower 204.4 ms (new shape, eager), of it the weights' copy 54.0 ms
2026-12-03 14:30:16,320 moebus.worker[1] INFO gpu0 step 315: 2 tokens, 7.30 ms, 0.19 ms after the last
2026-12-03 14:30:16,352 moebus.worker[1] INFO gpu0 step 317: 758 tokens, 20.40 ms, 4.09 ms after the last
2026-12-03 14:30:16,393 moebus.worker[1] INFO gpu0 step 319: 758 tokens, 29.50 ms, 0.18 ms after the last
{capture}2026-12-03 14:30:16,480 moebus.worker[1] INFO gpu0 step 320: 2 tokens, 5.00 ms, 0.31 ms after the last
2026-12-03 14:30:16,500 moebus.worker[1] INFO gpu0 step 321: 758 tokens, 14.50 ms, 0.18 ms after the last
"""
CAPTURE = ("2026-12-03 14:30:16,376 moebus.vision[2] INFO tower graph of the last image size captured after its reply: "
           "59.8 ms (staging pinned 0.4 ms, launches recorded 40.2 ms, instantiated (and the rest) 18.1 ms, "
           "outputs pinned 1.1 ms)\n")
LATER = ("2026-12-03 14:30:19,000 moebus.vision[2] INFO tower graph of the last image size captured once the GPU "
         "was 3% busy: 61.0 ms\n")


def _reader():
    spec = importlib.util.spec_from_file_location("vis18_capture", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_steps_beside_the_capture_against_their_kinds_median(tmp_path):
    log = tmp_path / "off.log"
    log.write_text(STEPS.format(capture=CAPTURE))
    out, short = _reader().report(str(log), "off", min_beside=3)
    assert "captured after its reply 59.8 ms (staging pinned 0.4 ms" in out[0]
    assert "315 2t 7.3, 317 758t 20.4, 319 758t 29.5" in out[1]  # 314 ended before the capture began
    assert short == ["off #1: tower 204.4 ms (new shape, eager); capture 59.8 ms (pin 0.4 / rec 40.2 / inst 18.1 / "
                     "out 1.1); 3 steps beside, max 29.5, worst +15.0 ms over (decode 5.0, chunk 14.5)"]


def test_without_a_capture_the_window_after_the_reply_and_a_later_capture(tmp_path):
    log = tmp_path / "idle.log"
    log.write_text(STEPS.format(capture="") + LATER)
    out, short = _reader().report(str(log), "idle")
    assert "no capture within 1 s" in out[0] and "captured once the GPU was 3% busy +2.69 s" in out[0]
    assert "315 2t 7.3, 317 758t 20.4, 319 758t 29.5;" in out[1]  # each overlaps the 60 ms after the reply
    assert "no capture in 1 s, one +2.7 s later 61.0 ms (no parts); 3 steps beside" in short[0]
    assert _reader().report(str(log), "idle", min_beside=4)[1] == ["idle: no such encode"]
