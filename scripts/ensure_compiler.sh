#!/bin/sh
# Make sure a C++ compiler and the Python headers are there to build the paged attention
# kernel (csrc/, built by `python -m engine.kernels` in `make setup`). Exit 0 when both exist;
# install Debian's g++ / python3-dev when running as root; otherwise print the command and exit 1.
set -eu

PY=${PY:-.venv/bin/python}
headers=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
need=""
command -v g++ >/dev/null 2>&1 || need=" g++"
[ -f "$headers/Python.h" ] || need="$need python3-dev"
if [ -z "$need" ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    echo "ensure_compiler: installing $need to build the paged attention kernel (once)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $need
    exit 0
fi
echo "ensure_compiler: building the paged attention kernel needs$need; run:" >&2
echo "    sudo apt-get install -y $need" >&2
exit 1
