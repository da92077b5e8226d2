"""Run a script or module with the kernel constants of a CHOICES file (decode6_variants.py's) set
first, so a bench measures the work shapes the variants picked. Usage:
decode6_apply.py CHOICES (-m MODULE | SCRIPT) [ARGS...]; a missing CHOICES file changes nothing."""
import importlib
import json
import os
import runpy
import sys


def apply(path: str) -> None:
    if not os.path.exists(path):
        print(f"{path}: none, the defaults stay", flush=True)
        return
    with open(path) as f:
        for key, value in json.load(f).items():
            module, name = key.rsplit(".", 1)
            setattr(importlib.import_module(f"moebus.cuda.kernels.{module}"), name, value)
            print(f"set {key} = {value}", flush=True)


def main() -> None:
    apply(sys.argv[1])
    if sys.argv[2] == "-m":
        sys.argv = [sys.argv[3]] + sys.argv[4:]
        runpy.run_module(sys.argv[0], run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
