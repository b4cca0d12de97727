"""Hosts on one machine: network namespaces on a bridge, each host's link shaped by tc tbf.

A `Network` makes a bridge in a namespace of its own and, per `host(name, mbit)`, a
namespace with one interface (`eth0`, an address of the network's own /24) joined to the
bridge by a veth pair whose both ends are rate-limited with a token bucket: the host's
egress (what it sends) and the bridge side's egress (what it receives), each at `mbit`.
Links are full duplex, as a switch port is. The machine's own namespace gets one more,
unshaped port on the bridge (the control link, `.1`) so that the process running a
benchmark can start servers and read their figures; measured traffic runs host to host.

Processes join a host two ways: a command through `host.argv(...)` (`ip netns exec`), or a
spawned Python process that calls `enter(host)` first (bench.allreduce.run_ranks does, with
`places`). Everything made is removed by `close()` (the context manager's exit, SIGTERM and
Ctrl-C included): processes still in a host are killed, then the namespaces are deleted
(which deletes their interfaces). `python -m bench.netsim --clean` removes what a killed
run left behind. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN); `available()` says why not.

    python -m bench.netsim --check          # can this machine make hosts? one line either way
    python -m bench.netsim --rate 1000      # measure one link's rate between two hosts
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

from cohort.localredis import LocalCluster, LocalRedis

PREFIX = "cs"
"""Every namespace this module makes is named cs<pid>-<name> (and its control link cs<pid>c)."""
NETNS_DIR = Path("/var/run/netns")
_CLONE_NEWNET = 0x40000000
_OPEN = ("--protected-mode", "no")
"""Servers on simulated hosts take connections from the other hosts: the network is this
module's own /24, reachable from nowhere else."""
INTERFACE = "eth0"
"""The one interface of every host (what GLOO_SOCKET_IFNAME names)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and done.returncode != 0:
        raise NetsimError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


class NetsimError(RuntimeError):
    """A namespace, link or shaper could not be made; the message names the command."""


@dataclass(frozen=True)
class Host:
    """One simulated host: its namespace, its address on the network, its link's rate."""

    name: str
    netns: str
    address: str
    mbit: int

    def argv(self, argv: Sequence[str]) -> list[str]:
        """`argv` run on this host."""
        return ["ip", "netns", "exec", self.netns, *argv]

    @property
    def launcher(self) -> tuple[str, ...]:
        return ("ip", "netns", "exec", self.netns)

    @property
    def bytes_per_s(self) -> float:
        return self.mbit * 1e6 / 8


def available() -> str | None:
    """None if hosts can be made here; else one line saying why not."""
    if sys.platform != "linux":
        return f"network namespaces are Linux's; this is {sys.platform}"
    if os.geteuid() != 0:
        return "making network namespaces needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    try:
        link = _ip("-n", probe, "link", "add", "p0", "type", "veth", "peer", "p1", check=False)
        if link.returncode != 0:
            return f"veth pairs cannot be made: {link.stderr.strip()}"
        shaped = subprocess.run(
            ["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "p0", "root", "tbf",
             "rate", "1gbit", "burst", "512kb", "latency", "50ms"],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
        if shaped.returncode != 0:
            return f"tc tbf is not available: {shaped.stderr.strip()}"
    finally:
        _ip("netns", "del", probe, check=False)
    return None


def enter(host: Host) -> None:
    """Move this process into `host`'s network (call first thing in a fresh process: threads
    started before keep the old one). gloo is told which interface is the host's."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(NETNS_DIR / host.netns) as handle:
        if libc.setns(handle.fileno(), _CLONE_NEWNET) != 0:
            errno = ctypes.get_errno()
            raise NetsimError(f"setns into {host.netns}: {os.strerror(errno)}")
    os.environ["GLOO_SOCKET_IFNAME"] = INTERFACE


def _burst(mbit: int) -> str:
    """The token bucket's depth: 4 ms at the rate (at least 64 KiB, the largest GSO packet),
    so the kernel's timer resolution does not cap the rate."""
    return f"{max(64 * 1024, int(mbit * 1e6 / 8 * 0.004))}b"


def _subnet() -> str:
    """A /24 of 10.213.x.0 that no route of this machine uses yet."""
    routes = _ip("-4", "route", "show").stdout
    start = os.getpid() % 200
    for k in range(200):
        third = 20 + (start + k) % 200
        if f"10.213.{third}." not in routes:
            return f"10.213.{third}"
    raise NetsimError("every 10.213.x.0/24 this module uses is taken by a route")


class Network:
    """Simulated hosts on one bridge; a context manager that removes all it made."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}"
        self.bridge = f"{self.tag}-br"
        self.control = f"{self.tag}c"
        self.hosts: dict[str, Host] = {}
        self.processes: list[subprocess.Popen[Any]] = []
        self.servers: list[LocalRedis | LocalCluster] = []
        self._net = ""
        self._previous: dict[int, Any] = {}
        self._open = False

    # -- lifecycle -----------------------------------------------------------------

    def __enter__(self) -> Network:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> Network:
        reason = available()
        if reason is not None:
            raise NetsimError(reason)
        for sig in (signal.SIGTERM, signal.SIGHUP):  # end as Ctrl-C does: through close()
            self._previous[sig] = signal.signal(sig, self._interrupted)
        self._open = True
        try:
            self._net = _subnet()
            _ip("netns", "add", self.bridge)
            self._in(self.bridge, "link", "add", "br0", "type", "bridge")
            self._in(self.bridge, "link", "set", "br0", "up")
            self._in(self.bridge, "link", "set", "lo", "up")
            _ip("link", "add", self.control, "type", "veth", "peer", "name", "ctl",
                "netns", self.bridge)  # fmt: skip
            self._in(self.bridge, "link", "set", "ctl", "master", "br0", "up")
            _ip("addr", "add", f"{self._net}.1/24", "dev", self.control)
            _ip("link", "set", self.control, "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Stop every process and server started here, then delete every namespace."""
        if not self._open:
            return
        self._open = False
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait(10)
        for server in reversed(self.servers):
            server.stop()
        for host in self.hosts.values():
            _kill_inside(host.netns)
        _ip("link", "del", self.control, check=False)
        for netns in [h.netns for h in self.hosts.values()] + [self.bridge]:
            _ip("netns", "del", netns, check=False)
        self.hosts.clear()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _interrupted(self, signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    # -- hosts -----------------------------------------------------------------------

    def host(self, name: str, mbit: int) -> Host:
        """A new host with a link of `mbit` Mbit/s each way to the bridge."""
        if name in self.hosts:
            raise NetsimError(f"host {name!r} exists already")
        index = len(self.hosts)
        if index >= 200:
            raise NetsimError("at most 200 hosts on one network")
        host = Host(name, f"{self.tag}-{name}", f"{self._net}.{10 + index}", mbit)
        port = f"p{index}"
        _ip("netns", "add", host.netns)
        self.hosts[name] = host
        self._in(host.netns, "link", "set", "lo", "up")
        self._in(host.netns, "link", "add", INTERFACE, "type", "veth", "peer", "name", port,
                 "netns", self.bridge)  # fmt: skip
        self._in(host.netns, "addr", "add", f"{host.address}/24", "dev", INTERFACE)
        self._in(host.netns, "link", "set", INTERFACE, "up")
        self._in(self.bridge, "link", "set", port, "master", "br0", "up")
        self._shape(host.netns, INTERFACE, mbit)  # what the host sends
        self._shape(self.bridge, port, mbit)  # what it receives
        return host

    def _shape(self, netns: str, device: str, mbit: int) -> None:
        argv = ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit",
                "burst", _burst(mbit), "latency", "50ms"]  # fmt: skip
        done = subprocess.run(
            ["ip", "netns", "exec", netns, *argv], capture_output=True, text=True, check=False
        )
        if done.returncode != 0:
            raise NetsimError(f"{' '.join(argv)} in {netns}: {done.stderr.strip()}")

    def _in(self, netns: str, *args: str) -> None:
        _ip("-n", netns, *args)

    # -- what runs on hosts ----------------------------------------------------------------

    def popen(self, host: Host, argv: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """`argv` started on `host`; killed at close() if still running."""
        process = subprocess.Popen(host.argv(argv), **kw)
        self.processes.append(process)
        return process

    def redis(self, host: Host, **kw: Any) -> LocalRedis:
        """A redis-server on `host` (AOF off unless asked), started; stopped at close()."""
        kw.setdefault("appendonly", False)
        kw.setdefault("extra_args", _OPEN)
        server = LocalRedis(host=host.address, launcher=host.launcher, **kw)
        self.servers.append(server)
        return server.start()

    def cluster(self, hosts: Sequence[Host], **kw: Any) -> LocalCluster:
        """A Redis Cluster with one primary on each of `hosts` (no replicas), started."""
        kw.setdefault("appendonly", False)
        kw.setdefault("extra_args", _OPEN)
        places = [(h.address, h.launcher) for h in hosts]
        cluster = LocalCluster(primaries=len(hosts), replicas=0, places=places, **kw)
        self.servers.append(cluster)
        return cluster.start()


def _kill_inside(netns: str) -> None:
    """SIGKILL whatever still runs in `netns` (a process a bench forgot, or its child)."""
    pids = _ip("netns", "pids", netns, check=False).stdout.split()
    for pid in pids:
        with suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def leftovers() -> list[str]:
    """Namespaces this module made that still exist (a run that was SIGKILLed)."""
    listed = _ip("netns", "list", check=False).stdout.splitlines()
    names = [line.split()[0] for line in listed if line.strip()]
    return [n for n in names if n.startswith(PREFIX) and n[len(PREFIX) :].split("-")[0].isdigit()]


def clean() -> list[str]:
    """Remove the namespaces and control links of runs whose process is gone; their names."""
    removed = []
    for netns in leftovers():
        pid = int(netns[len(PREFIX) :].split("-")[0])
        if Path(f"/proc/{pid}").exists():
            continue  # a live run's
        _kill_inside(netns)
        _ip("netns", "del", netns, check=False)
        _ip("link", "del", f"{PREFIX}{pid}c", check=False)
        removed.append(netns)
    return removed


# -- measuring a link -----------------------------------------------------------------


@contextmanager
def _two_hosts(mbit: int) -> Iterator[tuple[Network, Host, Host]]:
    with Network() as net:
        yield net, net.host("a", mbit), net.host("b", mbit)


_SINK = """
import socket, sys, time
srv = socket.socket(); srv.bind((sys.argv[1], 5201)); srv.listen(1)
print("ready", flush=True)
conn, _ = srv.accept(); got = 0; start = None
while True:
    data = conn.recv(1 << 20)
    if not data: break
    start = start or time.perf_counter(); got += len(data)
print(got, time.perf_counter() - start, flush=True)
"""
_SOURCE = """
import socket, sys, time
sock = socket.create_connection((sys.argv[1], 5201)); block = bytes(1 << 20)
end = time.perf_counter() + float(sys.argv[2])
while time.perf_counter() < end: sock.sendall(block)
sock.close()
"""


def link_rate(mbit: int, seconds: float = 2.0) -> float:
    """Mbit/s one TCP stream carries from one host to another over links of `mbit`."""
    with _two_hosts(mbit) as (net, a, b):
        sink = net.popen(b, [sys.executable, "-c", _SINK, b.address], stdout=subprocess.PIPE,
                         text=True)  # fmt: skip
        assert sink.stdout is not None
        if sink.stdout.readline().strip() != "ready":
            raise NetsimError("the sink did not start")
        source = net.popen(a, [sys.executable, "-c", _SOURCE, b.address, str(seconds)])
        source.wait(seconds + 30)
        got, took = sink.stdout.readline().split()
        sink.wait(10)
        return int(got) * 8 / float(took) / 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="say whether hosts can be made")
    parser.add_argument("--clean", action="store_true", help="remove what killed runs left")
    parser.add_argument("--rate", type=int, help="measure a link of this many Mbit/s")
    args = parser.parse_args()
    if args.clean:
        removed = clean()
        named = f": {', '.join(removed)}" if removed else ""
        print(f"removed {len(removed)} namespace(s){named}")
        return 0
    reason = available()
    if args.check or reason is not None:
        print(reason or "network namespaces, veth pairs and tc tbf work here")
        return 0 if reason is None else 1
    if args.rate:
        start = time.perf_counter()
        got = link_rate(args.rate)
        print(f"{args.rate} Mbit/s link: one TCP stream carried {got:.0f} Mbit/s "
              f"({time.perf_counter() - start:.1f} s)")  # fmt: skip
        return 0
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
