#!/bin/sh
# Make sure Debian's redis-server is installed for the Redis quota tests
# (tests/test_quota_redis*.py start their own server on a free port; nothing runs as a
# service). Exit 0 when redis-server exists; install it when running as root; otherwise
# print the one command to run and exit 1.
set -eu

if command -v redis-server >/dev/null 2>&1; then
    exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
    echo "ensure_redis: installing Debian's redis-server for the Redis quota tests (once)" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server
    exit 0
fi
echo "ensure_redis: the Redis quota tests need Debian's redis-server; run:" >&2
echo "    sudo apt-get install -y redis-server" >&2
exit 1
