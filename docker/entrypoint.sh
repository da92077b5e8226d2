#!/bin/sh
# The container's command: `moebus "$@"` (default `serve`), after two things moebus does not do
# by itself. The API key comes from MOEBUS_API__API_KEY or, when that is empty, from the file
# $MOEBUS_API_KEY_FILE (default /run/secrets/moebus_api_key, a compose secret). And `serve` / `api`
# refuse to listen on a non-loopback address (the image's default is 0.0.0.0) without a key.
set -eu
[ $# -gt 0 ] || set -- serve
key_file=${MOEBUS_API_KEY_FILE:-/run/secrets/moebus_api_key}
if [ -z "${MOEBUS_API__API_KEY:-}" ] && [ -r "$key_file" ]; then
    MOEBUS_API__API_KEY=$(tr -d '\r\n' < "$key_file")
    export MOEBUS_API__API_KEY
fi
case "$1" in
serve | api)
    python - "$@" <<'PY'
import argparse, ipaddress, sys
from moebus.common.settings import load_settings

flags = argparse.ArgumentParser(add_help=False)
flags.add_argument("--config")
flags.add_argument("--host")
args, _ = flags.parse_known_args(sys.argv[2:])
settings = load_settings(args.config)
host = args.host or settings.api.host
try:
    loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
except ValueError:
    loopback = host == "localhost"
if not loopback and not settings.api.api_key:
    sys.exit(f"moebus: refusing to serve the api on {host} without an API key: set MOEBUS_API__API_KEY "
             "or put the key in the file $MOEBUS_API_KEY_FILE (default /run/secrets/moebus_api_key)")
PY
    ;;
esac
exec moebus "$@"
