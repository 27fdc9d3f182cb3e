"""Settings defined once: reader defaults from WorkerConfig, gRPC message limits shared by the
worker and its clients, one HOST:PORT check for configs, the master and the clients."""

from __future__ import annotations

import dataclasses

import pytest

from cachefs.addresses import split_address
from cachefs.client.transport.grpcchannels import CHANNEL_OPTIONS
from cachefs.config import ClientConfig, WorkerConfig
from cachefs.errors import InvalidPathError
from cachefs.server.master.service import check_address
from cachefs.server.worker import GRPC_OPTIONS
from cachefs.server.worker.reader import ReaderOptions
from cachefs.tls import MESSAGE_OPTIONS


def test_reader_options_are_worker_config_fields_with_its_defaults():
    worker_fields = {f.name: f for f in dataclasses.fields(WorkerConfig)}
    for f in dataclasses.fields(ReaderOptions):
        assert f.name in worker_fields, f"ReaderOptions.{f.name} is no WorkerConfig field"
        assert f.default == worker_fields[f.name].default, f.name
    config = WorkerConfig(fetch_threads=3, readahead_pages=0, store_timeout=7.0, max_pending_write_bytes=1 << 20)
    options = ReaderOptions.from_config(config)
    assert (options.fetch_threads, options.readahead_pages, options.store_timeout,
            options.max_pending_write_bytes) == (3, 0, 7.0, 1 << 20)


def test_worker_and_clients_share_message_limits():
    for name, value in MESSAGE_OPTIONS:
        assert (name, value) in GRPC_OPTIONS and (name, value) in CHANNEL_OPTIONS
    names = [n for n, _ in GRPC_OPTIONS + CHANNEL_OPTIONS if "message_length" in n]
    assert len(names) == 2 * len(MESSAGE_OPTIONS)  # no second, different limit anywhere


@pytest.mark.parametrize("address,expected", [("h:1", ("h", 1)), ("10.0.0.1:29999", ("10.0.0.1", 29999)),
                                              ("[::1]:80", ("::1", 80))])
def test_addresses_split(address, expected):
    assert split_address(address) == expected
    assert check_address(address) == address
    ClientConfig(workers=(address,))


@pytest.mark.parametrize("bad", ["h", ":1", "h:", "h:0", "h:65536", "h:x", "h :1", "h:1 "])
def test_bad_addresses_fail_the_same_way_everywhere(bad):
    with pytest.raises(ValueError, match="not HOST:PORT"):
        split_address(bad)
    with pytest.raises(InvalidPathError, match="not HOST:PORT"):
        check_address(bad)
    if bad.strip() == bad:  # a client's address list is comma-separated; spaces around items are trimmed
        with pytest.raises(ValueError, match="worker address .* not HOST:PORT"):
            ClientConfig(workers=(bad,))


def test_the_client_options_table_lists_every_option_once_with_its_variable():
    from pathlib import Path

    text = (Path(__file__).parent.parent / "docs" / "configuration.md").read_text()
    section = text.split("## Client (`cachefs://`)", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    listed = {line.split("`")[1]: line for line in rows}
    fields = {f.name for f in dataclasses.fields(ClientConfig)}
    assert set(listed) == fields and len(rows) == len(fields)
    for name, line in listed.items():
        assert f"`CACHEFS_{name.upper()}`" in line, name
