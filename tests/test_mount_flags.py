"""Mount options on the daemons' command lines (#49): ``--mount NAME=URL?KEY=VALUE`` and
``--mount-option NAME:KEY=VALUE`` for ``cachefs local``, ``master`` and ``worker``; secrets
only from the config file or the environment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from cachefs.mountflags import mounts_from_flags
from helpers import client, local_master


def test_a_query_string_and_mount_options_become_the_mounts_options():
    got = mounts_from_flags(
        ["data=s3://bucket/prefix?endpoint_url=http%3A//127.0.0.1%3A9000&anon=true", "plain=/srv/data"],
        ["data:client_kwargs.region_name=eu-west-1", "data:config_kwargs.s3.addressing_style=path",
         "data:config_kwargs.connect_timeout=5", "plain:auto_mkdir=false"])
    assert got == [
        {"name": "data", "url": "s3://bucket/prefix",
         "options": {"endpoint_url": "http://127.0.0.1:9000", "anon": True,
                     "client_kwargs": {"region_name": "eu-west-1"},
                     "config_kwargs": {"s3": {"addressing_style": "path"}, "connect_timeout": 5}}},
        {"name": "plain", "url": "/srv/data", "options": {"auto_mkdir": False}},
    ]


@pytest.mark.parametrize("mounts, options, message", [
    (["data"], [], "expected NAME=URL"),
    (["data=s3://b", "data=s3://c"], [], "given twice"),
    (["data=s3://b"], ["data:novalue"], "expected NAME:KEY=VALUE"),
    (["data=s3://b"], ["other:anon=true"], "no --mount named 'other'"),
    (["data=s3://b"], ["data:secret=abc"], "looks like a secret"),
    (["data=s3://b"], ["data:client_kwargs.aws_secret_access_key=abc"], "looks like a secret"),
    (["data=s3://b?key=AKIA&anon=false"], [], "looks like a secret"),
    (["data=s3://b"], ["data:token=t"], "config file or the environment"),
    (["data=s3://b"], ["data:a..b=1"], "expected KEY=VALUE"),
])
def test_malformed_flags_and_secrets_are_refused_naming_the_flag(mounts, options, message):
    with pytest.raises(ValueError, match=message):
        mounts_from_flags(mounts, options)


def test_the_master_takes_mount_options_from_its_command_line(tmp_path):
    from cachefs.config import load_master_config

    flags = {"mounts": mounts_from_flags(["data=s3://bucket?endpoint_url=http://127.0.0.1:9"],
                                         ["data:client_kwargs.region_name=eu-west-1"]),
             "state_dir": str(tmp_path)}
    (spec,) = load_master_config(None, environ={}, flags=flags).mounts
    assert spec.url == "s3://bucket"
    assert dict(spec.options) == {"endpoint_url": "http://127.0.0.1:9", "client_kwargs": {"region_name": "eu-west-1"}}


def test_a_bad_mount_flag_stops_the_daemon_with_its_reason(tmp_path):
    for command in (["master", "--state-dir", str(tmp_path / "m")], ["worker", "--cache-dir", f"{tmp_path}/c:1GiB"],
                    ["local", "--dir", str(tmp_path / "l")]):
        out = subprocess.run([sys.executable, "-m", "cachefs.cli", *command, "--mount", "data=s3://b",
                              "--mount-option", "data:secret=x"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 2, (command, out.stderr)
        assert "looks like a secret" in out.stderr


def test_cachefs_local_with_a_mount_option_reads_from_that_store(s3_store, tmp_path):
    """The issue's ``cachefs local --mount data=s3://bucket`` against an S3-compatible store
    given as a mount option; the keys come from the environment, as the secrets must."""
    s3_store.add("a.bin", b"from the store named by the option")
    options = dict(s3_store.mount.options)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env.update(AWS_ACCESS_KEY_ID=options["key"], AWS_SECRET_ACCESS_KEY=options["secret"],
               AWS_CONFIG_FILE=str(tmp_path / "none"), AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_EC2_METADATA_DISABLED="true")
    proc = subprocess.Popen([sys.executable, "-m", "cachefs.cli", "local", "--workers", "1", "--dir",
                             str(tmp_path / "c"), "--mount", f"data={s3_store.mount.url}",
                             "--mount-option", f"data:endpoint_url={options['endpoint_url']}",
                             "--mount-option", "data:client_kwargs.region_name=us-east-1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        master = local_master(proc)
        assert client(master=master).cat_file("data/a.bin") == b"from the store named by the option"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
