"""S3 data reads through the worker's own HTTP client (cachefs/store/s3http.py) and obstore
(cachefs/store/native.py) against a real S3 endpoint (moto): the same contract as the s3fs
backend (pinned to the version, errors as the worker expects), and the mounts they must leave
to s3fs. The HTTP client's protocol cases (retries, broken streams, ...) are in test_s3http.py."""

from __future__ import annotations

import datetime
import time

import pytest

from cachefs.errors import StaleObjectError, StoreUnavailableError
from cachefs.mounts import MountSpec, MountTable
from cachefs.paths import CachePath
from cachefs.store import native, s3http
from cachefs.store.backends import _S3Backend
from cachefs.store.health import StoreBreaker
from cachefs.store.objects import ObjectStore
from helpers import payload

BACKENDS = {"http": s3http.HttpS3Backend, "obstore": native.NativeS3Backend}
CLIENTS = [pytest.param("http"),
           pytest.param("obstore", marks=pytest.mark.skipif(native.obstore is None,
                                                            reason="obstore is not installed (cachefs[native])"))]


@pytest.fixture(params=CLIENTS)
def client(request) -> str:
    return request.param


def _objects(s3_store, client: str = "auto") -> ObjectStore:
    return ObjectStore(MountTable([s3_store.mount]), metadata_ttl=60, s3_client=client)


def _backend(objects: ObjectStore, path: CachePath):
    return objects._backend(objects.mounts.resolve(path))


def test_s3_data_reads_are_pinned_to_the_version(s3_store, client):
    data = payload(3 * (1 << 20) + 5, 1)
    s3_store.add("big.bin", data)
    objects = _objects(s3_store, client)
    path = CachePath("data", "big.bin")
    assert isinstance(_backend(objects, path), BACKENDS[client])
    meta, head = objects.open(path, 1 << 20)  # one GET: metadata and the first page
    assert (meta.size, head) == (len(data), data[:1 << 20])
    assert meta.version == objects.info(path, refresh=True).version  # the same ETag s3fs sees
    assert objects.read(meta, 7, 70_000) == data[7:70_000]
    pieces: dict[int, bytes] = {}
    objects.read_pieces(meta, 1 << 20, [1 << 20, 1 << 20, 5], pieces.__setitem__)
    assert b"".join(pieces[i] for i in range(3)) == data[1 << 20:]
    with pytest.raises(StaleObjectError):  # a stream shorter than asked is never taken as whole
        objects.read_pieces(meta, 3 << 20, [5, 10], {}.__setitem__)
    s3_store.add("big.bin", payload(len(data), 2))  # changed in the store
    with pytest.raises(StaleObjectError):
        objects.read(meta, 0, 10)
    with pytest.raises(StaleObjectError):
        objects.read_pieces(meta, 0, [10], pieces.__setitem__)


def test_what_a_get_cannot_tell_is_left_to_s3fs(s3_store, client):
    s3_store.add("d/empty.bin", b"")
    s3_store.add("d/x.bin", b"x")
    objects = _objects(s3_store, client)
    meta, head = objects.open(CachePath("data", "d/empty.bin"), 1 << 20)
    assert (meta.size, meta.is_dir, head) == (0, False, None)
    meta, head = objects.open(CachePath("data", "d"), 1 << 20)
    assert meta.is_dir and head is None
    with pytest.raises(FileNotFoundError):
        objects.open(CachePath("data", "d/missing.bin"), 1 << 20)
    meta = objects.info(CachePath("data", "d/x.bin"))
    s3_store.delete("d/x.bin")
    with pytest.raises(FileNotFoundError):
        objects.read(meta, 0, 1)


def test_an_unreachable_store_trips_the_breaker_quickly(aws_env, dead_port, client):
    mounts = MountTable([MountSpec("m", "s3://bucket/root", {"endpoint_url": f"http://127.0.0.1:{dead_port}",
                                                            "key": "k", "secret": "s"})])
    objects = ObjectStore(mounts, breaker=StoreBreaker(threshold=2, cooldown=30.0), s3_client=client)
    assert isinstance(_backend(objects, CachePath("m", "k")), BACKENDS[client])
    timings = []
    for i in range(3):
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailableError):
            objects.open(CachePath("m", f"k{i}"), 1 << 20)
        timings.append(time.monotonic() - t0)
    assert max(timings) < 5.0, timings
    assert objects.breaker.open_mounts() == ["m"]


_RETRY = {"retry_timeout": datetime.timedelta(seconds=30)}


@pytest.mark.parametrize("options, expected", [
    ({"key": "a", "secret": "b", "token": "t", "endpoint_url": "http://127.0.0.1:9000",
      "client_kwargs": {"region_name": "eu-west-1"}, "skip_instance_cache": True},
     {"endpoint": "http://127.0.0.1:9000", "region": "eu-west-1", "virtual_hosted_style_request": False,
      "client_options": {"allow_http": True, "connect_timeout": "3s", "timeout": "15s"},  # s3fs: read_timeout 15
      "retry_config": {"max_retries": 2, **_RETRY}}),
    ({"anon": True, "requester_pays": True, "client_kwargs": {"region_name": "eu-west-1", "verify": False},
      "config_kwargs": {"connect_timeout": 3, "read_timeout": 60, "retries": {"max_attempts": 4, "mode": "standard"}}},
     {"endpoint": "https://bucket.s3.eu-west-1.amazonaws.com", "region": "eu-west-1",
      "virtual_hosted_style_request": True, "skip_signature": True, "request_payer": True,
      "client_options": {"connect_timeout": "3s", "timeout": "60s", "allow_invalid_certificates": True},
      "retry_config": {"max_retries": 4, **_RETRY}}),
    ({"key": "a", "secret": "b", "client_kwargs": {"verify": "/etc/my-ca.pem"}}, None),  # obstore takes no CA file
    ({"key": "a", "secret": "b", "config_kwargs": {"proxies": {"https": "http://proxy:3128"}}}, None),
])
def test_obstore_takes_botocores_resolution(options, expected, aws_env):
    """obstore is fed what botocore resolved (s3config.py), never the options themselves (#49)."""
    import s3fs

    from cachefs.mounts import _with_store_defaults
    from cachefs.store.s3config import resolve_fs

    resolution = resolve_fs(s3fs.S3FileSystem(**_with_store_defaults("s3://bucket", options)))
    got = native.store_options(resolution, "bucket")
    if got is not None:
        provider = got.pop("credential_provider", None)
        assert (provider is None) == bool(options.get("anon"))
        if provider is not None:
            assert (provider()["access_key_id"], provider()["secret_access_key"]) == ("a", "b")
    assert got == expected


def test_a_mount_whose_options_do_not_translate_reads_through_s3fs(aws_env):
    mounts = MountTable([MountSpec("m", "s3://bucket", {"key": "k", "secret": "s",
                                                        "s3_additional_kwargs": {"SSECustomerKey": "k"},
                                                        "endpoint_url": "http://127.0.0.1:1"})])
    for client in ("auto", "http", "obstore", "s3fs"):
        backend = _backend(ObjectStore(mounts, s3_client=client), CachePath("m", "k"))
        assert type(backend) is _S3Backend


def test_the_worker_config_chooses_the_client(s3_store):
    assert type(_backend(_objects(s3_store, "auto"), CachePath("data", "k"))) is s3http.HttpS3Backend
    assert type(_backend(_objects(s3_store, "s3fs"), CachePath("data", "k"))) is _S3Backend
    with pytest.raises(ValueError, match="s3_client"):
        _objects(s3_store, "boto")


def test_directory_listings_through_the_lean_client_are_s3fs_listings(s3_store):
    """ObjectStore.list of a directory (what refreshes stale metadata and lists a data set) goes
    through the HTTP client's ListObjectsV2 pages where the mount uses it: the same entries,
    sizes, versions and times as s3fs's listing, across pages and for keys that need escaping;
    a file's path, an empty prefix and the bucket's root are left to s3fs."""
    keys = ["d/a b.bin", "d/p+q.bin", "d/x&y<z>.bin", "d/\u00e9t\u00e9.bin", "d/sub/1.bin", "d/sub/2.bin",
            "top.bin"] + [f"d/many/{i:04d}" for i in range(1100)]  # past one page (1,000 keys)
    for i, key in enumerate(keys):
        s3_store.add(key, payload(i % 7 + 1, i))
    lean, plain = _objects(s3_store, "http"), _objects(s3_store, "s3fs")
    assert isinstance(_backend(lean, CachePath("data", "d")), s3http.HttpS3Backend)
    assert not isinstance(_backend(plain, CachePath("data", "d")), s3http.HttpS3Backend)
    calls = []
    real = s3http.S3HttpClient.list_page
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(s3http.S3HttpClient, "list_page", lambda self, *a, **k: calls.append(a) or real(self, *a, **k))
        for directory in ("d", "d/many", "d/sub"):
            got = lean.list(CachePath("data", directory), refresh=True)
            want = plain.list(CachePath("data", directory), refresh=True)
            assert got == want and got
        assert len(calls) == 1 + 2 + 1  # d/many took two pages
        for path in ("top.bin", "nothing-here", ""):  # a file, no such prefix, the mount's root
            try:
                want = plain.list(CachePath("data", path), refresh=True)
            except FileNotFoundError:
                with pytest.raises(FileNotFoundError):
                    lean.list(CachePath("data", path), refresh=True)
                continue
            assert lean.list(CachePath("data", path), refresh=True) == want
    # A listing is a metadata refresh: what it says is what info says afterwards.
    meta = lean.info(CachePath("data", "d/a b.bin"))
    assert (meta.size, meta.version) == (plain.info(CachePath("data", "d/a b.bin"), refresh=True).size,
                                         plain.info(CachePath("data", "d/a b.bin")).version)
