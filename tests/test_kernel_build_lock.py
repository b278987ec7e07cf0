"""The kernels' build lock (engine/kernels.py `builder`): a process building or loading in a
directory holds an flock there; the next one waits for it while it lives, and once it has been
killed mid-build takes over at once, removing the `lock` baton torch left behind (torch waits
on a baton forever; before this, only one older than 15 minutes was removed)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

from engine import kernels

HOLDER = """
import sys, time
from pathlib import Path
from engine import kernels
d = Path(sys.argv[1])
with kernels.builder(d):
    (d / "lock").touch()            # torch's baton, taken by the build this process is running
    print("building", flush=True)
    time.sleep(120)                 # killed before it ends: the baton stays
"""


def test_a_baton_left_by_a_killed_build_is_removed_not_waited_on(tmp_path):
    (tmp_path / "lock").touch()
    with kernels.builder(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_is_waited_for_and_a_killed_one_taken_over(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parent.parent)
    try:
        assert holder.stdout.readline().strip() == "building"
        entered, baton_seen = threading.Event(), []

        def take() -> None:
            with kernels.builder(tmp_path):
                baton_seen.append((tmp_path / "lock").exists())
                entered.set()

        waiter = threading.Thread(target=take, daemon=True)
        waiter.start()
        assert not entered.wait(0.5)                  # the live builder keeps it out
        assert (tmp_path / "lock").exists()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        assert entered.wait(30)                       # the OS dropped the killed holder's flock
        assert baton_seen == [False]                  # its baton removed before the waiter went on
        waiter.join(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
