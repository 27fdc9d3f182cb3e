"""`cachefs fuse`: a real mount (a `cachefs fuse` process, libfuse 3, /dev/fuse) over a real worker.

Skipped where the kernel has no /dev/fuse or libfuse 3 / the binding is missing (the reason is
given); under CI=true a machine with /dev/fuse but no libfuse fails instead (.ci/setup installs
it). The shell tools (find, cp -r, sha256sum) and numpy.memmap read through the mount as any
program that opens paths would.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cachefs.client.fuse.fusemount import mount_entry
from cachefs.config import FuseConfig, load_fuse_config
from fusemounts import mount_fuse, needs_fuse  # noqa: F401 - mount_fuse is a fixture
from helpers import payload, wait_for

# Sizes around the page (1 MiB) and the kernel's read (1 MiB) boundaries, an empty file, nesting.
TREE = {
    "empty.bin": 0,
    "small.txt": 11,
    "one-page.bin": 1 << 20,
    "dir/three-pages-and-a-bit.bin": (3 << 20) + 4097,
    "dir/sub/deep.bin": 300_000,
    "other/x.json": 2_000,
}


def _fill(store, sizes: dict[str, int]) -> None:
    for i, (key, size) in enumerate(sizes.items()):
        store.add(key, payload(size, seed=i))


def _worker_args(worker) -> tuple[str, ...]:
    return ("--workers", worker.address, "--attr-timeout", "0.5", "--metadata-ttl", "1", "--timeout", "5")


@needs_fuse
def test_find_cp_sha256sum_and_memmap_equal_the_source(store, make_worker, mount_fuse, tmp_path):
    _fill(store, TREE)
    worker = make_worker(store.mount)
    m = mount_fuse(*_worker_args(worker))
    root = m.mountpoint

    assert os.listdir(root) == ["data"]
    found = subprocess.run(["find", str(root / "data"), "-type", "f"], capture_output=True, text=True, timeout=60)
    assert found.returncode == 0, found.stderr
    assert sorted(os.path.relpath(p, root / "data") for p in found.stdout.split()) == sorted(TREE)

    copy = tmp_path / "copy"
    cp = subprocess.run(["cp", "-r", str(root / "data"), str(copy)], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    for key, data in store.objects.items():
        assert (copy / key).read_bytes() == data, key

    sums = subprocess.run(["sha256sum", *[str(root / "data" / k) for k in TREE]], capture_output=True, text=True,
                          timeout=60)
    assert sums.returncode == 0, sums.stderr
    got = {os.path.relpath(line.split(None, 1)[1], root / "data"): line.split()[0] for line in sums.stdout.splitlines()}
    assert got == {k: hashlib.sha256(v).hexdigest() for k, v in store.objects.items()}

    key = "dir/three-pages-and-a-bit.bin"
    mapped = np.memmap(root / "data" / key, dtype=np.uint8, mode="r")
    try:
        assert mapped.shape == (TREE[key],)
        assert mapped[(1 << 20) - 5:(1 << 20) + 5].tobytes() == store.objects[key][(1 << 20) - 5:(1 << 20) + 5]
        assert hashlib.sha256(mapped).hexdigest() == hashlib.sha256(store.objects[key]).hexdigest()
    finally:
        del mapped
    assert os.stat(root / "data" / "dir").st_mode & 0o170000 == 0o040000
    assert os.stat(root / "data" / key).st_size == TREE[key]


@needs_fuse
def test_read_only_missing_and_failing_reads_as_errno(local_store, make_worker, mount_fuse):
    _fill(local_store, {"a.txt": 5, "cold.bin": 10_000})
    worker = make_worker(local_store.mount)
    m = mount_fuse(*_worker_args(worker))
    data = m.mountpoint / "data"
    assert (data / "a.txt").read_bytes() == local_store.objects["a.txt"]

    for attempt in (lambda: open(data / "a.txt", "wb"), lambda: open(data / "new.txt", "w"),
                    lambda: os.mkdir(data / "d"), lambda: os.remove(data / "a.txt"),
                    lambda: os.rename(data / "a.txt", data / "b.txt")):
        with pytest.raises(OSError) as caught:
            attempt()
        assert caught.value.errno == errno.EROFS, caught.value
    for missing in (data / "nope.txt", m.mountpoint / "nomount", data / "a.txt" / "under-a-file"):
        with pytest.raises(OSError) as caught:
            open(missing, "rb")
        assert caught.value.errno in (errno.ENOENT, errno.ENOTDIR), caught.value
    assert local_store.objects["a.txt"] == (Path(local_store.mount.url) / "a.txt").read_bytes()  # nothing written

    # Every worker gone: a read that needs one fails with EIO within the client's deadline, and
    # the mount's log names the object once.
    worker.stop(grace=0.5)
    with pytest.raises(OSError) as caught:
        (data / "cold.bin").read_bytes()
    assert caught.value.errno == errno.EIO, caught.value
    assert wait_for(lambda: any("data/cold.bin" in line for line in m.err), 10), "".join(m.err)
    assert m.proc.poll() is None  # the mount stays up


@needs_fuse
def test_change_in_the_store_seen_after_the_ttl_never_mixed(store, make_worker, mount_fuse):
    key = "dir/three-pages-and-a-bit.bin"
    old, new = payload(TREE[key], seed=1), payload(TREE[key] + 1000, seed=2)
    store.add(key, old)
    worker = make_worker(store.mount, metadata_ttl=1.0, list_ttl=1.0)
    m = mount_fuse(*_worker_args(worker))
    path = m.mountpoint / "data" / key

    held = open(path, "rb")
    try:
        assert held.read(4096) == old[:4096]
        store.add(key, new)
        # A fresh open sees the new object once the TTLs run out (metadata 1 s, kernel 0.5 s). An
        # open made while the change is being noticed may get ESTALE (its version was revalidated
        # just before the worker learnt the new one): never other bytes.
        def fresh_read() -> bytes | None:
            try:
                data = path.read_bytes()
            except OSError as exc:
                assert exc.errno == errno.ESTALE, exc
                return None
            assert data in (old, new), "a fresh open read neither version"
            return data

        assert wait_for(lambda: fresh_read() == new, 20), "the change was never seen through the mount"
        # The file opened before the change never mixes versions: the old bytes, or ESTALE.
        try:
            rest = held.read()
        except OSError as exc:
            assert exc.errno == errno.ESTALE, exc
        else:
            assert rest == old[4096:]
    finally:
        held.close()
    assert os.stat(path).st_size == len(new) or wait_for(lambda: os.stat(path).st_size == len(new), 5)


@needs_fuse
def test_sigterm_unmounts_and_a_dead_mount_is_replaced(local_store, make_worker, mount_fuse, tmp_path):
    _fill(local_store, {"a.txt": 7})
    worker = make_worker(local_store.mount)
    first = mount_fuse(*_worker_args(worker))
    mp = first.mountpoint
    assert first.stop(signal.SIGKILL) == -signal.SIGKILL
    with pytest.raises(OSError) as caught:
        os.listdir(mp)
    assert caught.value.errno == errno.ENOTCONN  # what a killed FUSE process leaves behind

    second = mount_fuse(*_worker_args(worker), mountpoint=mp)
    assert any("dead" in line and str(mp) in line for line in second.err), "".join(second.err)
    assert (mp / "data" / "a.txt").read_bytes() == local_store.objects["a.txt"]

    # A second mount on a live one is refused, naming it.
    refused = subprocess.run([sys.executable, "-m", "cachefs.cli", "fuse", str(mp), *_worker_args(worker)],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "already a live FUSE mount" in refused.stderr

    assert second.stop(signal.SIGTERM) == 0, "".join(second.err)
    assert mount_entry(str(mp)) is None
    assert any('"unmounted"' in line for line in second.out)
    assert os.listdir(mp) == []  # the plain directory again


class _ImageTree:
    """An ImageFolder-style tree (class folders of PNG files) read with PIL, as torchvision would."""

    def __init__(self, root: Path) -> None:
        self.items = sorted((str(p), p.parent.name) for p in root.glob("*/*.png"))
        self.classes = sorted({label for _, label in self.items})

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from PIL import Image

        path, label = self.items[i]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        return os.path.relpath(path, os.path.dirname(os.path.dirname(path))), pixels, self.classes.index(label)


@needs_fuse
def test_image_folder_through_pil_in_a_dataloader_with_two_workers(local_store, mount_fuse, tmp_path):
    """Through a master (`--master`: workers and mounts from its view), as deployed."""
    import io

    import torch
    from PIL import Image

    from cachefs.local import LocalCluster

    expected = {}
    rng = np.random.default_rng(3)
    for label in ("cat", "dog"):
        for i in range(6):
            pixels = rng.integers(0, 256, (24 + i, 32, 3), dtype=np.uint8)
            out = io.BytesIO()
            Image.fromarray(pixels).save(out, format="PNG")
            local_store.add(f"train/{label}/{i:03d}.png", out.getvalue())
            expected[f"{label}/{i:03d}.png"] = pixels
    with LocalCluster(str(tmp_path / "cluster"), workers=2, mounts={"data": local_store.mount.url}) as cluster:
        assert cluster.wait_for_workers()
        m = mount_fuse("--master", cluster.master_address, "--timeout", "5")
        assert os.listdir(m.mountpoint) == ["data"]
        dataset = _ImageTree(m.mountpoint / "data" / "train")
        assert len(dataset) == 12 and dataset.classes == ["cat", "dog"]
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2, shuffle=True,
                                             generator=torch.Generator().manual_seed(0))
        seen = {}
        for name, pixels, label in loader:
            seen[name] = (pixels.numpy(), label)
        assert m.stop() == 0
    assert sorted(seen) == sorted(expected)
    for name, (pixels, label) in seen.items():
        assert np.array_equal(pixels, expected[name]), name
        assert dataset.classes[label] == name.split("/")[0]


@needs_fuse
def test_a_killed_worker_under_a_read_loop_gives_no_eio(local_store, mount_fuse, tmp_path):
    """kill -9 of one of two worker processes while files are read through the mount (each read
    reaching cachefs: the kernel's copy is dropped first): every read right, none fails."""
    from cachefs.local import worker_process

    sizes = {f"f{i:02d}.bin": 200_000 + i for i in range(24)}
    _fill(local_store, sizes)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    workers = [worker_process({"data": local_store.mount.url}, str(tmp_path / f"cache{i}"), quota="256MiB",
                              log_path=str(tmp_path / f"worker{i}.log"), env=env) for i in range(2)]
    try:
        for w in workers:
            w.start(timeout=60)
        m = mount_fuse("--workers", ",".join(w.address for w in workers), "--timeout", "5")
        data = m.mountpoint / "data"

        def read_all() -> list[str]:
            wrong = []
            for key in sizes:
                path = data / key
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)
                out = subprocess.run(["cat", str(path)], capture_output=True, timeout=60)
                if out.returncode != 0 or out.stdout != local_store.objects[key]:
                    wrong.append(f"{key}: rc={out.returncode} {out.stderr.decode(errors='replace').strip()}")
            return wrong

        assert read_all() == []  # both workers serve (and cache) their share
        dead = workers[0].address
        workers[0].kill()
        # Reads go on (first through the page descriptors the mount holds, until the dead worker's
        # heartbeat word goes stale; then the dead worker is asked, fails, and the other one
        # serves) until that failover was seen, and one round more: none may fail.
        rounds = 0
        deadline = time.monotonic() + 60
        while not any(dead in line and "failed" in line for line in m.err):
            assert read_all() == [], "".join(m.err)
            rounds += 1
            assert time.monotonic() < deadline, f"the dead worker was never asked in {rounds} rounds"
        assert read_all() == [], "".join(m.err)
    finally:
        for w in workers:
            w.kill()


@needs_fuse
def test_a_hung_worker_fails_a_read_with_eio_within_the_deadline(local_store, mount_fuse, tmp_path):
    """SIGSTOP of the only worker: a read through the mount fails with EIO once the client's
    deadlines have passed (here ~7 s: the short-circuit socket's 5 s, then gRPC's --timeout 2),
    never hangs; after SIGCONT the same read succeeds."""
    from cachefs.local import worker_process

    _fill(local_store, {"cold.bin": 100_000})
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEFS_")}
    worker = worker_process({"data": local_store.mount.url}, str(tmp_path / "cache"), quota="64MiB",
                            log_path=str(tmp_path / "worker.log"), env=env)
    try:
        worker.start(timeout=60)
        m = mount_fuse("--workers", worker.address, "--timeout", "2")
        path = m.mountpoint / "data" / "cold.bin"
        assert os.listdir(m.mountpoint / "data") == ["cold.bin"]  # its attributes come with the listing
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            start = time.monotonic()
            with pytest.raises(OSError) as caught:
                path.read_bytes()
            took = time.monotonic() - start
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        assert caught.value.errno == errno.EIO, caught.value
        assert took < 15, f"the read took {took:.1f} s with a 2 s client deadline"
        # The mount's stderr is collected by a thread: its line may come a moment after the errno.
        assert wait_for(lambda: any("data/cold.bin" in line for line in m.err), 10), "".join(m.err)
        assert wait_for(lambda: _read_or_none(path) == local_store.objects["cold.bin"], 30)
    finally:
        worker.kill()


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def test_fuse_configuration_layers_and_refusals(tmp_path):
    toml = tmp_path / "fuse.toml"
    toml.write_text('[client]\nworkers = "127.0.0.1:1"\ntimeout = 3\n[fuse]\nattr_timeout = 2\nmax_read = "512KiB"\n')
    config = load_fuse_config(str(toml), environ={"CACHEFS_FUSE_THREADS": "4"}, flags={"attr_timeout": 0.25})
    assert (config.attr_timeout, config.max_read, config.threads) == (0.25, 512 << 10, 4)
    assert config.client.workers == ("127.0.0.1:1",) and config.client.timeout == 3
    with pytest.raises(ValueError, match="attr_timeout"):
        load_fuse_config(str(toml), environ={}, flags={"attr_timeout": 60})  # past the metadata TTL
    with pytest.raises(ValueError, match="unknown"):
        load_fuse_config(str(toml), environ={}, client_flags={"nonsense": 1})
    out = subprocess.run([sys.executable, "-m", "cachefs.cli", "fuse", str(tmp_path), "--workers", "127.0.0.1:1",
                          "--attr-timeout", "99"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "bad configuration" in out.stderr and "attr_timeout" in out.stderr

    docs = (Path(__file__).resolve().parent.parent / "docs" / "configuration.md").read_text()
    section = docs.split("## FUSE mount (`cachefs fuse`)", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert listed == {f.name for f in dataclasses.fields(FuseConfig)} - {"client"}, "docs/configuration.md"


@needs_fuse
def test_kernel_opens_without_revalidation_read_right_and_see_a_change(local_store, make_worker, mount_fuse):
    """--no-revalidate-open: the kernel opens files itself (no request per open); reads by path are
    right, from the page cache once read, and a change is seen by a fresh open after the TTLs."""
    _fill(local_store, {"a.bin": 300_000, "b.txt": 5})
    worker = make_worker(local_store.mount, metadata_ttl=1.0, list_ttl=1.0)
    m = mount_fuse(*_worker_args(worker), "--no-revalidate-open")
    data = m.mountpoint / "data"
    for _ in range(3):
        assert (data / "a.bin").read_bytes() == local_store.objects["a.bin"]
    assert (data / "b.txt").read_bytes() == local_store.objects["b.txt"]
    with pytest.raises(OSError) as caught:
        open(data / "b.txt", "wb")
    assert caught.value.errno == errno.EROFS
    new = payload(300_001, seed=9)
    local_store.add("a.bin", new)
    assert wait_for(lambda: _read_or_none(data / "a.bin") == new, 20), "the change was never seen"
    with pytest.raises(ValueError, match="revalidate_open"):
        load_fuse_config(None, environ={}, flags={"writable": True, "revalidate_open": False},
                         client_flags={"workers": "127.0.0.1:1"})
