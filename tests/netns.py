"""Hosts for multi-node tests: network namespaces on this machine, each with its own address, joined
by veth pairs to a bridge in a switch namespace (nothing is added to the machine's own network).

    with hosts(2) as (h0, h1):             # skips the test, with the reason, where namespaces can't be made
        p = h0.popen(["zerodp", "run", "--nnodes", "2", "--node-rank", "0", "--master-addr", h0.address, ...])

Each host's processes get GLOO_SOCKET_IFNAME naming the host's interface, so gloo's traffic between
hosts crosses the veth pairs and the bridge, as between machines. Every namespace and link made is
removed on exit, also when the test fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

import pytest

SUBNET = "10.77.0"  # only ever configured inside the namespaces made here


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str
    interface: str

    def popen(self, argv: list[str], env: dict[str, str], disk: tuple[str, str] | None = None,
              **kwargs) -> subprocess.Popen:
        """Start `argv` inside this host's namespace with `env` (plus this host's GLOO_SOCKET_IFNAME).
        `disk` (source, target): the host's own disk, `source` bind-mounted at `target` in a private
        mount namespace of its processes (node-local storage; nothing is mounted on the machine)."""
        env = {**env, "GLOO_SOCKET_IFNAME": self.interface, "ZERODP_TEST_HOST": self.namespace}
        if disk is not None:
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                    'mount --bind "$1" "$2" && shift 2 && exec "$@"', "sh", *disk, *argv]
        return subprocess.Popen(["ip", "netns", "exec", self.namespace, *argv], env=env, **kwargs)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


@contextmanager
def hosts(num_hosts: int) -> Iterator[list[Host]]:
    """`num_hosts` hosts on one bridge; the test is skipped, naming why, where they cannot be made."""
    reason = _why_not()
    if reason:
        pytest.skip(f"multi-host tests skipped: {reason}")
    tag = f"zdp{os.getpid() % 100000}"
    switch, made = f"{tag}-sw", []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("netns", "exec", switch, "ip", "link", "add", "br0", "type", "bridge")
        _ip("netns", "exec", switch, "ip", "link", "set", "br0", "up")
        out = []
        for i in range(num_hosts):
            name, inner, outer = f"{tag}-h{i}", f"{tag}h{i}", f"{tag}s{i}"
            _ip("netns", "add", name)
            made.append(name)
            _ip("link", "add", inner, "type", "veth", "peer", "name", outer)
            _ip("link", "set", inner, "netns", name)
            _ip("link", "set", outer, "netns", switch)
            _ip("netns", "exec", switch, "ip", "link", "set", outer, "master", "br0")
            _ip("netns", "exec", switch, "ip", "link", "set", outer, "up")
            address = f"{SUBNET}.{i + 1}"
            _ip("netns", "exec", name, "ip", "addr", "add", f"{address}/24", "dev", inner)
            _ip("netns", "exec", name, "ip", "link", "set", inner, "up")
            _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
            out.append(Host(name, address, inner))
    except subprocess.CalledProcessError as err:
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"multi-host tests skipped: `{' '.join(err.cmd)}` failed: {err.stderr.strip()}")
    try:
        yield out
    finally:  # deleting a namespace deletes its end of each veth pair, and with it the pair
        for name in reversed(made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@contextmanager
def slow_loopback(rate: str) -> Iterator[Host]:
    """One host whose own loopback carries at most `rate` (`tc tbf`, e.g. "50mbit"): ranks started on
    it (`host.popen`, address 127.0.0.1) talk over a slow network. Skipped, naming why, where it
    cannot be made."""
    reason = _why_not() or (shutil.which("tc") is None and "the `tc` command (iproute2) is not installed") or None
    if reason:
        pytest.skip(f"slow-network tests skipped: {reason}")
    name = f"zdp{os.getpid() % 100000}-slow"
    try:
        _ip("netns", "add", name)
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        # the burst must hold loopback's 64 KiB packets, or they wait forever
        subprocess.run(["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", rate,
                        "burst", "512kb", "latency", "200ms"], check=True, capture_output=True, text=True, timeout=30)
    except subprocess.CalledProcessError as err:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"slow-network tests skipped: `{' '.join(err.cmd)}` failed: {err.stderr.strip()}")
    try:
        yield Host(name, "127.0.0.1", "lo")
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
