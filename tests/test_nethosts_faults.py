"""The test hosts and the fault injector themselves (tests/nethosts.py), with a plain echo server:
addresses reachable across namespaces, a partition that drops packets and heals, namespaces gone
after an error, and each fault of the proxy measured (latency, bandwidth cap, reset, half-open)."""
from __future__ import annotations

import socket
import subprocess
import threading
import time

import pytest

from nethosts import FaultProxy, NetHosts, start_in
from netstack import need_namespaces  # noqa: F401 - skipped without namespaces


def _namespaces() -> str:
    """`ip netns list`."""
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout


def _echo(ns: str, addr: tuple[str, int]) -> None:
    """An echo server on addr inside namespace ns (daemon threads; gone with the namespace)."""
    ready = threading.Event()

    def serve():
        ls = socket.socket()
        ls.bind(addr)
        ls.listen(16)
        ready.set()
        while True:
            c, _ = ls.accept()
            threading.Thread(target=pump, args=(c,), daemon=True).start()

    def pump(c):
        try:
            while data := c.recv(65536):
                c.sendall(data)
        except OSError:
            pass
        c.close()

    start_in(ns, serve, "echo")
    assert ready.wait(5)


@pytest.fixture
def net():
    """Hosts a and b, an echo server on b:7000."""
    with NetHosts(["a", "b"]) as n:
        _echo(n.ns["b"], (n.addr["b"], 7000))
        yield n


def _roundtrip(net, host, addr, payload=b"x" * 100, timeout=2.0):
    """Send payload to addr from inside host's namespace; what is echoed back."""
    def go():
        with socket.create_connection(addr, timeout=timeout) as s:
            s.sendall(payload)
            got = b""
            while len(got) < len(payload):
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
            return got

    return net.call_in(host, go, timeout=timeout * 3)


def test_namespaces_removed_even_on_error():
    with pytest.raises(RuntimeError):
        with NetHosts(["a"]) as n:
            made = [n.switch, n.ns["a"]]
            assert all(m in _namespaces() for m in made)
            raise RuntimeError("test body failed")
    assert not any(m in _namespaces() for m in made)


def test_own_addresses_and_partition(net):
    addr = (net.addr["b"], 7000)
    assert _roundtrip(net, "a", addr) == b"x" * 100
    net.partition("b")
    t0 = time.monotonic()
    with pytest.raises(OSError):  # packets vanish: a timeout, not a refusal
        _roundtrip(net, "a", addr, timeout=0.5)
    assert time.monotonic() - t0 >= 0.4
    net.heal("b")
    assert _roundtrip(net, "a", addr) == b"x" * 100


def test_proxy_faults(net):
    px = FaultProxy(net.ns["a"], (net.addr["a"], 7100), (net.addr["b"], 7000), seed=1).start()
    try:
        via = (net.addr["a"], 7100)
        t0 = time.monotonic()
        assert _roundtrip(net, "a", via) == b"x" * 100
        base = time.monotonic() - t0
        px.latency_s, px.jitter_s = 0.05, 0.01
        t0 = time.monotonic()
        assert _roundtrip(net, "a", via) == b"x" * 100
        assert time.monotonic() - t0 >= 0.1  # 50 ms each way
        px.latency_s = px.jitter_s = 0.0
        px.rate_bps = 400_000
        t0 = time.monotonic()
        assert _roundtrip(net, "a", via, payload=b"y" * 100_000, timeout=5) == b"y" * 100_000
        assert time.monotonic() - t0 >= 0.4  # 100 kB at 400 kB/s, both ways
        px.rate_bps = 0

        def reset_then_read():
            with socket.create_connection(via, timeout=2) as s:
                s.sendall(b"z")
                assert s.recv(1) == b"z"
                px.reset()
                try:
                    return s.recv(1)
                except ConnectionResetError:
                    return b""

        assert net.call_in("a", reset_then_read) == b""

        def half_open():
            with socket.create_connection(via, timeout=2) as s:
                s.sendall(b"h")
                assert s.recv(1) == b"h"
                px.half_open = True
                s.sendall(b"h")
                s.settimeout(0.5)
                with pytest.raises(socket.timeout):  # nothing comes back, nothing is closed
                    s.recv(1)
                px.half_open = False
                s.settimeout(2)
                return s.recv(1)  # the held byte is delivered once the link forwards again

        assert net.call_in("a", half_open) == b"h"
        print(f"\nproxy round trip without faults: {base * 1e3:.1f} ms")
    finally:
        px.close()
