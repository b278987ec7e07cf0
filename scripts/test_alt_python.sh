#!/usr/bin/env bash
# The gateway's tests that need no torch (fake engine, real uvicorn, real SQLite, real
# redis-server) on a second interpreter, because asyncio's behaviour differs between
# versions (on 3.12+ a task cancelled before its first step never runs its body: issue 25).
#
# The interpreter is the first of ALT_PYTHONS that runs: pyenv's builds of 3.13 and 3.12 where
# the machine has them (the development and CI machines' image does, beside its 3.11; pyenv's
# shims refuse versions not selected, so their binaries are named directly), else python3.13
# or python3.12 on PATH. Debian 12 ships only Python 3.11, and PyPI has no interpreter package
# that does not download its build from elsewhere, so a machine with neither skips this run,
# saying so.
set -euo pipefail
pyenv_root=${PYENV_ROOT:-$HOME/.pyenv}
ALT_PYTHONS=${ALT_PYTHONS:-"$(ls -d "$pyenv_root"/versions/3.13*/bin/python3.13 "$pyenv_root"/versions/3.12*/bin/python3.12 2>/dev/null | tr '\n' ' ') python3.13 python3.12"}
ALT_VENV=${ALT_VENV:-.venv-alt}
MAIN_PY=${MAIN_PY:-.venv/bin/python}
TESTS=(tests/test_gateway_hardening.py tests/test_ledger_fails_closed.py tests/test_gateway_stats.py
       tests/test_chat_service.py tests/test_tenants_quota.py tests/test_tenants_ledger.py
       tests/test_tenants_registry.py tests/test_quota_redis_idempotent.py tests/test_quota_redis_failures.py
       tests/test_policy_bounded.py tests/test_prefix_salt.py tests/test_gateway_stop_billing.py)
PACKAGES="starlette uvicorn websockets sse-starlette httpx httpcore h11 httptools anyio structlog pydantic
          pydantic_core prometheus_client pytest pytest-asyncio redis hypothesis"

alt=""
for candidate in $ALT_PYTHONS; do
    if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import sys' 2>/dev/null; then
        alt=$candidate; break
    fi
done
if [ -z "$alt" ]; then
    echo "test-alt-python: skipped: none of '$ALT_PYTHONS' is installed (Debian 12 has only 3.11; PyPI has no interpreter)"
    exit 0
fi
version=$("$alt" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
stamp="$ALT_VENV/.installed-$version"
if [ ! -f "$stamp" ]; then
    rm -rf "$ALT_VENV"
    "$alt" -m venv "$ALT_VENV"
    # The same versions as the main environment (its freeze), torch and the model stack left out.
    pattern=$(echo $PACKAGES | tr ' ' '|')
    "$MAIN_PY" -m pip freeze | grep -iE "^($pattern)==" > "$ALT_VENV/requirements.txt"
    "$ALT_VENV/bin/python" -m pip install --quiet -r "$ALT_VENV/requirements.txt"
    touch "$stamp"
fi
echo "test-alt-python: Python $version"
# --noconftest: tests/conftest.py imports torch for the model tests; these need none.
PYTHONPATH=$PWD "$ALT_VENV/bin/python" -m pytest -q --noconftest -p no:cacheprovider "${TESTS[@]}"
