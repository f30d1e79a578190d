"""Two test hosts on one machine: network namespaces joined by a veth pair, each with its own disk.

Used by ``tests/test_hosts.py`` and by ``hierps bench --dist --hosts`` (:mod:`hierps.bench.dist`).

:class:`TwoHosts` (root only) creates namespaces ``hierps<pid>a`` / ``hierps<pid>b`` joined by a
veth pair with private 10.x addresses, its end named ``hpveth0`` on both hosts (launchers such as
horovodrun take one interface name for all hosts). :meth:`TwoHosts.launch` runs a command on host
``i`` in a mount namespace of its own (``unshare --mount --uts --propagation private``) where the
host's directory is bind-mounted at one common path and ``/dev/shm`` is a tmpfs of its own: the
same path names another disk on each host, as node-local storage does. Traffic goes only over the
veth pair (and each namespace's loopback). :meth:`TwoHosts.close` kills every process left in the
namespaces and deletes them; the mounts go with the last process of each mount namespace.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

__all__ = ["SSH_PORT", "TwoHosts", "can_make_hosts", "wait_all", "wait_for"]

_STEP_S = 0.2
SSH_PORT = 2222  # sshd's port on the test hosts (:meth:`TwoHosts.ssh`)


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
        self.links = [f"hp{pid % 1_000_000}a", f"hp{pid % 1_000_000}b"]  # the pair's names while made
        self.nic = "hpveth0"  # its end's name on each host
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
                # One interface name on every host, as launchers that pick one for all hosts expect.
                _run("ip", "-n", name, "link", "set", link, "name", self.nic)
                _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", self.nic)
                _run("ip", "-n", name, "link", "set", self.nic, "up")
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
        names = self.common.parent / f".{self.common.name}-hosts"  # each host knows the other by name
        names.write_text(
            "127.0.0.1 localhost\n" + "".join(f"{a} host{i}\n" for i, a in enumerate(self.addrs))
        )
        script = (
            f'mount --bind "{disk}" "{self.common}" && mount -t tmpfs -o size=256m tmpfs /dev/shm '
            f'&& mount --bind "{names}" /etc/hosts && hostname host{host} && exec "$@"'
        )
        cmd = [
            "ip", "netns", "exec", self.names[host],
            "unshare", "--mount", "--uts", "--propagation", "private",
            "sh", "-c", script, "host", *argv,
        ]  # fmt: skip
        env = {**env, "GLOO_SOCKET_IFNAME": self.nic}
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def ssh(self, workdir: Path, disks: list[Path]) -> tuple[Path, dict[str, str]]:
        """Start sshd on both hosts, host ``i``'s sessions with ``disks[i]`` at the common path (port
        :data:`SSH_PORT`, root by a key made here, no password), as horovodrun needs -> (the identity
        file, variables for the launcher: PATH with an ``ssh`` that keeps no known_hosts). Needs
        ``/usr/sbin/sshd`` (Debian: openssh-server)."""
        workdir.mkdir(parents=True, exist_ok=True)
        key, host_key = workdir / "id_ed25519", workdir / "host_ed25519"
        for k in (key, host_key):
            if not k.exists():
                _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(k))
        allowed = workdir / "authorized_keys"
        allowed.write_text(key.with_suffix(".pub").read_text())
        allowed.chmod(0o600)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege separation directory
        for host, addr in enumerate(self.addrs):
            config = workdir / f"sshd-{host}.conf"
            config.write_text(
                f"Port {SSH_PORT}\nListenAddress {addr}\nHostKey {host_key}\nAuthorizedKeysFile {allowed}\n"
                "PermitRootLogin prohibit-password\nPasswordAuthentication no\nStrictModes no\nUsePAM no\n"
                "PidFile none\n"
            )
            self.launch(
                host,
                disks[host],
                ["/usr/sbin/sshd", "-D", "-e", "-f", str(config)],
                {},
                workdir / f"sshd-{host}.log",
            )
        wrapper = workdir / "bin" / "ssh"
        wrapper.parent.mkdir(exist_ok=True)
        wrapper.write_text(
            '#!/bin/sh\nexec /usr/bin/ssh -o UserKnownHostsFile=/dev/null -o LogLevel=ERROR "$@"\n'
        )
        wrapper.chmod(0o755)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(
            f"Server listening on {a}" in (workdir / f"sshd-{h}.log").read_text(errors="replace")
            for h, a in enumerate(self.addrs)
        ):
            time.sleep(_STEP_S)
        return key, {"PATH": f"{wrapper.parent}:{os.environ.get('PATH', '')}"}

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
