"""`python -m chunkwise_tools.serve` leaves no chunkwise process behind when it is stopped with SIGTERM or
SIGHUP (docker stop, systemd, a closed terminal) or killed outright with SIGKILL (issue 16)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4, after the parenthesised name
        if ppid == pid:
            out.append(int(entry.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_stopping_the_launcher_stops_its_services(tiny_llama_dir, sig, tmp_path):
    stderr = (tmp_path / "launcher.stderr").open("w+")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "chunkwise_tools.serve", "--model", str(tiny_llama_dir), "--port", "0", "--quiet",
         "--metrics-port", "-1", "--executor-arg=--dtype", "--executor-arg=float32"],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )
    try:
        for line in launcher.stdout:
            if "chunkwise is serving on" in line:
                break
        children = _children(launcher.pid)
        stderr.seek(0)
        assert len(children) == 2, (children, launcher.poll(), stderr.read()[-3000:])  # executor and scheduler
        launcher.send_signal(sig)
        launcher.wait(60)
        deadline = time.monotonic() + 30
        while any(_alive(c) for c in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [c for c in children if _alive(c)], f"left running after {sig.name}"
        if sig != signal.SIGKILL:
            assert launcher.returncode == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for c in _children(launcher.pid):
            os.kill(c, signal.SIGKILL)
        stderr.close()
