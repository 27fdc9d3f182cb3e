"""Workers as real processes: restart keeps the cache, a dead worker with fallback loses no read."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cachefs.local import worker_process
from helpers import client, payload, scrape, wait_for

PAGE = 64 << 10


def _config_file(tmp_path: Path, store, page_size: int = PAGE) -> str:
    """A worker TOML config with the store's mount (S3 options include the credentials)."""
    text = f'page_size = {page_size}\nmetadata_ttl = 3600\n\n[mounts.data]\nurl = "{store.mount.url}"\n'
    text += f"options = {_toml_inline(dict(store.mount.options))}\n"
    path = tmp_path / "worker.toml"
    path.write_text(text)
    return str(path)


def _toml_inline(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    return json.dumps(str(value))


@pytest.mark.parametrize("how", ["sigterm", "sigkill"])
def test_restarted_worker_serves_its_cached_pages(store, tmp_path, how):
    for i in range(6):
        store.add(f"o{i}.bin", payload(3 * PAGE + i, i))
    config = _config_file(tmp_path, store)
    cache = tmp_path / "cache"
    with worker_process({}, str(cache), extra=["--config", config], log_path=str(tmp_path / "w1.log")) as w1:
        fs = client(w1.address)
        for key, data in store.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        metrics = scrape(w1.ready["metrics_port"])
        assert metrics["cachefs_worker_bytes_from_store_total"] == sum(map(len, store.objects.values()))
        pages = sum(-(-len(d) // PAGE) for d in store.objects.values())
        if how == "sigkill":
            # The kill gives no warning: first every background page write has landed (a page
            # counts in the store once its file is written), and the pages' index rows, written
            # behind in batches, are committed (a page without its row is an orphan at restart).
            def durable() -> bool:
                m = scrape(w1.ready["metrics_port"])
                return m["cachefs_worker_cache_pages"] == pages and m["cachefs_worker_cache_index_pending"] == 0

            assert wait_for(durable)
            w1.kill()
    with worker_process({}, str(cache), extra=["--config", config], log_path=str(tmp_path / "w2.log")) as w2:
        assert w2.ready["worker_id"] == w1.ready["worker_id"], "a worker keeps its identity across restarts"
        fs = client(w2.address)
        for key, data in store.objects.items():
            assert fs.cat_file(f"data/{key}") == data
        metrics = scrape(w2.ready["metrics_port"])
        assert metrics["cachefs_worker_bytes_from_store_total"] == 0, "restarted worker refetched cached pages"
        assert metrics['cachefs_worker_page_reads_total{outcome="hit"}'] == pages
        assert metrics["cachefs_worker_cache_pages"] == pages


def test_dead_worker_with_fallback_loses_no_read(store, tmp_path, aws_env):
    for i in range(12):
        store.add(f"o{i}.bin", payload(2 * PAGE + 7 * i, 100 + i))
    config = _config_file(tmp_path, store)
    worker = worker_process({}, str(tmp_path / "cache"), extra=["--config", config],
                            log_path=str(tmp_path / "w.log")).start()
    try:
        fs = client(worker.address, fallback=True, timeout=5)
        keys = sorted(store.objects)
        assert fs.cat_file(f"data/{keys[0]}") == store.objects[keys[0]]  # learns the mounts
        errors: list[BaseException] = []
        reads = [0]
        lock = threading.Lock()  # += from four threads could lose a count
        stop = threading.Event()

        def loop(seed: int) -> None:
            i = seed
            while not stop.is_set():
                key = keys[i % len(keys)]
                i += 1
                try:
                    data = fs.cat_file(f"data/{key}", start=5, end=PAGE + 100)
                    if data != store.objects[key][5:PAGE + 100]:
                        errors.append(AssertionError(f"wrong bytes for {key}"))
                    with lock:
                        reads[0] += 1
                except BaseException as exc:  # noqa: BLE001 - collected and reported
                    errors.append(exc)

        threads = [threading.Thread(target=loop, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        assert wait_for(lambda: errors or reads[0] >= 20, timeout=30), "the readers did not get going"
        before_kill = reads[0]
        worker.kill()  # kill -9 under load
        # Reads go on from the store: more than the 4 that may have been in flight at the kill.
        wait_for(lambda: errors or reads[0] >= before_kill + 20, timeout=30)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        assert not errors, errors[:3]
        assert before_kill > 0 and reads[0] >= before_kill + 20, (before_kill, reads[0])
        # Metadata and listings keep working from the store too.
        assert fs.info(f"data/{keys[1]}")["size"] == len(store.objects[keys[1]])
        assert sorted(p.rsplit("/", 1)[1] for p in fs.find("data/")) == keys
    finally:
        worker.kill()


def test_dead_worker_without_fallback_fails_fast_with_a_clear_error(local_store, tmp_path):
    local_store.add("a.bin", b"x" * 10)
    local_store.add("b.bin", b"y" * 10)
    worker = worker_process({"data": local_store.mount.url}, str(tmp_path / "cache")).start()
    fs = client(worker.address, timeout=5)
    assert fs.cat_file("data/a.bin") == b"x" * 10
    worker.kill()
    from cachefs.errors import WorkerUnavailableError

    t0 = time.monotonic()
    with pytest.raises(WorkerUnavailableError):
        # (not a.bin: its pages may still be read through the descriptors this process holds,
        # until the dead worker's table goes stale)
        fs.cat_file("data/b.bin")
    assert time.monotonic() - t0 < 5


def test_worker_shuts_down_gracefully_on_sigterm(local_store, tmp_path):
    local_store.add("a.bin", payload(4 * PAGE, 1))
    worker = worker_process({"data": local_store.mount.url}, str(tmp_path / "cache")).start()
    fs = client(worker.address)
    assert fs.cat_file("data/a.bin") == local_store.objects["a.bin"]
    assert worker.stop(timeout=20) == 0
    index_dirs = list((tmp_path / "cache").rglob("index"))
    assert index_dirs, "the page index was not written"


def test_worker_refuses_bad_configuration(tmp_path):
    bad = [
        ["--cache-dir", f"{tmp_path}:0"],
        ["--cache-dir", f"{tmp_path}"],
        ["--page-size", "1000"],
        ["--mount", "no-equals-sign"],
        ["--port", "70000"],
    ]
    for args in bad:
        proc = subprocess.run([sys.executable, "-m", "cachefs.cli", "worker", "--port", "0", *args],
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (args, proc.stdout, proc.stderr)
        assert "bad configuration" in proc.stderr
