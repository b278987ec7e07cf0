#!/bin/sh
# Make sure Debian's chromium is installed for the browser tests (tests/test_browser.py).
# Exit 0 when /usr/bin/chromium exists; install it when running as root; otherwise print
# the one command to run and exit 1.
set -eu

if [ -x /usr/bin/chromium ]; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    echo "ensure_chromium: installing Debian's chromium for the browser tests (a few minutes, once)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium
    exit 0
fi
echo "ensure_chromium: the browser tests need Debian's chromium; run:" >&2
echo "    sudo apt-get install -y chromium" >&2
exit 1
