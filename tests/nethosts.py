"""Test hosts: network namespaces with their own addresses on one private bridge, and a fault
injector between them.

    with NetHosts(["gpu", "r0", "r1"]) as net:      # 10.77.0.1, .2, .3 on a bridge in a switch namespace
        p = net.popen("r0", [sys.executable, "-m", "moesplit", "expert-server", ...])
        net.partition("r0")                          # its veth down: packets vanish, no RST
        net.heal("r0")
        net.call_in("gpu", lambda: httpx.get(...))   # a socket made in a thread that entered "gpu"

Every namespace (one per host plus the "switch" holding the bridge) is created by this module with
a unique name and deleted on exit, whatever happened; the veth pairs are created inside them, so
the host's own interfaces, addresses and routes are never touched. `skip_reason()` says why
namespaces cannot be made here (not root, no `ip`, no netns support), for pytest.skip.

`FaultProxy` is a user-space TCP proxy, run in threads of this process that entered a namespace:
added latency + jitter, a bandwidth cap, reset of every connection, and half-open (bytes are held,
nothing is forwarded, nothing is closed).
"""
from __future__ import annotations

import ctypes
import os
import random
import shutil
import socket
import struct
import subprocess
import threading
import time

from gpu_service.local.stack import stop_processes

SUBNET = "10.77.0"
CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    """`ip ARGS` (iproute2), output captured; raises CalledProcessError with `check`."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def skip_reason() -> str | None:
    """None when namespaces can be made here, else why not (for pytest.skip)."""
    if os.geteuid() != 0:
        return "network namespaces need root (run the tests as root, as CI does)"
    if shutil.which("ip") is None:
        return "no `ip` command (install iproute2)"
    name = f"msprobe{os.getpid()}"
    p = _ip("netns", "add", name, check=False)
    if p.returncode != 0:
        return f"`ip netns add` failed: {p.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


def enter_netns(ns: str) -> None:
    """Move the calling thread (only it) into namespace `ns`; sockets it creates live there."""
    fd = os.open(f"/var/run/netns/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(fd, CLONE_NEWNET) != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"setns({ns}): {os.strerror(e)}")
    finally:
        os.close(fd)


def start_in(ns: str, target, name: str) -> threading.Thread:
    """A daemon thread that enters `ns` and runs target(); threads it starts stay in `ns`."""
    def run():
        enter_netns(ns)
        target()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t


def sweep_stale() -> None:
    """Delete namespaces this module made in a test process that is gone (killed before its teardown),
    killing what still runs in them."""
    import re

    for line in _ip("netns", "list", check=False).stdout.splitlines():
        m = re.match(r"(ms(\d+)x\d+\w+)", line.strip())
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            for pid in _ip("netns", "pids", m.group(1), check=False).stdout.split():  # its orphaned servers
                try:
                    os.kill(int(pid), 9)
                except (OSError, ValueError):
                    pass
            _ip("netns", "del", m.group(1), check=False)


class NetHosts:
    """Hosts by name, each a namespace with address SUBNET.(i+1)/24 on a bridge in a switch namespace."""

    def __init__(self, hosts: list[str]):
        tag = f"ms{os.getpid()}x{int(time.monotonic() * 1000) % 100000}"
        self.ns = {h: f"{tag}{h}" for h in hosts}
        self.addr = {h: f"{SUBNET}.{i + 1}" for i, h in enumerate(hosts)}
        self.switch = f"{tag}sw"
        self.procs: list[subprocess.Popen] = []
        self._made: list[str] = []

    def __enter__(self) -> "NetHosts":
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        """Switch namespace with br0, then per host a namespace, a veth pair into the switch and the address."""
        sweep_stale()
        sw = self.switch
        _ip("netns", "add", sw)
        self._made.append(sw)
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for i, (h, ns) in enumerate(self.ns.items()):
            _ip("netns", "add", ns)
            self._made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", f"port{i}", "netns", sw)
            _ip("-n", sw, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addr[h]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")

    def popen(self, host: str, cmd: list[str], **kw) -> subprocess.Popen:
        """Start `cmd` in host's namespace (`ip netns exec` execs it: the pid is the command's)."""
        p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], **kw)
        self.procs.append(p)
        return p

    def run(self, host: str, cmd: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        """Run `cmd` in host's namespace to completion."""
        return subprocess.run(["ip", "netns", "exec", self.ns[host], *cmd], capture_output=True, text=True,
                              timeout=timeout)

    def call_in(self, host: str, fn, timeout: float = 60):
        """fn() in a thread inside host's namespace; its result (or its exception, raised here)."""
        box: dict = {}

        def target():
            try:
                box["v"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box["e"] = e

        t = start_in(self.ns[host], target, f"in-{host}")
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"call in {host} still running after {timeout}s")
        if "e" in box:
            raise box["e"]
        return box["v"]

    def partition(self, host: str) -> None:
        """Take host's veth down: its packets vanish (no RST), both ways."""
        _ip("-n", self.ns[host], "link", "set", "eth0", "down")

    def heal(self, host: str) -> None:
        """Bring host's veth back up (its address comes back with it)."""
        _ip("-n", self.ns[host], "link", "set", "eth0", "up")
        if self.addr[host] not in _ip("-n", self.ns[host], "addr", "show", "dev", "eth0").stdout:
            _ip("-n", self.ns[host], "addr", "add", f"{self.addr[host]}/24", "dev", "eth0")

    def close(self) -> None:
        """Kill what was started in the namespaces, then delete every namespace made (idempotent)."""
        stop_processes(self.procs, 10.0)
        self.procs.clear()
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()


class FaultProxy:
    """TCP proxy listen_host:port -> target_host:port, in threads inside namespace `ns`.

    Settable at any time: latency_s + jitter_s (each forwarded chunk waits latency + uniform
    [0, jitter), seeded), rate_bps (a bandwidth cap per direction), half_open (bytes are held,
    nothing forwarded, nothing closed). reset() closes every connection with RST."""

    def __init__(self, ns: str, listen: tuple[str, int], target: tuple[str, int], seed: int = 0):
        self.ns, self.listen, self.target = ns, listen, target
        self.latency_s = self.jitter_s = 0.0
        self.rate_bps = 0
        self.half_open = False
        self.forwarded = 0  # bytes, both directions
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._closed = threading.Event()
        self._ready = threading.Event()
        self._lsock: socket.socket | None = None
        self._err: BaseException | None = None

    def start(self) -> "FaultProxy":
        start_in(self.ns, self._serve, f"proxy-{self.listen[1]}")
        if not self._ready.wait(10) or self._err is not None:
            raise RuntimeError(f"fault proxy on {self.listen} did not start: {self._err}")
        return self

    def _serve(self) -> None:
        """Accept loop (inside the namespace); each connection gets its own pump threads."""
        try:
            ls = socket.socket()
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(self.listen)
            ls.listen(64)
            ls.settimeout(0.2)
            self._lsock = ls
        except BaseException as e:  # noqa: BLE001 - reported by start()
            self._err = e
            self._ready.set()
            return
        self._ready.set()
        while not self._closed.is_set():
            try:
                c, _ = ls.accept()
            except socket.timeout:
                continue
            except OSError:
                break
            threading.Thread(target=self._connect, args=(c,), daemon=True).start()  # inherits the namespace
        ls.close()

    def _connect(self, c: socket.socket) -> None:
        """Dial the target for accepted connection c (RST to c when it cannot) and start both pumps."""
        try:
            u = socket.create_connection(self.target, timeout=5)
        except OSError:
            self._rst(c)
            return
        u.settimeout(None)
        with self._lock:
            self._conns += [c, u]
        for a, b in ((c, u), (u, c)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _delay(self, n: int) -> float:
        """Seconds to hold a chunk of n bytes: latency + jitter + n / rate."""
        with self._lock:
            d = self.latency_s + (self._rng.random() * self.jitter_s if self.jitter_s else 0.0)
        return d + (n / self.rate_bps if self.rate_bps else 0.0)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        """Forward src -> dst applying the faults; a half close is passed on, an error resets both."""
        try:
            while not self._closed.is_set():
                data = src.recv(65536)
                if not data:
                    dst.shutdown(socket.SHUT_WR)
                    return
                while self.half_open and not self._closed.is_set():
                    time.sleep(0.01)  # held: the peer sees neither data nor a close
                d = self._delay(len(data))
                if d:
                    time.sleep(d)
                dst.sendall(data)
                self.forwarded += len(data)
        except OSError:
            for s in (src, dst):
                self._rst(s)

    @staticmethod
    def _rst(s: socket.socket) -> None:
        """Close s with RST (SO_LINGER 0)."""
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass

    def reset(self) -> None:
        """Close every open connection with RST (new ones are accepted)."""
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._rst(s)

    def close(self) -> None:
        """Stop accepting and reset every connection."""
        self._closed.set()
        self.half_open = False
        self.reset()
