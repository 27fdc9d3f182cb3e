"""`cachefs fuse --writable`: writes through a real mount to moto S3 via a real worker.

Files are written by Python, the shell and coreutils through the mount and read back from the
bucket itself; what an object store cannot do gets its errno; a `cachefs fuse` process killed
mid-write leaves nothing in the bucket (its upload is aborted by the worker).
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess

import pytest

from cachefs.mounts import MountSpec
from fusemounts import mount_fuse, needs_fuse  # noqa: F401 - mount_fuse is a fixture
from helpers import payload, wait_for


def _bucket_and_prefix(s3_store) -> tuple[str, str]:
    bucket, _, prefix = s3_store.mount.url.removeprefix("s3://").partition("/")
    return bucket, prefix


def _in_bucket(client, bucket: str, key: str) -> bytes | None:
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read()
    except client.exceptions.NoSuchKey:
        return None


def _errno_of(call) -> int:
    with pytest.raises(OSError) as caught:
        call()
    return caught.value.errno


@needs_fuse
def test_writes_reach_the_bucket_at_close(s3_store, moto_server, make_worker, mount_fuse, tmp_path):
    client = moto_server.client()
    bucket, prefix = _bucket_and_prefix(s3_store)
    s3_store.add("keep.txt", b"kept")
    read_only = MountSpec("frozen", s3_store.mount.url, s3_store.mount.options, read_only=True)
    worker = make_worker(s3_store.mount, read_only, metadata_ttl=1.0, list_ttl=1.0)
    m = mount_fuse("--workers", worker.address, "--writable", "--attr-timeout", "0.5", "--metadata-ttl", "1",
                   "--timeout", "5")
    data = m.mountpoint / "data"

    # A multi-chunk file from Python: streamed while open, published only at close.
    big = payload((9 << 20) + 12345, seed=4)
    os.mkdir(data / "sub")
    with open(data / "sub" / "big.bin", "wb") as f:
        f.write(big[:5 << 20])
        assert _in_bucket(client, bucket, f"{prefix}/sub/big.bin") is None  # nothing visible before close
        f.write(big[5 << 20:])
    assert _in_bucket(client, bucket, f"{prefix}/sub/big.bin") == big
    assert (data / "sub" / "big.bin").read_bytes() == big
    assert os.stat(data / "sub" / "big.bin").st_size == len(big)

    # The shell (open, dup2 onto stdout, close, then write) and coreutils.
    sh = subprocess.run(["sh", "-c", f"echo hello > {data}/hello.txt && cat {data}/hello.txt"],
                        capture_output=True, text=True, timeout=60)
    assert (sh.returncode, sh.stdout) == (0, "hello\n"), sh.stderr
    assert _in_bucket(client, bucket, f"{prefix}/hello.txt") == b"hello\n"
    os.chmod(data / "hello.txt", 0o600)  # no modes in a store: accepted, nothing changes
    os.utime(data / "hello.txt")
    tree = tmp_path / "tree"
    (tree / "a").mkdir(parents=True)
    (tree / "a" / "one.bin").write_bytes(payload(300_000, seed=5))
    (tree / "two.txt").write_bytes(b"two")
    cp = subprocess.run(["cp", "-r", str(tree), str(data / "copied")], capture_output=True, text=True, timeout=60)
    assert cp.returncode == 0, cp.stderr
    assert _in_bucket(client, bucket, f"{prefix}/copied/a/one.bin") == (tree / "a" / "one.bin").read_bytes()
    assert _in_bucket(client, bucket, f"{prefix}/copied/two.txt") == b"two"

    # An existing object replaced whole (O_TRUNC): the new bytes, never the old ones, when read again.
    (data / "keep.txt").write_bytes(b"replaced")
    assert wait_for(lambda: (data / "keep.txt").read_bytes() == b"replaced", 10)

    # mkdir (S3 has no directories: the mount remembers it), a file in it, rename, unlink, rmdir.
    os.mkdir(data / "made")
    assert os.path.isdir(data / "made") and "made" in os.listdir(data)
    (data / "made" / "x.txt").write_bytes(b"x")
    os.rename(data / "made" / "x.txt", data / "made" / "y.txt")
    assert _in_bucket(client, bucket, f"{prefix}/made/x.txt") is None
    assert _in_bucket(client, bucket, f"{prefix}/made/y.txt") == b"x"
    assert (data / "made" / "y.txt").read_bytes() == b"x"
    assert _errno_of(lambda: os.rmdir(data / "made")) == errno.ENOTEMPTY
    os.remove(data / "made" / "y.txt")
    assert _in_bucket(client, bucket, f"{prefix}/made/y.txt") is None
    os.rmdir(data / "made")
    assert not os.path.exists(data / "made")
    # A directory is renamed by mv itself (EXDEV: it copies, then removes).
    mv = subprocess.run(["mv", str(data / "copied"), str(data / "moved")], capture_output=True, text=True, timeout=60)
    assert mv.returncode == 0, mv.stderr
    assert _in_bucket(client, bucket, f"{prefix}/moved/two.txt") == b"two"
    assert _in_bucket(client, bucket, f"{prefix}/copied/two.txt") is None

    # What an object store cannot do: a clear errno, and the object untouched.
    assert _errno_of(lambda: open(data / "hello.txt", "ab")) == errno.EOPNOTSUPP
    assert _errno_of(lambda: os.open(data / "hello.txt", os.O_WRONLY)) == errno.EOPNOTSUPP
    fd = os.open(data / "seek.bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, b"abc")
        assert _errno_of(lambda: os.pwrite(fd, b"z", 0)) == errno.EOPNOTSUPP
    finally:
        assert _errno_of(lambda: os.close(fd)) == errno.EOPNOTSUPP  # the write failed: close says so
    assert _in_bucket(client, bucket, f"{prefix}/seek.bin") is None
    assert _in_bucket(client, bucket, f"{prefix}/hello.txt") == b"hello\n"
    # A mount that is read-only in the mount table: EROFS, nothing written.
    assert _errno_of(lambda: (m.mountpoint / "frozen" / "new.txt").write_bytes(b"no")) == errno.EROFS
    assert _errno_of(lambda: os.remove(m.mountpoint / "frozen" / "keep.txt")) == errno.EROFS
    assert _in_bucket(client, bucket, f"{prefix}/new.txt") is None
    assert m.proc.poll() is None


@needs_fuse
def test_a_killed_fuse_process_mid_write_publishes_nothing(s3_store, moto_server, make_worker, mount_fuse):
    client = moto_server.client()
    bucket, prefix = _bucket_and_prefix(s3_store)
    worker = make_worker(s3_store.mount)
    m = mount_fuse("--workers", worker.address, "--writable", "--timeout", "5")
    path = m.mountpoint / "data" / "half.bin"
    f = open(path, "wb", buffering=0)
    try:
        f.write(payload(20 << 20, seed=6))  # past the first multipart part: the upload is under way
        assert wait_for(lambda: client.list_multipart_uploads(Bucket=bucket).get("Uploads"), 30), \
            "the write never reached the store"
        assert m.stop(signal.SIGKILL) == -signal.SIGKILL
        # The stream broke with the process: the worker aborts the upload and publishes nothing.
        assert wait_for(lambda: not client.list_multipart_uploads(Bucket=bucket).get("Uploads"), 30), \
            "the upload of a killed writer was never aborted"
        assert _in_bucket(client, bucket, f"{prefix}/half.bin") is None
    finally:
        try:
            f.close()
        except OSError as exc:
            assert exc.errno == errno.ENOTCONN, exc  # the mount is dead
        m.detach_if_left()
    assert _in_bucket(client, bucket, f"{prefix}/half.bin") is None
