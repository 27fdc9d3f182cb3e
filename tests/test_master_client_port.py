"""The master's client port (server/master/clientport.py): the cluster view with no gRPC.

A real master (and workers) in this process, asked over plain sockets as a training process
asks (client/transport/masterport.py); the session follows it without a gRPC watcher.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path

import pytest

from cachefs.client.transport.dataport import DataPortReader
from cachefs.client.transport.masterport import MasterPort, NotAMasterError
from cachefs.config import MasterConfig
from cachefs.localhost import PROTOCOL_VERSION
from cachefs.errors import UnauthenticatedError
from cachefs.proto import common_pb2, dataport_pb2, master_pb2
from cachefs.server.master.daemon import Master
from helpers import client, payload, wait_for

HELLO = common_pb2.MetaRequest(op=common_pb2.MetaRequest.HELLO)


@pytest.fixture
def master(tmp_path: Path):
    started = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "master"))).start()
    yield started
    started.stop(grace=0.5)


def _reader(master: Master, token: str = "") -> DataPortReader:
    return DataPortReader("127.0.0.1", master.port + 1, token=token, timeout=5.0)


def test_the_client_port_is_next_to_the_grpc_port_and_answers_as_a_master(master):
    assert master.client_port is not None and master.client_port.port == master.port + 1
    reader = _reader(master)
    try:
        hello = reader.meta(HELLO)
        assert (hello.role, hello.protocol) == ("master", PROTOCOL_VERSION) and PROTOCOL_VERSION >= 2
        reply = reader.meta(common_pb2.MetaRequest(op=common_pb2.MetaRequest.VIEW))
        view = master_pb2.ClusterView.FromString(reply.view)
        assert view.master_id == master.master_id and reply.view_version == view.version > 0
        # The same version again: no view in the reply, only its version.
        again = reader.meta(common_pb2.MetaRequest(op=common_pb2.MetaRequest.VIEW, known_version=view.version))
        assert again.view == b"" and again.view_version == view.version
    finally:
        reader.close()


def test_a_session_follows_the_view_through_the_client_port_with_no_grpc_watcher(master, local_store,
                                                                                make_worker):
    objects = {f"k{i}": payload(5000 + i, i) for i in range(4)}
    for key, data in objects.items():
        local_store.add(key, data)
    first = make_worker(local_store.mount, master=master.address)
    assert wait_for(lambda: len(master.membership.live()) == 1, timeout=20)
    fs = client(master=master.address)
    assert fs.cat_file("cachefs://data/k0") == objects["k0"]
    state = fs.session._state.get()
    assert state.watcher is None and state.poller is not None
    assert [w.address for w in state.view.workers] == [first.address]
    # A worker that joins is in the session's view within a few polls.
    second = make_worker(local_store.mount, master=master.address)
    assert wait_for(lambda: {w.address for w in fs.session._state.get().view.workers}
                    == {first.address, second.address}, timeout=20)
    assert {fs.cat_file(f"cachefs://data/{k}") for k in objects} == set(objects.values())


def test_the_token_is_checked_and_a_wrong_one_is_a_precise_error(tmp_path):
    config = MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "m"), access_token="s3cret-token")
    master = Master(config).start()
    try:
        view = common_pb2.MetaRequest(op=common_pb2.MetaRequest.VIEW)
        with pytest.raises(UnauthenticatedError):
            _reader(master, token="wrong").meta(view)
        assert _reader(master, token="s3cret-token").meta(view).view
        port = MasterPort(master.address, token="wrong", timeout=5.0)
        with pytest.raises(UnauthenticatedError):
            port.view(0, 5.0)  # not taken for "no client port" (which would send the session to gRPC)
        port.close()
    finally:
        master.stop(grace=0.5)
    # open_status lets the view through without a token, as it does GetView.
    open_master = Master(MasterConfig(host="127.0.0.1", port=0, state_dir=str(tmp_path / "o"),
                                      access_token="s3cret-token", open_status=True)).start()
    try:
        assert _reader(open_master).meta(common_pb2.MetaRequest(op=common_pb2.MetaRequest.VIEW)).view
    finally:
        open_master.stop(grace=0.5)


def test_bad_frames_get_an_error_or_a_close_within_seconds(master):
    address = ("127.0.0.1", master.port + 1)

    def exchange(data: bytes, shut: bool = True) -> bytes:
        with socket.create_connection(address, timeout=5) as sock:
            sock.sendall(data)
            if shut:
                sock.shutdown(socket.SHUT_WR)
            started, got = time.monotonic(), b""
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                got += chunk
            assert time.monotonic() - started < 5, "neither answered nor closed within seconds"
            return got

    def reply_of(raw: bytes) -> dataport_pb2.DataReply:
        (size,) = struct.unpack(">I", raw[:4])
        return dataport_pb2.DataReply.FromString(raw[4:4 + size])

    oversized = reply_of(exchange(struct.pack(">I", 10 << 20) + b"x" * 100))
    assert oversized.code == dataport_pb2.DataReply.REFUSED and "too large" in oversized.message
    malformed = reply_of(exchange(struct.pack(">I", 5) + b"\xff\xff\xff\xff\xff"))
    assert malformed.code == dataport_pb2.DataReply.REFUSED
    assert exchange(os.urandom(3)) == b""  # a truncated header, then closed for writing: closed
    not_meta = dataport_pb2.DataRequest(path="data/k", length=10).SerializeToString()
    refused = reply_of(exchange(struct.pack(">I", len(not_meta)) + not_meta))
    assert refused.code == dataport_pb2.DataReply.REFUSED and "metadata operations only" in refused.message
    # The port still serves.
    assert _reader(master).meta(HELLO).role == "master"


def test_a_port_that_is_not_a_masters_is_never_taken_for_one(local_store, make_worker):
    worker = make_worker(local_store.mount)  # its data port answers HELLO as a worker
    assert worker.data_port
    port = MasterPort(f"127.0.0.1:{worker.data_port - 1}", timeout=5.0)
    with pytest.raises(NotAMasterError):
        port.view(0, 5.0)
    port.close()


def test_the_next_master_of_the_list_answers_when_the_first_is_down(master):
    with socket.socket() as taken:  # a free port pair with nothing listening
        taken.bind(("127.0.0.1", 0))
        dead = taken.getsockname()[1]
    port = MasterPort(f"127.0.0.1:{dead},{master.address}", timeout=5.0)
    try:
        view, version = port.view(0, 5.0)
        assert view is not None and view.master_id == master.master_id and version == view.version
    finally:
        port.close()


def test_a_fixed_port_whose_neighbour_is_taken_runs_without_a_client_port_and_clients_use_grpc(
        tmp_path, local_store, make_worker):
    local_store.add("k", b"bytes of k")
    for _ in range(20):  # find a port pair: grpc's port free, its neighbour held by us
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        grpc_port = holder.getsockname()[1] - 1
        try:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", grpc_port))
            break
        except OSError:
            holder.close()
    else:
        pytest.skip("no free port pair on loopback")
    try:
        master = Master(MasterConfig(host="127.0.0.1", port=grpc_port, state_dir=str(tmp_path / "m"))).start()
        try:
            assert master.client_port is None
            make_worker(local_store.mount, master=master.address)
            assert wait_for(lambda: len(master.membership.live()) == 1, timeout=20)
            fs = client(master=master.address)
            assert fs.cat_file("cachefs://data/k") == b"bytes of k"
            assert fs.session._state.get().watcher is not None  # through gRPC
        finally:
            master.stop(grace=0.5)
    finally:
        holder.close()
