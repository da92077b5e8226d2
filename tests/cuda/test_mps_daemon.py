"""``mps: true``'s private daemon on a GPU (broker/mps.py): it starts and answers, a process given its
pipes becomes its client (the daemon starts a server for it), and ``stop`` ends it. And the vision
worker's priority variable is harmless where no MPS server runs (it is set on every cuda service)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moebus.broker.mps import CONTROL, MpsDaemon
from moebus.cuda.backends.graphs import graphs_available

pytestmark = pytest.mark.skipif(not graphs_available() or shutil.which(CONTROL) is None,
                                reason="needs a GPU and NVIDIA's nvidia-cuda-mps-control")
ROOT = Path(__file__).resolve().parents[2]
CLIENT = ("from moebus.cuda.kernels.compat import cuda\nimport numpy as np\n"
          "a = cuda.to_device(np.arange(1024, dtype=np.float32))\nprint(int(a.copy_to_host().sum()))")


def _client(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", CLIENT], cwd=ROOT, env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=120)


def test_a_worker_given_the_pipes_is_a_client_of_the_private_server(tmp_path):
    daemon = MpsDaemon(tmp_path, MpsDaemon.find_binary())
    daemon.start()
    try:
        assert daemon._ask("get_server_list").stdout.strip() == ""  # no client yet: no server
        run = _client(dict(daemon.env, CUDA_MPS_CLIENT_PRIORITY="1"))
        assert run.returncode == 0 and run.stdout.strip() == str(sum(range(1024))), run.stderr[-2000:]
        assert daemon._ask("get_server_list").stdout.strip().isdigit()  # the server it started for the client
        proc = daemon.proc
    finally:
        daemon.stop()
    assert daemon.proc is None and proc.poll() is not None


def test_the_priority_variable_without_a_server_changes_nothing():
    run = _client({"CUDA_MPS_CLIENT_PRIORITY": "1"})  # (no daemon on the default pipes of the GPU machine)
    assert run.returncode == 0 and run.stdout.strip() == str(sum(range(1024))), run.stderr[-2000:]
