"""Processes the tests launch: what runs a script at N ranks, and how a run is ended and waited for.

A launcher's ranks run in sessions of their own and hold its output pipes: killing only the
launcher would leave them running, and reading its output would then wait for them forever.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from hierps.integrations.rendezvous import free_port


def launcher(world: int) -> list[str]:
    """What runs a script at ``world`` ranks on this machine: this Python, or torchrun over loopback."""
    if world == 1:
        return [sys.executable]
    torchrun = str(Path(sys.executable).parent / "torchrun")
    return [torchrun, f"--nproc_per_node={world}", "--master_addr=127.0.0.1", f"--master_port={free_port()}"]


def kill_tree(proc: subprocess.Popen, first: signal.Signals | None = None) -> None:
    """SIGKILL ``proc`` and every process under it; with ``first``, send that signal to them all
    and give them a few seconds before (SIGABRT: Python processes with faulthandler enabled write
    where each of their threads is)."""
    try:
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        family = []
    for sig in ([first] if first is not None else []) + [signal.SIGKILL]:
        for p in family:
            try:
                p.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        if sig is not signal.SIGKILL:
            psutil.wait_procs(family, timeout=5)
    proc.wait(timeout=30)
    psutil.wait_procs(family[1:], timeout=30)


def outcome(proc: subprocess.Popen[str], timeout: float = 300) -> tuple[str, str]:
    """Wait for ``proc``'s end and give its output and errors. Past ``timeout`` seconds the run and
    every process under it are ended (where each Python thread stood is written to the errors when
    the run was started with PYTHONFAULTHANDLER=1) and the test fails with the output's end."""
    start = time.monotonic()
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc, first=signal.SIGABRT)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"{proc.args} ran past {time.monotonic() - start:.0f} s and was killed; "
            f"its output:\n{out[-3000:]}\nits errors:\n{err[-12000:]}"
        ) from None


def finished(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` to its end (as :func:`outcome` waits for it) and give its exit status and output."""
    proc = subprocess.Popen(
        cmd, env={**env, "PYTHONFAULTHANDLER": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    out, err = outcome(proc, timeout)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
