"""Authentication on by default (#48): `cachefs local` makes tokens that this user's processes find
by themselves and no one else has; a daemon that other machines reach needs a token or an
explicit --insecure; a token file that is not private is never taken.

Run as users run them: `cachefs local` and `cachefs master` as commands, clients in processes of
their own importing only cachefs and fsspec, the other user a process of uid 65534.
"""

from __future__ import annotations

import encodings.idna  # noqa: F401 - loaded before the fork: uid 65534 cannot read the stdlib's files here
import json
import os
import stat
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from cachefs.tokens import ACCESS, CLUSTER, find_token, token_path
from helpers import local_master, stop_local

READER = textwrap.dedent('''
    import json, sys
    import cachefs, fsspec

    fs = fsspec.filesystem("cachefs", master=sys.argv[1], timeout=10, **json.loads(sys.argv[2]))
    out = {}
    calls = [("read", lambda: fs.cat_file("data/secret.txt")),
             ("remove", lambda: fs.rm("data/secret.txt")),
             ("write", lambda: fs.pipe_file("data/planted.txt", b"x"))]
    for name, call in calls[:int(sys.argv[3])]:
        try:
            result = call()
            out[name] = "ok" if name != "read" else result.decode()
        except Exception as exc:
            out[name] = type(exc).__name__
    print(json.dumps(out), flush=True)
''')


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEFS_", "GRPC_")) and k != "PYTHONPATH"}
    return {**env, **extra}


def _read_as(master: str, options: dict | None = None, user: int | None = None, calls: int = 3) -> dict:
    # The script where any user may read it (pytest's tmp dirs are private to their user).
    with tempfile.TemporaryDirectory(prefix="cachefs-reader-") as scratch:
        os.chmod(scratch, 0o755)
        script = Path(scratch) / "reader.py"
        script.write_text(READER)
        script.chmod(0o644)
        env = _clean_env(HOME="/nonexistent") if user is not None else _clean_env()
        done = subprocess.run([sys.executable, str(script), master, json.dumps(options or {}), str(calls)],
                              capture_output=True,
                              text=True, timeout=120, env=env, cwd="/", user=user)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_cachefs_local_makes_tokens_its_user_finds_and_no_one_else_has(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "secret.txt").write_text("for this user only")
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "2", "--mount",
                             f"data={data}", "--dir", str(tmp_path / "cluster")], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_clean_env())
    try:
        master = local_master(proc, timeout=90)
        path = token_path(master, ACCESS)
        mode = os.stat(path).st_mode
        assert stat.S_ISREG(mode) and stat.S_IMODE(mode) == 0o600
        assert find_token(master, ACCESS) and find_token(master, CLUSTER) != find_token(master, ACCESS)
        # This user's process, given only the master: it finds the token (and the admin CLI its own).
        assert _read_as(master, calls=1) == {"read": "for this user only"}
        # A wrong token, and no token at all (another user: the token file is out of its reach).
        wrong = _read_as(master, {"token": "not-the-token"})
        assert wrong == {"read": "UnauthenticatedError", "remove": "UnauthenticatedError",
                         "write": "UnauthenticatedError"}, wrong
        if os.geteuid() == 0:  # another user, on this machine (uid 65534: the token file is out of its reach)
            from test_attacks_local import _in_child

            import grpc

            from cachefs.proto import worker_pb2, worker_pb2_grpc
            from cachefs.tls import open_channel

            status = json.loads((tmp_path / "cluster" / "local.json").read_text())
            with open_channel(status["workers"][0]["address"], token=find_token(master)) as channel:
                data_port = worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(
                    worker_pb2.GetStatusRequest(), timeout=10).data_port
            with open_channel(status["workers"][0]["address"]) as channel, pytest.raises(grpc.RpcError) as info:
                worker_pb2_grpc.WorkerServiceStub(channel).GetStatus(worker_pb2.GetStatusRequest(), timeout=10)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            host, port = master.rsplit(":", 1)
            token_file = token_path(master, ACCESS)

            def attack() -> dict:
                from cachefs.client.transport.dataport import DataPortReader
                from cachefs.proto import common_pb2

                out = {}
                try:
                    open(token_file).read()
                    out["token_file"] = "read"
                except Exception as exc:  # noqa: BLE001
                    out["token_file"] = type(exc).__name__
                for name, where, request in (
                        ("view", (host, int(port) + 1), common_pb2.MetaRequest(op=common_pb2.MetaRequest.VIEW)),
                        ("info", ("127.0.0.1", data_port),
                         common_pb2.MetaRequest(op=common_pb2.MetaRequest.INFO, path="data/secret.txt")),
                        ("remove", ("127.0.0.1", data_port),
                         common_pb2.MetaRequest(op=common_pb2.MetaRequest.REMOVE, path="data/secret.txt"))):
                    try:
                        DataPortReader(*where, timeout=10).meta(request, timeout=10)
                        out[name] = "answered"
                    except Exception as exc:  # noqa: BLE001 - what the attacker sees
                        out[name] = type(exc).__name__
                try:
                    got = DataPortReader("127.0.0.1", data_port, timeout=10).read("data/secret.txt", 0, -1, "", fill=True)
                    out["read"] = "answered" if got else "not served"
                except Exception as exc:  # noqa: BLE001
                    out["read"] = type(exc).__name__
                return out

            other = _in_child(attack, timeout=60)
            assert other == {"token_file": "PermissionError", "view": "UnauthenticatedError",
                             "info": "UnauthenticatedError", "remove": "UnauthenticatedError",
                             "read": "UnauthenticatedError"}, other
        assert (data / "secret.txt").read_text() == "for this user only" and not (data / "planted.txt").exists()
    finally:
        stop_local(proc)
    assert not os.path.exists(path), "the token file outlived its cluster"


def test_cachefs_local_insecure_says_so_and_keeps_no_token(tmp_path: Path):
    data = tmp_path / "data"
    data.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "1", "--insecure",
                             "--mount", f"data={data}", "--dir", str(tmp_path / "cluster")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_env())
    try:
        master = local_master(proc, timeout=90)
        assert not os.path.exists(token_path(master, ACCESS))
        lines = []
        while not any("insecure" in line for line in lines) and len(lines) < 20:
            lines.append(proc.stdout.readline())
        assert any("--insecure: no token" in line for line in lines), lines
    finally:
        stop_local(proc)


def test_a_daemon_reachable_from_other_machines_needs_a_token_or_insecure(tmp_path: Path):
    """`cachefs master --host 0.0.0.0` with no access token does not start (exit 2, the setting
    named); with --insecure it starts and warns; on loopback it starts as before."""
    refused = subprocess.run([sys.executable, "-m", "cachefs.cli", "master", "--host", "0.0.0.0", "--port", "0",
                              "--state-dir", str(tmp_path / "s1")], capture_output=True, text=True, timeout=60,
                             env=_clean_env())
    assert refused.returncode == 2
    assert "no access_token" in refused.stderr and "insecure" in refused.stderr, refused.stderr
    worker = subprocess.run([sys.executable, "-m", "cachefs.cli", "worker", "--host", "0.0.0.0", "--port", "0",
                             "--cache-dir", f"{tmp_path / 'c'}:1GiB"], capture_output=True, text=True, timeout=60,
                            env=_clean_env())
    assert worker.returncode == 2 and "no access_token" in worker.stderr, worker.stderr
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "master", "--host", "0.0.0.0", "--port", "0",
                             "--metrics-port", "-1", "--insecure", "--state-dir", str(tmp_path / "s2")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env())
    try:
        warning = proc.stderr.readline()
        assert "WARNING" in warning and "no access token" in warning, warning
    finally:
        stop_local(proc)


def test_a_token_file_that_is_not_private_is_not_taken(tmp_path: Path, monkeypatch):
    monkeypatch.setenv("CACHEFS_RUNTIME_DIR", str(tmp_path / "run"))
    from cachefs.tokens import save_token

    path = save_token("10.1.2.3:19998", "the-token")
    assert find_token("10.1.2.3:19998") == "the-token"
    assert find_token("nowhere:1,10.1.2.3:19998") == "the-token"  # a list of masters: the first that has one
    os.chmod(path, 0o644)
    assert find_token("10.1.2.3:19998") == ""  # readable by others: not taken
    os.chmod(path, 0o600)
    os.replace(path, path + ".real")
    os.symlink(path + ".real", path)
    assert find_token("10.1.2.3:19998") == ""  # a link: not followed
