"""A moto S3 endpoint with a real network delay in front of it, for benchmarks (issue #5) and the demo.

    with moto_endpoint(10) as ep:     # 10 ms one-way delay each way: RTT ~20 ms
        print(ep.url, ep.note, ep.rtt_ms)

moto runs on one CPU in its own process and answers in a few ms, far faster than a real object
store's 10-50 ms to first byte, so cold-read and prefetch figures against it flatter whatever
makes many small requests. ``moto_endpoint(delay_ms)`` puts a delay in the path, in the first
of these ways that works here:

* ``netem`` (root, iproute2, the kernel's ``sch_netem``): a network namespace ``cfs-netem-PID-XX``
  with a veth pair on a random private /30 in 10.213.0.0/16; the host end stays in the root
  namespace, the peer end and moto live in the namespace, and ``tc qdisc ... netem delay D ms``
  sits on the egress of *both* ends. ``delay_ms`` is therefore the one-way delay in each
  direction: RTT = 2 * delay_ms, a new TCP connection costs one RTT more.
* ``proxy`` (when netem cannot be set up, e.g. a kernel without ``sch_netem``): moto on loopback
  behind a TCP proxy in its own process that holds every chunk for ``delay_ms`` in each direction
  (and the first request of a connection for one extra RTT, as a TCP handshake would). Same
  meaning of ``delay_ms``; bandwidth is bounded by the proxy's Python loop (hundreds of MB/s).
* ``loopback``: moto on 127.0.0.1 without delay (``delay_ms=0`` asked, or nothing else worked);
  the note says why.

moto's HTTP server (werkzeug) closes the connection after every answer, so each S3 request pays a
TCP handshake too: its first byte comes ~2 RTT = 4 * delay_ms after it is sent (plus moto's few
ms). ``--delay-ms 5`` thus gives ~20 ms to first byte, ``10`` ~40 ms. ``Endpoint.rtt_ms`` is
that time measured (median of a few GETs, moto's answer time included), so the delay is shown,
not assumed. Everything made is removed on exit,
also on errors and KeyboardInterrupt; namespaces and veths left by a killed run (dead pid in the
name) are removed by the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import ipaddress
import os
import random
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from cachefs.testing import fake_s3_client, new_fake_bucket

NETNS_PREFIX = "cfs-netem-"
_NETNS_RE = re.compile(r"^cfs-netem-(\d+)-[0-9a-f]{2}$")
_LINK_RE = re.compile(r"^cfn(\d+)x[0-9a-f]{2}[hp]$")
KEY_BUFFER_SIZE = 256 << 20  # moto keeps objects up to this size in memory (its default spools ~5 MiB)

_MOTO_MAIN = r"""
import sys
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address=sys.argv[1], port=0, verbose=False)
server.start()
print(server.get_host_and_port()[1], flush=True)
sys.stdin.read()  # until the parent closes our stdin (or dies)
server.stop()
"""

# Forwards 127.0.0.1:<free> to UPSTREAM, holding each chunk DELAY seconds per direction, and with
# RATE > 0 pacing each connection's chunks to RATE bytes/s per direction (a store that serves one
# connection at a bounded speed, as S3 does: parallel ranged GETs are how clients go faster).
_PROXY_MAIN = r"""
import asyncio, os, sys, threading, time
up_host, up_port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
rate = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0  # bytes/s per connection and direction (0: any)

async def pump(reader, writer, earliest, both):
    queue = asyncio.Queue(256)  # bounded: a full queue stops reading, as a full window would
    async def feed():
        while True:
            data = await reader.read(1 << 16)
            await queue.put((max(time.monotonic() + delay, earliest), data))
            if not data:
                return
    async def drain():
        free = 0.0  # when the capped link has sent what went before
        while True:
            due, data = await queue.get()
            if rate and data:
                free = due = max(free, due) + len(data) / rate
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())
            if not data:
                if writer.can_write_eof():
                    writer.write_eof()
                return
            writer.write(data)
            await writer.drain()
    tasks = {asyncio.ensure_future(feed()), asyncio.ensure_future(drain())}
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    for t in pending:
        t.cancel()
    if any(t.exception() for t in done if not t.cancelled()):
        for w in both:
            w.transport.abort()

async def handle(client_r, client_w):
    accepted = time.monotonic()
    try:
        server_r, server_w = await asyncio.open_connection(up_host, up_port)
    except OSError:
        client_w.transport.abort()
        return
    both = (client_w, server_w)
    # a real connection spends one RTT on the handshake before the first request leaves
    await asyncio.gather(pump(client_r, server_w, accepted + 3 * delay, both),
                         pump(server_r, client_w, 0.0, both), return_exceptions=True)
    for w in both:
        w.close()

async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.Event().wait()

threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
asyncio.run(main())
"""

FAKE_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                    "AWS_DEFAULT_REGION": "us-east-1"}


@dataclasses.dataclass(frozen=True)
class Endpoint:
    """Where the benchmark's moto answers, and what stands between it and the caller."""

    url: str  # "http://10.213.7.2:PORT" (netem) or "http://127.0.0.1:PORT"
    delay_ms: float  # one-way delay really applied in each direction (0.0 when none): RTT = 2x
    note: str  # how, or "loopback, no delay: <why>"
    rtt_ms: float | None = None  # measured: median time of one GET (moto closes connections: ~2 RTT)
    mode: str = "loopback"  # "netem", "proxy" or "loopback"
    netns: str = ""  # the namespace moto runs in (netem mode)
    store_pid: int = 0  # moto's process (its CPU is the store's, reported apart from the loaders')
    conn_mbps: float = 0.0  # each connection's bandwidth per direction, MB/s (0: unbounded); proxy only

    def storage_options(self) -> dict[str, Any]:
        """s3fs options for this endpoint (fake credentials)."""
        return {"key": "testing", "secret": "testing", "endpoint_url": self.url,
                "client_kwargs": {"region_name": "us-east-1"}}

    def client(self) -> Any:
        return fake_s3_client(self.url)

    def new_bucket(self, prefix: str = "cachefs-bench") -> str:
        return new_fake_bucket(self.url, prefix)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class NetemUnavailable(OSError):
    """A namespace, veth or netem qdisc could not be made here (the message says which step)."""


def measure_rtt(url: str, samples: int = 7, timeout: float = 10.0, path: str = "/moto-api/data.json") -> float:
    """Median ms of a few HTTP GETs after one unmeasured warm-up.

    The connection is reused when the server keeps it alive (one RTT per GET); moto does not, so
    against moto each GET also pays a handshake (two RTTs), as every S3 request to it does.
    """
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=timeout)
    times = []
    try:
        for i in range(samples + 1):
            t0 = time.perf_counter()
            conn.request("GET", path)
            conn.getresponse().read()
            if i:
                times.append((time.perf_counter() - t0) * 1000)
    finally:
        conn.close()
    return round(statistics.median(times), 2)


# -- processes ----------------------------------------------------------------------------------------------
def _start(cmd: list[str], env: dict[str, str], timeout: float) -> tuple[subprocess.Popen[str], int]:
    """Start a child that prints its port on its first line and runs until its stdin closes."""
    with tempfile.TemporaryFile("w+") as err:  # a file, not a pipe: a chatty child never blocks on it
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline().strip() if ready else ""
        if line.isdigit():
            return proc, int(line)
        _stop(proc)
        err.seek(0)
        raise RuntimeError(f"{' '.join(cmd[:4])} ... did not report a port within {timeout:.0f} s: "
                           f"{err.read()[-500:].strip()}")


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        if proc.stdin:
            proc.stdin.close()
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)
    finally:
        if proc.stdout:
            proc.stdout.close()


def _wait_answers(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an http_proxy
    while True:
        try:
            opener.open(url + "/moto-api/", timeout=5).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


# -- namespace, veth, netem ------------------------------------------------------------------------------
def _ip(*args: str, timeout: float = 10.0) -> str:
    cmd = [shutil.which("ip") or "/usr/sbin/ip", *args]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetemUnavailable(f"`{' '.join(cmd)}`: {exc}") from exc
    if r.returncode:
        raise NetemUnavailable(f"`{' '.join(cmd)}`: {r.stderr.strip() or r.returncode}")
    return r.stdout


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale() -> list[str]:
    """Delete this module's namespaces and veths whose creating process is gone; returns their names."""
    removed = []
    with contextlib.suppress(NetemUnavailable):
        for line in _ip("netns", "list").splitlines():
            name = line.split()[0] if line.split() else ""
            m = _NETNS_RE.match(name)
            if m and not _pid_alive(int(m.group(1))):
                with contextlib.suppress(NetemUnavailable):
                    _ip("netns", "del", name)
                    removed.append(name)
        for line in _ip("-o", "link", "show").splitlines():
            name = line.split(":")[1].strip().split("@")[0] if line.count(":") >= 2 else ""
            m = _LINK_RE.match(name)
            if m and not _pid_alive(int(m.group(1))):
                with contextlib.suppress(NetemUnavailable):
                    _ip("link", "del", name)
                    removed.append(name)
    return removed


def _free_subnet(rng: random.Random) -> ipaddress.IPv4Network:
    """A /30 in 10.213.0.0/16 that no address of the root namespace falls in (random: concurrent runs)."""
    used = [ipaddress.ip_interface(a).ip for a in re.findall(r"inet (\S+)", _ip("-o", "-4", "addr", "show"))]
    for _ in range(100):
        net = ipaddress.ip_network(f"10.213.{rng.randrange(256)}.{4 * rng.randrange(64)}/30")
        if not any(a in net for a in used):
            return net
    raise NetemUnavailable("no free /30 in 10.213.0.0/16")


@dataclasses.dataclass(frozen=True)
class _Veth:
    netns: str
    host: str  # the end in the root namespace
    peer: str  # the end in netns
    host_ip: str
    peer_ip: str


def _make_veth(delay_ms: float) -> _Veth:
    """Namespace + veth pair + netem on both ends (none for 0); on any failure removes what it made, raises."""
    if os.geteuid() != 0:
        raise NetemUnavailable("not root")
    rng = random.Random()
    tag = f"{rng.randrange(256):02x}"
    pid = os.getpid()
    net = _free_subnet(rng)
    host_ip, peer_ip = (str(h) for h in list(net.hosts())[:2])
    v = _Veth(f"{NETNS_PREFIX}{pid}-{tag}", f"cfn{pid}x{tag}h", f"cfn{pid}x{tag}p", host_ip, peer_ip)
    try:
        _ip("netns", "add", v.netns)
        _ip("link", "add", v.host, "type", "veth", "peer", "name", v.peer, "netns", v.netns)
        _ip("addr", "add", f"{host_ip}/30", "dev", v.host)
        _ip("link", "set", v.host, "up")
        _ip("-n", v.netns, "addr", "add", f"{peer_ip}/30", "dev", v.peer)
        _ip("-n", v.netns, "link", "set", v.peer, "up")
        _ip("-n", v.netns, "link", "set", "lo", "up")
        tc = shutil.which("tc") or "/usr/sbin/tc"
        qdisc = ["qdisc", "add", "dev", "DEV", "root", "netem", "delay", f"{delay_ms}ms", "limit", "100000"]
        for prefix, dev in (([], v.host), (["netns", "exec", v.netns], v.peer)) if delay_ms > 0 else ():
            args = [*prefix, tc, *[dev if a == "DEV" else a for a in qdisc]]
            if prefix:
                _ip(*args)
            else:
                r = subprocess.run(args, capture_output=True, text=True, timeout=10)
                if r.returncode:
                    raise NetemUnavailable(f"`{' '.join(args)}`: {r.stderr.strip() or r.returncode}")
    except BaseException:
        _remove_veth(v)
        raise
    return v


def _remove_veth(v: _Veth, timeout: float = 10.0) -> None:
    """Delete the pair (deleting one end deletes both) and the namespace, and wait until both are gone."""
    with contextlib.suppress(NetemUnavailable):
        _ip("link", "del", v.host)
    with contextlib.suppress(NetemUnavailable):
        _ip("netns", "del", v.netns)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:  # the kernel tears a namespace down asynchronously
        try:
            names = _ip("netns", "list") + _ip("-o", "link", "show")
        except NetemUnavailable:
            return
        if v.netns not in names and v.host not in names:
            return
        time.sleep(0.05)


# -- the endpoint ------------------------------------------------------------------------------------------
@contextlib.contextmanager
def moto_endpoint(delay_ms: float = 0.0, *, python: str = sys.executable, env: dict[str, str] | None = None,
                  proxy_fallback: bool = True, timeout: float = 60.0, netem: bool = True,
                  conn_mbps: float = 0.0) -> Iterator[Endpoint]:
    """A moto S3 server in its own process, ``delay_ms`` away each way (see the module docstring).

    ``python`` runs moto (it needs the ``test`` extra); ``env`` is laid over os.environ, fake AWS
    credentials and MOTO_S3_DEFAULT_KEY_BUFFER_SIZE for it. ``proxy_fallback=False`` falls back to
    plain loopback when netem cannot be set up. ``netem=False`` goes straight to the userspace proxy
    (the demo: it never touches the host's network configuration, root or not). ``conn_mbps`` > 0
    bounds each connection to that many MB/s per direction, as S3 bounds one stream (the proxy
    does it, so it is used even without a delay and never netem).
    """
    if delay_ms < 0:
        raise ValueError(f"delay_ms must be >= 0, got {delay_ms}")
    if conn_mbps < 0:
        raise ValueError(f"conn_mbps must be >= 0, got {conn_mbps}")
    child_env = {**os.environ, **FAKE_CREDENTIALS, "MOTO_S3_DEFAULT_KEY_BUFFER_SIZE": str(KEY_BUFFER_SIZE),
                 **(env or {})}
    with contextlib.ExitStack() as stack:
        endpoint, why = None, "no delay asked (delay_ms=0)"
        if conn_mbps > 0:
            why = "a bandwidth per connection asked for (the proxy paces it; netem cannot)"
        elif delay_ms > 0 and not netem:
            why = "netem not asked for (netem=False)"
        elif delay_ms > 0:
            remove_stale()
            try:
                endpoint = _netem(stack, delay_ms, python, child_env, timeout)
            except (NetemUnavailable, RuntimeError, OSError) as exc:
                why = f"netem not possible here: {exc}"
        if endpoint is None:
            endpoint = _loopback(stack, delay_ms if proxy_fallback or conn_mbps > 0 else 0.0, why, python,
                                 child_env, timeout, conn_mbps)
        yield endpoint  # outside any try: the caller's exceptions only unwind the stack


def _netem(stack: contextlib.ExitStack, delay_ms: float, python: str, env: dict[str, str],
           timeout: float) -> Endpoint:
    with contextlib.ExitStack() as attempt:  # on failure, moto and the namespace go before any fallback
        v = _make_veth(delay_ms)
        attempt.callback(_remove_veth, v)
        proc, port = _start([shutil.which("ip") or "/usr/sbin/ip", "netns", "exec", v.netns, python, "-c",
                             _MOTO_MAIN, v.peer_ip], env, timeout)
        attempt.callback(_stop, proc)
        url = f"http://{v.peer_ip}:{port}"
        _wait_answers(url, timeout)
        rtt = measure_rtt(url)
        stack.enter_context(attempt.pop_all())
    return Endpoint(url, float(delay_ms), f"moto in netns {v.netns} behind veth {v.host} ({v.host_ip} <-> "
                    f"{v.peer_ip}/30) + tc netem delay {delay_ms:g}ms on both ends (RTT {2 * delay_ms:g} ms set; "
                    f"one GET {rtt} ms measured)", rtt, "netem", v.netns, proc.pid)


def _loopback(stack: contextlib.ExitStack, delay_ms: float, why: str, python: str, env: dict[str, str],
              timeout: float, conn_mbps: float = 0.0) -> Endpoint:
    """moto on 127.0.0.1, behind the delay proxy when delay_ms > 0 or conn_mbps > 0."""
    proc, port = _start([python, "-c", _MOTO_MAIN, "127.0.0.1"], env, timeout)
    stack.callback(_stop, proc)
    url = f"http://127.0.0.1:{port}"
    _wait_answers(url, timeout)
    if delay_ms <= 0 and conn_mbps <= 0:
        rtt = measure_rtt(url)
        return Endpoint(url, 0.0, f"loopback, no delay: {why} (one GET {rtt} ms measured)", rtt, "loopback",
                        store_pid=proc.pid)
    proxy, pport = _start([python, "-c", _PROXY_MAIN, "127.0.0.1", str(port), str(delay_ms / 1000),
                           str(conn_mbps * 1e6)], env, timeout)
    stack.callback(_stop, proxy)
    url = f"http://127.0.0.1:{pport}"
    _wait_answers(url, timeout)
    rtt = measure_rtt(url)
    cap = f", {conn_mbps:g} MB/s per connection each way" if conn_mbps > 0 else ""
    return Endpoint(url, float(delay_ms), f"moto on loopback behind a userspace TCP delay proxy, {delay_ms:g} ms "
                    f"each way{cap} (RTT {2 * delay_ms:g} ms set; one GET {rtt} ms measured); {why}", rtt, "proxy",
                    store_pid=proc.pid, conn_mbps=float(conn_mbps))
