"""The image's HEALTHCHECK: GET /health on the api's port answers 200 once every worker is ready."""
import os
import sys
import urllib.request

port = os.environ.get("MOEBUS_API__PORT", "8000")
try:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        sys.exit(0 if response.status == 200 else 1)
except OSError:
    sys.exit(1)
