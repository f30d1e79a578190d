"""Two test hosts on one machine (network namespaces, a veth pair, a disk of its own each): see
:mod:`hierps.bench.hosts`, which ``hierps bench --dist --hosts`` runs on too."""

from __future__ import annotations

from hierps.bench.hosts import SSH_PORT, TwoHosts, can_make_hosts, wait_all, wait_for

__all__ = ["SSH_PORT", "TwoHosts", "can_make_hosts", "wait_all", "wait_for"]
