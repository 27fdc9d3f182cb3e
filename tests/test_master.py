"""The master: membership with leases, the watched view, the durable mount table, tokens, metrics."""

from __future__ import annotations

import json
import os
import queue
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cachefs.config import MasterConfig
from cachefs.errors import UnknownMountError
from cachefs.mounts import MountSpec
from cachefs.proto import master_pb2, master_pb2_grpc
from cachefs.server.master import Master
from cachefs.auth import TOKEN_METADATA
from cachefs.server.master.state import DB_NAME, MasterState
from cachefs.server.master.membership import Membership
from cachefs.server.master.viewversion import ViewVersion
from helpers import FakeClock, scrape, wait_for

SECRET = "sEcReT-9f8e7d6c"
TOKEN = "cluster-token-123"


# -- membership (unit, injected clock) --


def test_membership_leases_with_injected_clock():
    clock = FakeClock()
    m = Membership(lease_seconds=10, clock=clock)
    v0 = m.version
    m.register("w1", "h:1")
    assert [x.worker_id for x in m.live()] == ["w1"] and m.version == v0 + 1

    for _ in range(5):  # heartbeats within the lease keep it, and do not churn the view
        clock.advance(6)
        assert m.heartbeat("w1", stats="s") is True
        assert m.expire() == []
    assert m.version == v0 + 1 and m.get("w1").stats == "s"

    m.register("w1", "h:1")  # re-registration at the same address: renews, no new view
    assert m.version == v0 + 1
    m.register("w1", "h:2")  # a new address: a new view
    assert m.version == v0 + 2 and m.get("w1").address == "h:2"

    assert m.heartbeat("nobody") is False
    clock.advance(10.5)
    assert m.expire() == ["w1"] and m.live() == [] and m.version == v0 + 3
    assert m.heartbeat("w1") is False
    m.register("w1", "h:2")  # re-registration after expiry
    assert [x.worker_id for x in m.live()] == ["w1"] and m.version == v0 + 4
    assert m.stats().expirations == 1 and m.stats().registrations == 4


def test_heartbeat_after_lease_ran_out_but_before_the_reaper_is_refused():
    clock = FakeClock()
    m = Membership(lease_seconds=5, clock=clock)
    m.register("w1", "h:1")
    v = m.version
    clock.advance(5.1)
    assert m.heartbeat("w1") is False  # the worker must register again
    assert m.live() == [] and m.version == v + 1


def test_reaper_thread_expires_and_stops():
    clock = FakeClock()
    m = Membership(lease_seconds=1, clock=clock)
    m.register("a", "h:1")
    m.register("b", "h:2")
    m.start_reaper(interval=0.01)
    try:
        clock.advance(0.5)
        m.heartbeat("b")
        clock.advance(0.6)
        deadline = time.monotonic() + 5
        while [x.worker_id for x in m.live()] != ["b"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [x.worker_id for x in m.live()] == ["b"]
    finally:
        m.stop(timeout=5)


def test_view_version_wait_wakes_on_bump():
    v = ViewVersion(base=7)
    threading.Timer(0.05, v.bump).start()
    t0 = time.monotonic()
    assert v.wait_change(7, timeout=5) == 8
    assert time.monotonic() - t0 < 2
    assert v.wait_change(7, timeout=5) == 8  # already different: no wait


# -- durable state (unit) --


def test_state_mounts_persist_and_files_are_private(tmp_path):
    state_dir = tmp_path / "state"
    s = MasterState(state_dir)
    master_id, boot = s.master_id, s.boot
    assert s.mounts() == (0, [])
    assert s.add_mount(MountSpec("data", "s3://b/p", {"key": SECRET})) == 1
    with pytest.raises(FileExistsError):
        s.add_mount(MountSpec("data", "s3://b/other"))
    assert s.add_mount(MountSpec("data", "s3://b/q", {"key": SECRET}), replace=True) == 2
    assert s.add_mount(MountSpec("gone", "/tmp/x")) == 3
    assert s.remove_mount("gone") == 4
    with pytest.raises(UnknownMountError):
        s.remove_mount("gone")
    s.close()

    assert stat.S_IMODE(os.stat(state_dir).st_mode) == 0o700
    for path in state_dir.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path

    s = MasterState(state_dir)
    try:
        assert (s.master_id, s.boot) == (master_id, boot + 1)
        version, mounts = s.mounts()
        assert version == 4 and [(m.name, m.url, dict(m.options)) for m in mounts] == [("data", "s3://b/q", {"key": SECRET})]
        # Configured mounts are added only when absent: the durable table wins.
        assert s.ensure_mounts([MountSpec("data", "s3://b/config"), MountSpec("new", "/tmp/n")]) == ["new"]
        assert {m.name: m.url for m in s.mounts()[1]} == {"data": "s3://b/q", "new": "/tmp/n"}
    finally:
        s.close()


# -- the gRPC service (in-process server on port 0) --


@pytest.fixture
def start_master(tmp_path) -> Iterator:
    masters: list[Master] = []
    channels: list[grpc.Channel] = []

    def start(clock=None, watch_poll_seconds=None, **overrides) -> tuple[Master, master_pb2_grpc.MasterServiceStub]:
        settings = dict(port=0, metrics_port=0, state_dir=str(tmp_path / "state"), shutdown_grace=0.5,
                        # These tests mount made-up dirs in /tmp and memory:// (the policy's own
                        # tests are in test_attacks.py).
                        allowed_local_roots=("/tmp",), allowed_schemes=("s3", "memory"))
        settings.update(overrides)
        kwargs = {"clock": clock} if clock is not None else {}
        if watch_poll_seconds is not None:
            kwargs["watch_poll_seconds"] = watch_poll_seconds
        master = Master(MasterConfig(**settings), **kwargs).start()
        masters.append(master)
        channel = grpc.insecure_channel(master.address)
        channels.append(channel)
        return master, master_pb2_grpc.MasterServiceStub(channel)

    yield start
    for channel in channels:
        channel.close()
    for master in masters:
        master.stop()


def _register(stub, worker_id: str, address: str, token: str | None = None, **stats) -> master_pb2.RegisterWorkerResponse:
    info = master_pb2.WorkerInfo(worker_id=worker_id, address=address, version="0.1.0",
                                 stats=master_pb2.WorkerStats(**stats))
    return stub.RegisterWorker(master_pb2.RegisterWorkerRequest(worker=info), timeout=5, metadata=_md(token))


def _md(token: str | None) -> list[tuple[str, str]] | None:
    return [(TOKEN_METADATA, token)] if token else None


def _view(stub) -> master_pb2.ClusterView:
    return stub.GetView(master_pb2.GetViewRequest(), timeout=5)


def _code(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code()


def _watch(stub, known: int = 0) -> tuple[queue.Queue, grpc.Future]:
    """A WatchView stream drained by a thread into a queue (None when the stream ends)."""
    call = stub.WatchView(master_pb2.GetViewRequest(known_version=known))
    out: queue.Queue = queue.Queue()

    def drain() -> None:
        try:
            for view in call:
                out.put(view)
        except grpc.RpcError as err:
            out.put(err)
        out.put(None)

    threading.Thread(target=drain, daemon=True).start()
    return out, call


def test_register_heartbeat_and_view(start_master):
    master, stub = start_master(lease_seconds=10, heartbeat_seconds=2, vnodes=100, stripe_size=1 << 20)
    before = _view(stub)
    assert before.workers == [] and before.master_id == master.master_id
    assert (before.ring.vnodes, before.ring.stripe_size) == (100, 1 << 20)

    reply = _register(stub, "w2", "127.0.0.1:7002", used_bytes=5)
    assert (reply.lease_seconds, reply.heartbeat_seconds) == (10, 2)
    _register(stub, "w1", "127.0.0.1:7001")
    view = _view(stub)
    assert [(w.worker_id, w.address) for w in view.workers] == [("w1", "127.0.0.1:7001"), ("w2", "127.0.0.1:7002")]
    assert view.version == before.version + 2 == reply.view_version + 1
    assert view.workers[1].stats.used_bytes == 5 and view.workers[1].registered_at > 0

    # Stats-only heartbeats keep the worker and do not bump the version; GetView shows fresh stats.
    for used in range(10, 15):
        hb = stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w2", stats=master_pb2.WorkerStats(used_bytes=used)),
                            timeout=5)
        assert hb.registered and hb.view_version == view.version
    after = _view(stub)
    assert after.version == view.version and after.workers[1].stats.used_bytes == 14

    hb = stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="stranger"), timeout=5)
    assert hb.registered is False


def test_lease_expiry_for_real_over_grpc(start_master):
    # Real time: heartbeats every 0.2 s against a 1.5 s lease, so a loaded machine may stall
    # a heartbeat by over a second before a live worker would (rightly) expire.
    master, stub = start_master(lease_seconds=1.5, heartbeat_seconds=0.2)
    _register(stub, "w1", "127.0.0.1:7001")
    _register(stub, "w2", "127.0.0.1:7002")
    joined = _view(stub).version
    end = time.monotonic() + 3.5  # both heartbeat for well over two leases: both stay
    while time.monotonic() < end:
        for wid in ("w1", "w2"):
            assert stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id=wid), timeout=5).registered
        time.sleep(0.2)
    assert [w.worker_id for w in _view(stub).workers] == ["w1", "w2"] and _view(stub).version == joined

    # w2 stops heartbeating: it leaves within the lease plus a reaper round.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        assert stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1"), timeout=5).registered
        view = _view(stub)
        if [w.worker_id for w in view.workers] == ["w1"]:
            break
        time.sleep(0.1)
    assert [w.worker_id for w in view.workers] == ["w1"] and view.version > joined
    assert stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w2"), timeout=5).registered is False
    _register(stub, "w2", "127.0.0.1:7002")  # re-registration after expiry
    assert [w.worker_id for w in _view(stub).workers] == ["w1", "w2"]


def test_watch_view_sends_current_then_each_change_and_stops_on_cancel(start_master):
    clock = FakeClock()
    # The watch's own poll is made long (30 s), so a view that comes in seconds came from the
    # change waking the stream; the bound leaves a loaded machine room.
    master, stub = start_master(clock=clock, watch_poll_seconds=30, lease_seconds=10, heartbeat_seconds=2)
    views, call = _watch(stub)
    first = views.get(timeout=10)
    assert first.version == _view(stub).version and first.workers == []

    def next_view() -> master_pb2.ClusterView:
        t0 = time.monotonic()
        view = views.get(timeout=10)
        assert isinstance(view, master_pb2.ClusterView), view
        assert time.monotonic() - t0 < 10
        return view

    _register(stub, "w1", "127.0.0.1:7001")  # join
    joined = next_view()
    assert [w.worker_id for w in joined.workers] == ["w1"] and joined.version > first.version

    for _ in range(3):  # stats-only heartbeats: no new view
        stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1", stats=master_pb2.WorkerStats(pages=1)), timeout=5)
    stub.AddMount(master_pb2.AddMountRequest(name="data", url="memory://bucket"), timeout=5)  # mount add
    mounted = next_view()
    assert [m.name for m in mounted.mounts] == ["data"] and mounted.version == joined.version + 1

    clock.advance(11)  # leave: the lease runs out
    assert master.membership.expire() == ["w1"]
    left = next_view()
    assert left.workers == [] and left.version == mounted.version + 1

    assert master.metrics.watchers._value.get() == 1
    call.cancel()
    deadline = time.monotonic() + 3
    while master.metrics.watchers._value.get() != 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert master.metrics.watchers._value.get() == 0, "the server side of a cancelled watch ends"

    # A watch that already knows the current version gets nothing until the next change.
    # Once the server side is watching, the first view it sends is the next change's, not the
    # current one again (which would have no workers).
    views, call = _watch(stub, known=left.version)
    assert wait_for(lambda: master.metrics.watchers._value.get() == 1)
    _register(stub, "w9", "127.0.0.1:7009")
    nine = next_view()
    assert [w.worker_id for w in nine.workers] == ["w9"] and nine.version == left.version + 1
    call.cancel()


def test_watch_streams_end_when_the_master_stops_and_are_capped(tmp_path):
    config = MasterConfig(port=0, state_dir=str(tmp_path / "state"), shutdown_grace=2)
    master = Master(config, max_watchers=1).start()
    with grpc.insecure_channel(master.address) as channel:
        stub = master_pb2_grpc.MasterServiceStub(channel)
        views, call = _watch(stub)
        assert isinstance(views.get(timeout=2), master_pb2.ClusterView)
        assert _code(lambda: next(stub.WatchView(master_pb2.GetViewRequest(), timeout=5))) == \
            grpc.StatusCode.RESOURCE_EXHAUSTED
        _register(stub, "w1", "127.0.0.1:7001")  # unary calls still find a thread
        t0 = time.monotonic()
        master.stop()
        assert time.monotonic() - t0 < 2
        end = views.get(timeout=2)
        while isinstance(end, master_pb2.ClusterView):
            end = views.get(timeout=2)
        assert end is None or isinstance(end, grpc.RpcError)


def test_mount_table_add_replace_remove_and_errors(start_master):
    master, stub = start_master()
    add = lambda **kw: stub.AddMount(master_pb2.AddMountRequest(**kw), timeout=5)  # noqa: E731
    v1 = add(name="data", url="s3://bucket/p", options_json=json.dumps({"endpoint_url": "http://s3"})).mounts_version
    assert _code(lambda: add(name="data", url="s3://bucket/q")) == grpc.StatusCode.ALREADY_EXISTS
    v2 = add(name="data", url="s3://bucket/q", read_only=True, replace=True).mounts_version
    v3 = add(name="other", url="/tmp/other").mounts_version
    assert v1 < v2 < v3
    listed = stub.GetMounts(master_pb2.GetMountsRequest(), timeout=5)
    assert listed.mounts_version == v3
    assert [(m.name, m.url, m.read_only) for m in listed.mounts] == [("data", "s3://bucket/q", True),
                                                                      ("other", "/tmp/other", False)]
    assert stub.RemoveMount(master_pb2.RemoveMountRequest(name="other"), timeout=5).mounts_version == v3 + 1
    assert _code(lambda: stub.RemoveMount(master_pb2.RemoveMountRequest(name="other"), timeout=5)) == \
        grpc.StatusCode.NOT_FOUND
    hb_versions = stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="x"), timeout=5)
    assert hb_versions.mounts_version == v3 + 1

    bad = [
        dict(name="../x", url="s3://b"),
        dict(name="", url="s3://b"),
        dict(name="ok", url=""),
        dict(name="ok", url="s3://b", options_json="{not json"),
        dict(name="ok", url="s3://b", options_json="[1, 2]"),
        dict(name="ok", url="nosuchproto://b"),
    ]
    for request in bad:
        with pytest.raises(grpc.RpcError) as info:
            add(**request)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, request
        assert info.value.details(), request
    for worker_id, address in [("", "h:1"), ("w", "nohostport"), ("w", "h:0"), ("w", "h:99999"), ("a b", "h:1")]:
        assert _code(lambda: _register(stub, worker_id, address)) == grpc.StatusCode.INVALID_ARGUMENT
    assert _code(lambda: stub.Heartbeat(master_pb2.HeartbeatRequest(), timeout=5)) == grpc.StatusCode.INVALID_ARGUMENT


def _unpinned(options: dict) -> dict:
    """A mount's options without what the master pinned (#49): its region, and checksums only
    where required against a store that is not AWS."""
    options = dict(options)
    client_kwargs = {k: v for k, v in options.pop("client_kwargs", {}).items() if k != "region_name"}
    if client_kwargs or "client_kwargs" in options:
        options["client_kwargs"] = client_kwargs
    config = {k: v for k, v in options.pop("config_kwargs", {}).items()
              if k not in ("request_checksum_calculation", "response_checksum_validation")}
    if config:
        options["config_kwargs"] = config
    return options


def test_credentials_only_with_the_token(start_master):
    master, stub = start_master(cluster_token=TOKEN)
    options = {"key": SECRET, "secret": SECRET, "client_kwargs": {"aws_session_token": SECRET},
               "endpoint_url": "http://s3.local"}
    assert _code(lambda: stub.AddMount(master_pb2.AddMountRequest(name="data", url="s3://b/p",
                                                                  options_json=json.dumps(options)), timeout=5)) == \
        grpc.StatusCode.UNAUTHENTICATED
    stub.AddMount(master_pb2.AddMountRequest(name="data", url="s3://b/p", options_json=json.dumps(options)),
                  timeout=5, metadata=_md(TOKEN))

    # Without credentials (token or not): the secret never leaves the master.
    for response in (_view(stub), stub.GetMounts(master_pb2.GetMountsRequest(), timeout=5),
                     stub.GetMounts(master_pb2.GetMountsRequest(), timeout=5, metadata=_md(TOKEN))):
        assert SECRET.encode() not in response.SerializeToString()
    public = json.loads(_view(stub).mounts[0].options_json)
    # Besides what was given, the region the master resolved (#49), and checksums only where required off AWS.
    assert public == {"client_kwargs": {"region_name": public["client_kwargs"]["region_name"]},
                      "endpoint_url": "http://s3.local",
                      "config_kwargs": {"request_checksum_calculation": "when_required",
                                        "response_checksum_validation": "when_required"}}

    full = stub.GetMounts(master_pb2.GetMountsRequest(with_credentials=True), timeout=5, metadata=_md(TOKEN))
    assert _unpinned(json.loads(full.mounts[0].options_json)) == options

    for token in (None, "wrong", TOKEN + "x"):
        for call in (
            lambda: stub.GetMounts(master_pb2.GetMountsRequest(with_credentials=True), timeout=5, metadata=_md(token)),
            lambda: _register(stub, "w1", "127.0.0.1:7001", token=token),
            lambda: stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1"), timeout=5, metadata=_md(token)),
            lambda: stub.RemoveMount(master_pb2.RemoveMountRequest(name="data"), timeout=5, metadata=_md(token)),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert TOKEN not in info.value.details() and SECRET not in info.value.details()
    assert _register(stub, "w1", "127.0.0.1:7001", token=TOKEN).lease_seconds == 10
    assert stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1"), timeout=5, metadata=_md(TOKEN)).registered


def test_restart_keeps_mounts_and_id_but_not_workers(start_master, tmp_path):
    configured = (MountSpec("cfg", "/tmp/cfg"), MountSpec("gone", "/tmp/gone"))
    master, stub = start_master(mounts=configured)
    stub.AddMount(master_pb2.AddMountRequest(name="data", url="s3://b/p", options_json=json.dumps({"key": SECRET})),
                  timeout=5)
    stub.AddMount(master_pb2.AddMountRequest(name="cfg", url="/tmp/changed", replace=True), timeout=5)
    stub.RemoveMount(master_pb2.RemoveMountRequest(name="gone"), timeout=5)
    _register(stub, "w1", "127.0.0.1:7001")
    before = _view(stub)
    master.stop()

    master2, stub2 = start_master(mounts=configured)
    after = _view(stub2)
    assert after.master_id == before.master_id == master2.master_id
    assert after.workers == []
    assert after.version > before.version, "a restarted master never reuses a version"
    # The durable table wins over the config for a name it holds; configured mounts that are
    # absent (never added, or removed since) are added at start.
    assert {m.name: m.url for m in after.mounts} == {"cfg": "/tmp/changed", "data": "s3://b/p", "gone": "/tmp/gone"}
    full = stub2.GetMounts(master_pb2.GetMountsRequest(with_credentials=True), timeout=5)
    assert _unpinned({m.name: json.loads(m.options_json) for m in full.mounts}["data"]) == {"key": SECRET}
    assert stub2.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1"), timeout=5).registered is False
    _register(stub2, "w1", "127.0.0.1:7001")
    assert [w.worker_id for w in _view(stub2).workers] == ["w1"]
    assert (Path(tmp_path) / "state" / DB_NAME).exists()


def test_metrics_endpoint(start_master):
    master, stub = start_master()
    _register(stub, "w1", "127.0.0.1:7001")
    stub.Heartbeat(master_pb2.HeartbeatRequest(worker_id="w1"), timeout=5)
    stub.AddMount(master_pb2.AddMountRequest(name="data", url="/tmp/d"), timeout=5)
    _code(lambda: stub.RemoveMount(master_pb2.RemoveMountRequest(name="nope"), timeout=5))
    m = scrape(master.metrics_port)
    assert m["cachefs_master_workers_live"] == 1
    assert m["cachefs_master_mounts"] == 1 and m["cachefs_master_mounts_version"] == 1
    assert m["cachefs_master_view_version"] == _view(stub).version
    assert m["cachefs_master_registrations_total"] == 1
    assert m["cachefs_master_heartbeats_total"] == 1
    assert m["cachefs_master_expirations_total"] == 0
    assert m["cachefs_master_watchers"] == 0
    assert m['cachefs_master_requests_total{code="OK",method="RegisterWorker"}'] == 1
    assert m['cachefs_master_requests_total{code="NOT_FOUND",method="RemoveMount"}'] == 1
    assert m['cachefs_master_request_seconds_count{method="Heartbeat"}'] == 1
    assert "cachefs_master_views_sent_total" in m


# -- as a real process --


def _cli_has_master() -> bool:
    try:
        out = subprocess.run([sys.executable, "-m", "cachefs.cli", "--help"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "master" in out


@pytest.mark.skipif(not _cli_has_master(), reason="the `cachefs master` subcommand is not in the CLI yet")
def test_master_process_ready_line_state_and_sigterm(tmp_path):
    from cachefs.local import DaemonProcess

    state_dir = str(tmp_path / "state")
    args = ["master", "--port", "0", "--metrics-port", "0", "--state-dir", state_dir, "--mount", "data=/tmp/data"]
    with DaemonProcess(args, log_path=str(tmp_path / "m1.log")) as m1:
        assert {"address", "port", "metrics_port", "master_id"} <= set(m1.ready)
        with grpc.insecure_channel(m1.address) as channel:
            stub = master_pb2_grpc.MasterServiceStub(channel)
            _register(stub, "w1", "127.0.0.1:7001")
            view = _view(stub)
            assert [w.worker_id for w in view.workers] == ["w1"] and [m.name for m in view.mounts] == ["data"]
            assert view.master_id == m1.ready["master_id"]
        assert m1.stop() == 0
    with DaemonProcess(args, log_path=str(tmp_path / "m2.log")) as m2:
        assert m2.ready["master_id"] == m1.ready["master_id"]
        with grpc.insecure_channel(m2.address) as channel:
            view = _view(master_pb2_grpc.MasterServiceStub(channel))
            assert view.workers == [] and [m.name for m in view.mounts] == ["data"]
