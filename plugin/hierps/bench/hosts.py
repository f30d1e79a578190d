"""Two test hosts on one machine: network namespaces joined by a veth pair, each with its own disk.

Used by ``tests/test_hosts.py`` and by ``hierps bench --dist --hosts`` (:mod:`hierps.bench.dist`).

:class:`TwoHosts` (root only) creates namespaces ``hierps<pid>a`` / ``hierps<pid>b`` joined by a
veth pair with private 10.x addresses. :meth:`TwoHosts.launch` runs a command on host ``i`` in a
mount namespace of its own (``unshare --mount --uts --propagation private``) where the host's
directory is bind-mounted at one common path and ``/dev/shm`` is a tmpfs of its own: the same path
names another disk on each host, as node-local storage does. Traffic goes only over the veth pair
(and each namespace's loopback). :meth:`TwoHosts.close` kills every process left in the namespaces
and deletes them; the mounts go with the last process of each mount namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["TwoHosts", "can_make_hosts", "wait_all", "wait_for"]

_STEP_S = 0.2


def can_make_hosts() -> str | None:
    """None when this process can create test hosts, else why not (the reason to skip)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, mounts); CI runs as root"
    missing = [tool for tool in ("ip", "unshare", "mount") if shutil.which(tool) is None]
    if missing:
        return f"test hosts need {missing} on PATH"
    return None


def _run(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=30)


class TwoHosts:
    """Two namespaces joined by a veth pair (see the module docstring); a context manager."""

    def __init__(self, common: Path) -> None:
        pid = os.getpid()
        self.names = [f"hierps{pid}a", f"hierps{pid}b"]
        self.links = [f"hp{pid % 1_000_000}a", f"hp{pid % 1_000_000}b"]
        net = pid % 250 + 1
        self.addrs = [f"10.213.{net}.1", f"10.213.{net}.2"]
        self.common = common  # the path every host sees its own disk at
        self.procs: list[subprocess.Popen[bytes]] = []
        self._made: list[str] = []
        try:
            for name in self.names:
                _run("ip", "netns", "add", name)
                self._made.append(name)
            _run("ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1])
            for name, link, addr in zip(self.names, self.links, self.addrs):
                _run("ip", "link", "set", link, "netns", name)
                _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", link)
                _run("ip", "-n", name, "link", "set", link, "up")
                _run("ip", "-n", name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TwoHosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def launch(
        self, host: int, disk: Path, argv: list[str], env: dict[str, str], log: Path
    ) -> subprocess.Popen[bytes]:
        """Run ``argv`` on host ``host``, its disk ``disk`` mounted at the common path; output to ``log``."""
        self.common.mkdir(parents=True, exist_ok=True)
        disk.mkdir(parents=True, exist_ok=True)
        script = (
            f'mount --bind "{disk}" "{self.common}" && mount -t tmpfs -o size=256m tmpfs /dev/shm '
            f'&& hostname host{host} && exec "$@"'
        )
        cmd = [
            "ip", "netns", "exec", self.names[host],
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", script, "host", *argv,
        ]  # fmt: skip
        env = {**env, "GLOO_SOCKET_IFNAME": self.links[host]}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        """The processes running in host ``host``'s network namespace."""
        got = subprocess.run(
            ["ip", "netns", "pids", self.names[host]], capture_output=True, text=True, timeout=30
        )
        return [int(p) for p in got.stdout.split()]

    def kill(self, host: int) -> None:
        """SIGKILL every process of host ``host``, as a power cut of that machine would."""
        for _ in range(20):  # a process may fork while we kill: bounded retries
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(_STEP_S)

    def close(self) -> None:
        """Kill what is left on both hosts, then delete the namespaces (the veth pair goes with them)."""
        for host, name in enumerate(self.names):
            if name in self._made:
                self.kill(host)
        for proc in self.procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        for name in list(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
            self._made.remove(name)


def wait_all(procs: list[subprocess.Popen[bytes]], timeout_s: float) -> list[int | None]:
    """Wait for every process, ``timeout_s`` in all; their return codes (None: still running)."""
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return [p.poll() for p in procs]


def wait_for(path: Path, procs: list[subprocess.Popen[bytes]], timeout_s: float) -> bool:
    """Wait until ``path`` exists (True), every process ended, or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            return True
        if all(p.poll() is not None for p in procs):
            return path.exists()
        time.sleep(_STEP_S)
    return False
