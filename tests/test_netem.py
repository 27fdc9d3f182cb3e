"""cachefs/netem.py: a moto endpoint behind real delay (netns + veth + netem, else a delay proxy).

Real processes and real sockets: moto in its own process, namespaces and veths made with `ip`
(root only; skipped with the reason otherwise), the delay measured on the wire.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from cachefs import netem

pytest.importorskip("moto")
pytest.importorskip("s3fs")


def ours() -> list[str]:
    """Names of namespaces and links this process made (their names carry our pid)."""
    pid = os.getpid()
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    out += subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
    return sorted({w.split("@")[0].rstrip(":") for w in out.split()
                   if w.startswith((f"{netem.NETNS_PREFIX}{pid}-", f"cfn{pid}x"))})


def netns_refused() -> str | None:
    """Why this machine cannot make namespaces (None when it can)."""
    if os.geteuid() != 0:
        return "not root: cannot make network namespaces"
    name = f"{netem.NETNS_PREFIX}{os.getpid()}-ff"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, timeout=10)
    if r.returncode:
        return f"`ip netns add` refused: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
    return None


def refused(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "/moto-api/", timeout=5).read()
    except OSError:
        return True
    return False


def test_delay_25ms_is_measured_and_s3_works_through_it() -> None:
    with netem.moto_endpoint(25) as ep:
        assert ep.delay_ms == 25.0 and ep.mode in ("netem", "proxy"), ep
        assert ep.rtt_ms is not None and ep.rtt_ms >= 45, ep
        assert netem.measure_rtt(ep.url, samples=3) >= 45  # measured again, by a new client
        import s3fs
        fs = s3fs.S3FileSystem(skip_instance_cache=True, **ep.storage_options())
        bucket = ep.new_bucket("netem")
        data = os.urandom(3 << 20) + b"end"
        fs.pipe_file(f"{bucket}/obj", data)
        t0 = time.perf_counter()
        assert fs.cat_file(f"{bucket}/obj") == data  # byte for byte through the delayed path
        assert time.perf_counter() - t0 >= 0.045
        assert fs.cat_file(f"{bucket}/obj", start=5, end=9) == data[5:9]
        url = ep.url
        if ep.mode == "netem":
            assert ep.netns in ours() and ep.url.startswith("http://10.213.")
    assert refused(url)  # moto (and the proxy) stopped
    assert ours() == []  # namespace and veth gone, also those made before netem was refused


def test_netem_namespace_when_the_kernel_has_it() -> None:
    why = netns_refused()
    if why:
        pytest.skip(why)
    with netem.moto_endpoint(25, proxy_fallback=False) as ep:
        if ep.mode == "loopback" and ("qdisc kind is unknown" in ep.note or "Operation not permitted" in ep.note):
            pytest.skip(f"netem not in this kernel: {ep.note}")  # anything else is a bug: fails below
        assert ep.mode == "netem", ep.note
        assert ep.rtt_ms is not None and ep.rtt_ms >= 45, ep
        assert ep.netns in ours()
        client = ep.client()
        bucket = ep.new_bucket("netem")
        client.put_object(Bucket=bucket, Key="k", Body=b"abc")
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"abc"
    assert ours() == []


def test_namespace_and_veth_plumbing() -> None:
    """The netem path up to the qdisc (which some kernels lack): moto in a namespace, over a veth."""
    why = netns_refused()
    if why:
        pytest.skip(why)
    with contextlib.ExitStack() as stack:
        ep = netem._netem(stack, 0.0, sys.executable, dict(os.environ, **netem.FAKE_CREDENTIALS), 60)
        assert ep.url.startswith("http://10.213.") and ep.netns in ours(), ep
        host, peer = ep.note.split("(")[1].split("/30)")[0].split(" <-> ")
        assert ep.url.startswith(f"http://{peer}:")
        listed = subprocess.run(["ip", "-n", ep.netns, "-o", "-4", "addr"], capture_output=True, text=True,
                                timeout=10).stdout
        assert peer in listed and host not in listed  # the peer end (and moto) live in the namespace
        client = ep.client()
        bucket = ep.new_bucket("netem")
        client.put_object(Bucket=bucket, Key="k", Body=b"abc")
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"abc"
        url = ep.url
    assert refused(url)
    assert ours() == []


def test_no_delay_is_plain_loopback() -> None:
    with netem.moto_endpoint(0) as ep:
        assert ep.url.startswith("http://127.0.0.1:") and ep.delay_ms == 0.0 and ep.mode == "loopback"
        assert ep.note.startswith("loopback, no delay")
        assert ep.rtt_ms is not None and ep.rtt_ms < 45, ep
        client = ep.client()
        bucket = ep.new_bucket("netem")
        client.put_object(Bucket=bucket, Key="k", Body=b"abc")
        assert client.get_object(Bucket=bucket, Key="k")["Body"].read() == b"abc"


def test_not_root_falls_back_to_loopback_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(netem.os, "geteuid", lambda: 1000)
    with netem.moto_endpoint(10, proxy_fallback=False) as ep:
        assert ep.mode == "loopback" and ep.delay_ms == 0.0 and ep.url.startswith("http://127.0.0.1:")
        assert "not root" in ep.note
    assert ours() == []


def test_an_error_in_the_body_stops_everything_and_propagates() -> None:
    with pytest.raises(KeyError, match="boom"):
        with netem.moto_endpoint(5) as ep:
            url = ep.url
            raise KeyError("boom")
    assert refused(url)
    assert ours() == []


def test_stale_namespaces_of_dead_runs_are_removed() -> None:
    why = netns_refused()
    if why:
        pytest.skip(why)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    stale_ns, stale_link = f"{netem.NETNS_PREFIX}{dead.pid}-ab", f"cfn{dead.pid}xabh"
    live_ns = f"{netem.NETNS_PREFIX}{os.getpid()}-cd"
    try:
        for cmd in (["netns", "add", stale_ns], ["netns", "add", live_ns],
                    ["link", "add", stale_link, "type", "veth", "peer", "name", f"cfn{dead.pid}xabp"]):
            subprocess.run(["ip", *cmd], check=True, capture_output=True, timeout=10)
        removed = netem.remove_stale()
        assert stale_ns in removed and any(r.startswith(f"cfn{dead.pid}xab") for r in removed), removed
        names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
        assert stale_ns not in names and live_ns in names  # a live process's namespace is left alone
        links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, timeout=10).stdout
        assert f"cfn{dead.pid}xab" not in links  # both ends of the pair
    finally:
        for cmd in (["netns", "del", stale_ns], ["netns", "del", live_ns], ["link", "del", stale_link]):
            subprocess.run(["ip", *cmd], capture_output=True, timeout=10)


def test_a_bandwidth_per_connection_paces_each_stream_but_not_their_sum() -> None:
    """``conn_mbps``: one GET of 4 MB through a 2 MB/s connection takes at least 2 s; four at
    once, each on its own connection, take about as long as one (a cap on their sum would put the
    last at 8 s): clients of such a store go faster with parallel ranged GETs."""
    body = bytes(4_000_000)
    with netem.moto_endpoint(0, conn_mbps=2) as ep:
        assert ep.mode == "proxy" and ep.conn_mbps == 2 and "2 MB/s per connection" in ep.note
        client = ep.client()
        bucket = ep.new_bucket("netem")
        client.put_object(Bucket=bucket, Key="k", Body=body)

        def get(_: int) -> float:
            own = ep.client()  # a client (and connection) of its own
            began = time.monotonic()
            assert own.get_object(Bucket=bucket, Key="k")["Body"].read() == body
            return time.monotonic() - began

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            four = list(pool.map(get, range(4)))
        assert min(four) >= 1.95  # paced, whatever else the machine does
        assert max(four) < 5.0  # side by side: the cap is each connection's, not the store's
    with pytest.raises(ValueError, match="conn_mbps"):
        with netem.moto_endpoint(0, conn_mbps=-1):
            pass
