"""The short soak in CI: `moebus bench soak` for 20 s on the tiny model. Every moebus process stays
flat, the deliberately leaking control is flagged by the same code, and the mixed load ran."""
import json
import subprocess
import sys


def test_short_soak_is_flat_and_flags_the_leaking_control(tiny_model):
    out = subprocess.run([sys.executable, "-m", "moebus.cli", "bench", "soak", "--duration-s", "20", "--model",
                          str(tiny_model), "--device", "cpu", "--json"], capture_output=True, text=True, timeout=300)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["control_flagged"], report
    assert report["moebus_flat"], [(p["name"], p["rss_mib_per_min"]) for p in report["processes"]]
    assert out.returncode == 0
    load = report["load"]
    assert all(load.get(kind, 0) > 0 for kind in ("generate", "cancel", "http", "bad", "vram")), load
    assert not [k for k in load if "failed" in k], load
    names = {p["name"] for p in report["processes"]}
    assert {"serve", "api", "worker 0", "worker 1", "leak control"} <= names, names
