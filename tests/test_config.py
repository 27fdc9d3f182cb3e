"""Worker configuration: layering defaults < file < env < flags, eager validation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cachefs.config import CacheDirSpec, MasterConfig, WorkerConfig, load_worker_config, parse_size
from cachefs.mounts import MountSpec

DOCS = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def test_sizes():
    assert parse_size("1MiB") == 1 << 20
    assert parse_size("1.5GiB") == 3 << 29
    assert parse_size("10GB") == 10**10
    assert parse_size("4k") == 4000
    assert parse_size(123) == 123
    for bad in ("", "MiB", "1XB", "-1", True):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_layers_later_wins(tmp_path):
    config_file = tmp_path / "w.toml"
    config_file.write_text('[worker]\nport = 1111\nmetadata_ttl = 5\npage_size = "256KiB"\nheap_keep_bytes = "1GiB"\n'
                           f'cache_dirs = ["{tmp_path}/c:2GiB"]\n')
    env = {"CACHEFS_WORKER_PORT": "2222", "CACHEFS_WORKER_LIST_TTL": "7", "UNRELATED": "x"}
    cfg = load_worker_config(str(config_file), environ=env, flags={"port": 3333})
    assert cfg.port == 3333  # flag over env over file
    assert cfg.list_ttl == 7.0  # env over default
    assert cfg.metadata_ttl == 5.0 and cfg.page_size == 256 << 10  # file over default
    assert cfg.heap_keep_bytes == 1 << 30
    assert cfg.cache_dirs == (CacheDirSpec(f"{tmp_path}/c", 2 << 30),)
    assert load_worker_config(None, environ={}, flags={}).port == WorkerConfig().port


def test_config_file_from_env_and_mounts(tmp_path):
    config_file = tmp_path / "w.toml"
    config_file.write_text('port = 0\n\n[mounts.data]\nurl = "s3://bucket/prefix"\n'
                           'options = { key = "AK", secret = "SK", endpoint_url = "http://127.0.0.1:9" }\n'
                           'read_only = true\n\n[mounts.local]\nurl = "/tmp"\n')
    cfg = load_worker_config(None, environ={"CACHEFS_WORKER_CONFIG": str(config_file)})
    data = {m.name: m for m in cfg.mounts}["data"]
    assert data.url == "s3://bucket/prefix" and data.read_only and data.options["secret"] == "SK"
    assert data.public() == {"name": "data", "url": "s3://bucket/prefix", "read_only": True,
                             "options": {"endpoint_url": "http://127.0.0.1:9"}}
    assert "SK" not in repr(cfg)


def test_documented_example_config_loads(tmp_path):
    text = DOCS.read_text()
    example = re.search(r"```toml\n(.*?)```", text, re.S).group(1)
    example = example.replace("/nvme0", str(tmp_path / "n0")).replace("/nvme1", str(tmp_path / "n1"))
    path = tmp_path / "worker.toml"
    path.write_text(example)
    with pytest.raises(ValueError, match="no access_token"):  # host 0.0.0.0: the token is required
        load_worker_config(str(path), environ={})
    cfg = load_worker_config(str(path), environ={"CACHEFS_WORKER_ACCESS_TOKEN": "from-the-environment"})
    assert cfg.port == 29999 and len(cfg.cache_dirs) == 2 and cfg.mounts[0].read_only
    worker_part, master_part = text.split("## Client")[0].split("## Master")
    documented = set(re.findall(r"^\| `(\w+)` \|", worker_part, re.M))
    assert documented == {f for f in WorkerConfig.__dataclass_fields__}, "docs/configuration.md is out of date"
    documented = set(re.findall(r"^\| `(\w+)` \|", master_part, re.M))
    assert documented == {f for f in MasterConfig.__dataclass_fields__}, "docs/configuration.md is out of date"


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"port": 70000}, "port"),
        ({"metrics_port": -2}, "metrics_port"),
        ({"page_size": "3000"}, "page_size"),
        ({"page_size": "128MiB"}, "page_size"),
        ({"cache_dirs": ["/tmp/x:0"]}, "quota"),
        ({"cache_dirs": ["/tmp/x"]}, "PATH:QUOTA"),
        ({"cache_dirs": ["/tmp/x:1GiB", "/tmp/x:2GiB"]}, "distinct"),
        ({"mounts": ["a=/tmp", "a=/var"]}, "duplicate"),
        ({"mounts": ["../x=/tmp"]}, "mount name"),
        ({"metadata_ttl": -1}, "metadata_ttl"),
        ({"fetch_threads": 0}, "fetch_threads"),
        ({"heap_keep_bytes": -1}, "heap_keep_bytes"),
        ({"extent_size": "1KiB"}, "extent_size"),
        ({"extent_size": "2GiB"}, "extent_size"),
        ({"port": "eighty"}, "port"),
        ({"no_such_setting": 1}, "unknown"),
    ],
)
def test_bad_values_are_refused_with_the_field_named(flags, message):
    with pytest.raises(ValueError, match=message):
        load_worker_config(None, environ={}, flags=flags)


def test_extent_size_takes_a_size_and_reaches_the_reader():
    from cachefs.server.worker.reader import ReaderOptions

    config = load_worker_config(None, environ={"CACHEFS_WORKER_EXTENT_SIZE": "32MiB"}, flags={})
    assert config.extent_size == 32 << 20
    assert ReaderOptions.from_config(config).extent_size == 32 << 20
    assert load_worker_config(None, environ={}, flags={}).extent_size == 16 << 20
    # Pages larger than the default extent: each request is one page, not an error.
    big = load_worker_config(None, environ={}, flags={"page_size": "64MiB"})
    assert big.extent_size == 16 << 20 and big.page_size == 64 << 20


def test_mount_spec_parsing():
    assert MountSpec.parse("data=s3://b/p") == MountSpec("data", "s3://b/p")
    specs = MountSpec.parse_many({"a": "file:///x", "b": {"url": "s3://b", "options": {"anon": True}}})
    assert [(s.name, s.url) for s in specs] == [("a", "file:///x"), ("b", "s3://b")]
    with pytest.raises(ValueError):
        MountSpec.parse("no-equals")
