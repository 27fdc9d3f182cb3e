"""Mounts given on a daemon's command line, with their options (#49).

``--mount NAME=URL`` takes options two ways, for ``cachefs local``, ``cachefs master`` and
``cachefs worker`` alike:

* a query string on the URL: ``--mount 'data=s3://bucket/prefix?endpoint_url=http://minio:9000&anon=true'``
* ``--mount-option NAME:KEY=VALUE`` (repeatable): ``--mount-option data:client_kwargs.region_name=eu-west-1``

A value is read as JSON where it is JSON (numbers, booleans, objects), else as a string; a
dotted key sets a nested option (``config_kwargs.s3.addressing_style=path``). Secrets never go on
a command line (every local user sees it in ``ps``): an option that looks like one (key, secret,
token, password, ...) is refused, and belongs in the config file or the environment
(``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, a profile, a role), where s3fs and the workers
find it alike.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any

from cachefs.mounts import _is_secret

__all__ = ["mounts_from_flags"]


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set(options: dict[str, Any], key: str, value: Any, where: str) -> None:
    parts = key.split(".")
    if not key or any(not part for part in parts):
        raise ValueError(f"{where}: expected KEY=VALUE, got key {key!r}")
    for part in parts:
        if _is_secret(part):
            raise ValueError(f"{where}: {key!r} looks like a secret, and a command line is seen by every "
                             "local user: put it in the config file or the environment")
    node = options
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ValueError(f"{where}: {key!r} sets inside an option that is not a mapping")
    node[parts[-1]] = value


def mounts_from_flags(mounts: list[str] | None, options: list[str] | None = None) -> list[dict[str, Any]]:
    """``[{"name", "url", "options"}]`` for ``--mount NAME=URL[?KEY=VALUE&...]`` flags and
    ``--mount-option NAME:KEY=VALUE`` flags; ValueError (naming the flag) for a malformed one."""
    out: dict[str, dict[str, Any]] = {}
    for item in mounts or []:
        name, sep, url = item.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--mount {item!r}: expected NAME=URL")
        if name in out:
            raise ValueError(f"--mount {item!r}: mount {name!r} given twice")
        base, qsep, query = url.partition("?")
        spec: dict[str, Any] = {"name": name, "url": base if qsep else url, "options": {}}
        if qsep:
            for key, value in urllib.parse.parse_qsl(query, keep_blank_values=True, strict_parsing=True):
                _set(spec["options"], key, _value(value), f"--mount {name}=...?{key}=")
        out[name] = spec
    for item in options or []:
        name, sep, pair = item.partition(":")
        key, eq, value = pair.partition("=")
        if not sep or not eq:
            raise ValueError(f"--mount-option {item!r}: expected NAME:KEY=VALUE")
        if name not in out:
            raise ValueError(f"--mount-option {item!r}: no --mount named {name!r}")
        _set(out[name]["options"], key, _value(value), f"--mount-option {item!r}")
    return list(out.values())
