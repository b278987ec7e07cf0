#!/bin/sh
# Make sure vllm-router (PyPI; a Rust binary in a wheel) is installed for the router test
# in tests/test_scale_replicas.py. It goes into its own virtual environment, never the
# project's: $STREAMGATE_CACHE/vllm-router (default ~/.cache/streamgate/vllm-router).
set -eu

DIR="${STREAMGATE_CACHE:-$HOME/.cache/streamgate}/vllm-router"
if [ -x "$DIR/bin/vllm-router" ]; then
    exit 0
fi
echo "ensure_router: installing vllm-router 0.1.17 into $DIR for the router test (once)" >&2
python3 -m venv "$DIR"
"$DIR/bin/pip" install --quiet "vllm-router==0.1.17"
