"""An S3 mount's configuration as botocore resolves it, for the code that sends its own requests (#49).

s3fs hands its options to (aio)botocore, which resolves the endpoint (the ``endpoint_url``
option, then ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, then the profile's ``endpoint_url``
and ``services`` section), the region, the addressing style, the credentials (environment, shared
files and profiles, SSO, web identity, container and instance roles, refreshed as they expire),
the CA bundle, proxies, timeouts and retries. The worker's own HTTP client (s3http.py) must reach
the very store s3fs reaches, so it never reads the options itself: :func:`resolve` builds a plain
botocore client with exactly the arguments s3fs's ``set_session`` builds its own with, and the
client takes everything from it: the URL of a bucket (botocore's endpoint rules, per bucket),
the signing region and name, the credentials object (botocore refreshes it), the CA bundle, the
timeouts, the attempts. What the HTTP client cannot honour (a proxy, an auth scheme other than
SigV4) is named by :meth:`S3Resolution.unsupported`, and such a mount reads through s3fs.
"""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["S3Resolution", "S3Target", "client_arguments", "resolve", "resolve_fs"]

_DEFAULT_ATTEMPTS = {"legacy": 5, "standard": 3, "adaptive": 3}  # botocore's, in all
_loader_lock = threading.Lock()
_loader: Any = None  # one botocore data loader for every session here: models are parsed once a process


@dataclass(frozen=True)
class S3Target:
    """Where one bucket's objects are: ``{scheme}://{netloc}{base}/{key}``, signed for ``region``."""

    scheme: str
    host: str
    port: int
    netloc: str  # the Host header
    base: str  # the path before the key: "/bucket" (path style), "" (virtual-hosted), plus any endpoint path
    region: str  # the signing region
    signing_name: str  # "s3"


def client_arguments(fs: Any) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(session kwargs, client kwargs, botocore Config kwargs) for an ``s3fs.S3FileSystem``:
    what its ``set_session`` passes to aiobotocore (s3fs 2024-2026), here for plain botocore."""
    client_kwargs = dict(getattr(fs, "client_kwargs", None) or {})
    init = {"aws_access_key_id": fs.key, "aws_secret_access_key": fs.secret, "aws_session_token": fs.token,
            "endpoint_url": fs.endpoint_url}
    init = {k: v for k, v in init.items() if v is not None and v != client_kwargs.get(k)}
    if "use_ssl" not in client_kwargs:
        init["use_ssl"] = fs.use_ssl
    config_kwargs = fs._prepare_config_kwargs()
    if fs.anon:
        from botocore import UNSIGNED

        drop = {"aws_access_key_id", "aws_secret_access_key", "aws_session_token"}
        init = {k: v for k, v in init.items() if k not in drop}
        client_kwargs = {k: v for k, v in client_kwargs.items() if k not in drop}
        config_kwargs["signature_version"] = UNSIGNED
    return dict(getattr(fs, "kwargs", None) or {}), {**init, **client_kwargs}, config_kwargs


def _shared_loader() -> Any:
    global _loader
    with _loader_lock:
        if _loader is None:
            import botocore.loaders

            _loader = botocore.loaders.create_loader()
        return _loader


class S3Resolution:
    """A botocore S3 client built as s3fs builds its own, and what the HTTP client reads of it."""

    def __init__(self, session: Any, client: Any, requester_pays: bool = False) -> None:
        self.session, self.client = session, client
        self.requester_pays = requester_pays  # s3fs's own option: every request says the requester pays
        config = client.meta.config
        self.endpoint_url: str = client.meta.endpoint_url
        self.region: str = client.meta.region_name or "us-east-1"
        self.addressing_style: str = str((config.s3 or {}).get("addressing_style") or "auto")
        retries = dict(config.retries or {})
        self.attempts: int = int(retries.get("total_max_attempts")
                                 or _DEFAULT_ATTEMPTS.get(str(retries.get("mode") or "legacy"), 5))
        self.connect_timeout: float = float(config.connect_timeout)
        self.read_timeout: float = float(config.read_timeout)
        http = client._endpoint.http_session
        self.verify: bool | str = getattr(http, "_verify", True)  # the option, AWS_CA_BUNDLE or the profile's ca_bundle
        self._proxies = getattr(http, "_proxy_config", None)
        self.unsigned = _is_unsigned(config.signature_version)
        self._operation = client.meta.service_model.operation_model("GetObject")
        self._targets: dict[tuple[str, str], S3Target] = {}
        self._lock = threading.Lock()
        client.meta.events.register("before-endpoint-resolution.s3", _region_override)

    def describe(self) -> dict[str, str]:
        """What a mount resolves to, to pin and to show: endpoint and region."""
        return {"endpoint_url": self.endpoint_url, "region_name": self.region}

    def target(self, bucket: str, region: str = "") -> S3Target:
        """Where ``bucket`` is, by botocore's endpoint rules (``region``: one learnt from a redirect)."""
        with self._lock:
            found = self._targets.get((bucket, region))
        if found is not None:
            return found
        context = {"cachefs_region": region} if region else {}
        endpoint = self.client._ruleset_resolver.construct_endpoint(
            self._operation, {"Bucket": bucket, "Key": "k"}, context)
        schemes = endpoint.properties.get("authSchemes") or [{"name": "sigv4", "signingRegion": self.region}]
        scheme = schemes[0]
        if scheme.get("name") != "sigv4":
            raise OSError(f"s3://{bucket}: botocore signs it with {scheme.get('name')!r}, which the worker's "
                          "HTTP client cannot (set the worker's s3_client to s3fs)")
        url = urllib.parse.urlsplit(endpoint.url)
        found = S3Target(url.scheme, url.hostname or "", url.port or (443 if url.scheme == "https" else 80),
                         url.netloc, url.path.rstrip("/"), str(scheme.get("signingRegion") or self.region),
                         str(scheme.get("signingName") or "s3"))
        with self._lock:
            self._targets[(bucket, region)] = found
        return found

    def credentials(self) -> tuple[str, str, str] | None:
        """(access key, secret, token) to sign with now, None if unsigned; botocore refreshes them."""
        if self.unsigned:
            return None
        credentials = self.client._request_signer._credentials
        if credentials is None:
            raise PermissionError("no AWS credentials found (keys, environment, shared files, SSO, web identity "
                                  "or a role), as botocore looks for them")
        frozen = credentials.get_frozen_credentials()
        return frozen.access_key, frozen.secret_key, frozen.token or ""

    def unsupported(self) -> str:
        """Why the HTTP client cannot send this mount's requests as botocore would ("" if it can)."""
        if urllib.parse.urlsplit(self.endpoint_url).scheme not in ("http", "https"):
            return f"an endpoint that is not HTTP(S) ({self.endpoint_url})"
        if self._proxies is not None and self._proxies.proxy_url_for(self.endpoint_url):
            return "a proxy (botocore's proxies, or HTTP(S)_PROXY)"
        if self.client.meta.config.client_cert:
            return "a client certificate (client_cert)"
        return ""


def _is_unsigned(value: Any) -> bool:
    from botocore import UNSIGNED

    return value is UNSIGNED


def _region_override(builtins: dict[str, Any], context: Mapping[str, Any] | None = None, **_: Any) -> None:
    """A bucket's region learnt from a redirect, as botocore's own redirector re-resolves it."""
    if context and context.get("cachefs_region"):
        builtins["AWS::Region"] = context["cachefs_region"]


def resolve_fs(fs: Any) -> S3Resolution:
    """The resolution of an ``s3fs.S3FileSystem``'s options (no request is sent)."""
    import botocore.session
    from botocore.config import Config

    session_kwargs, client_kwargs, config_kwargs = client_arguments(fs)
    session = botocore.session.Session(**session_kwargs)
    session.register_component("data_loader", _shared_loader())
    client = session.create_client("s3", config=Config(**config_kwargs), **client_kwargs)
    return S3Resolution(session, client, bool(getattr(fs, "requester_pays", False)))


def resolve(options: Mapping[str, Any]) -> S3Resolution:
    """The resolution of a mount's s3fs options."""
    import s3fs

    return resolve_fs(s3fs.S3FileSystem(skip_instance_cache=True, **dict(options)))


def _default_endpoint(resolution: S3Resolution) -> str:
    """Where botocore would go for this region with no endpoint configured anywhere."""
    from botocore.config import Config

    client = resolution.session.create_client(
        "s3", region_name=resolution.region, config=Config(ignore_configured_endpoint_urls=True),
        aws_access_key_id="x", aws_secret_access_key="x")
    return client.meta.endpoint_url


def pinned_options(url: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """A mount's options with the endpoint and region it resolves to here written in (#49).

    The master pins them when a mount is added, so that its listings and every worker's reads
    (whatever their environment or profiles) reach the same store. The endpoint is written only
    where configuration (``AWS_ENDPOINT_URL*``, a profile) chose it; AWS's own stays botocore's
    per-bucket choice. Against a store that is not AWS, botocore's default request checksums
    (1.36+), which many S3-compatible stores refuse, are asked only where required, unless the
    mount says otherwise. Credentials are never pinned. Other URLs: the options as they are."""
    out = dict(options)
    if url.split("://", 1)[0] not in ("s3", "s3a"):
        return out
    # Credentials play no part in where a mount is: a key without its secret must not stop the pin.
    secrets = ("key", "secret", "token", "aws_access_key_id", "aws_secret_access_key", "aws_session_token")
    where = {k: v for k, v in out.items() if k not in secrets}
    where["client_kwargs"] = {k: v for k, v in dict(out.get("client_kwargs") or {}).items() if k not in secrets}
    resolution = resolve(where)
    client_kwargs = dict(out.get("client_kwargs") or {})
    if not out.get("endpoint_url") and not client_kwargs.get("endpoint_url"):
        if resolution.endpoint_url != _default_endpoint(resolution):
            out["endpoint_url"] = resolution.endpoint_url
    if not client_kwargs.get("region_name"):
        client_kwargs["region_name"] = resolution.region
        out["client_kwargs"] = client_kwargs
    endpoint = out.get("endpoint_url") or client_kwargs.get("endpoint_url")
    host = urllib.parse.urlsplit(str(endpoint)).hostname or "" if endpoint else ""
    if endpoint and not (host.endswith(".amazonaws.com") or host.endswith(".amazonaws.com.cn")):
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("request_checksum_calculation", "when_required")
        config.setdefault("response_checksum_validation", "when_required")
        out["config_kwargs"] = config
    return out


def pin_mount(spec: Any) -> Any:
    """A MountSpec with :func:`pinned_options`; as it is where botocore cannot resolve it here
    (a profile this host lacks: each worker resolves it then, and a warning says so)."""
    from dataclasses import replace

    try:
        options = pinned_options(spec.url, spec.options)
    except Exception as exc:  # noqa: BLE001 - botocore's errors (ProfileNotFound, ...)
        import logging

        logging.getLogger(__name__).warning("mount %s: endpoint and region not pinned: %s", spec.name, exc)
        return spec
    return spec if options == dict(spec.options) else replace(spec, options=options)
