"""TLS for every gRPC port, and the one place that opens channels and binds server ports.

Every channel a cachefs process dials (client -> worker, client -> master, worker -> master,
master -> worker, admin commands) comes from :func:`open_channel`, and every gRPC server port
from :func:`bind_port`, so "is this connection encrypted, with which certificates, carrying
which token" has a single answer. Certificates are read when a channel or port is made: a
renewed certificate takes effect on the next restart (or, for clients, the next channel).
"""

from __future__ import annotations

import functools
import logging
import os
import ssl
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import grpc

# grpc (and cachefs.auth, which needs it) are imported inside the functions that make channels
# and ports: the configs hold a TLSConfig, and loading a config must not load grpc.

log = logging.getLogger(__name__)


def _check_readable(path: str, what: str) -> None:
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} does not exist or is not a file")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{what} {path!r} is not readable")


@dataclass(frozen=True)
class TLSConfig:
    """Certificates for one process; empty fields mean plaintext.

    ``cert_file``/``key_file``: this process's certificate chain and private key (PEM); a
    server presents it, and a client presents it as its client certificate (mutual TLS).
    ``ca_file``: the CA bundle (PEM) that peers' certificates must chain to: a client
    verifies the server with it, a server with ``require_client_cert`` verifies clients.
    """

    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    require_client_cert: bool = False

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.require_client_cert and not (self.ca_file and self.cert_file):
            raise ValueError("tls_require_client_cert needs tls_ca_file (to verify clients) "
                             "and tls_cert_file/tls_key_file (the server's own certificate)")
        if not (self.ca_file or self.cert_file):
            return  # plaintext: nothing to parse (and no SSL context to build in every new process)
        # Parse eagerly: a bad file fails at start-up with its field's name, not at the first call.
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        if self.ca_file:
            _check_readable(self.ca_file, "tls_ca_file")
            try:
                context.load_verify_locations(cafile=self.ca_file)
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(f"tls_ca_file {self.ca_file!r} holds no usable PEM certificate: {exc}") from None
        if self.cert_file:
            _check_readable(self.cert_file, "tls_cert_file")
            _check_readable(self.key_file, "tls_key_file")
            try:
                context.load_cert_chain(self.cert_file, self.key_file)
            except (ssl.SSLError, ValueError) as exc:
                raise ValueError(f"tls_cert_file {self.cert_file!r} / tls_key_file {self.key_file!r}: not a PEM "
                                 f"certificate chain and its matching private key ({exc})") from None

    @property
    def enabled(self) -> bool:
        """Whether connections use TLS (a CA to verify a server, or a certificate to serve with)."""
        return bool(self.ca_file or self.cert_file)

    @classmethod
    def from_fields(cls, owner: Any) -> "TLSConfig":
        """From a config's flat ``tls_*`` fields (how the layered configs carry it)."""
        return cls(ca_file=owner.tls_ca_file, cert_file=owner.tls_cert_file, key_file=owner.tls_key_file,
                   require_client_cert=getattr(owner, "tls_require_client_cert", False))


PLAINTEXT = TLSConfig()

#: The largest gRPC message the worker and its clients exchange (a read's first block, a write
#: chunk): both sides take their message limits from here, so the two cannot disagree.
MAX_MESSAGE_BYTES = 80 << 20
MESSAGE_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _warn_if_key_is_open(path: str) -> None:
    mode = stat.S_IMODE(os.stat(path).st_mode)
    if mode & 0o077:
        log.warning("TLS private key %s is readable by other users (mode %o); chmod 600 it", path, mode)


def server_credentials(tls: TLSConfig) -> grpc.ServerCredentials:
    """The server side of ``tls``: its certificate, and client verification if required."""
    import grpc

    if not tls.cert_file:
        raise ValueError("a TLS server needs tls_cert_file and tls_key_file")
    _warn_if_key_is_open(tls.key_file)
    roots = _read(tls.ca_file) if tls.ca_file else None
    return grpc.ssl_server_credentials(
        [(_read(tls.key_file), _read(tls.cert_file))],
        root_certificates=roots if tls.require_client_cert else None,
        require_client_auth=tls.require_client_cert,
    )


def channel_credentials(tls: TLSConfig) -> grpc.ChannelCredentials:
    """The client side of ``tls``: the CA to trust (else the system's), and a client certificate if set."""
    import grpc

    return grpc.ssl_channel_credentials(
        root_certificates=_read(tls.ca_file) if tls.ca_file else None,
        private_key=_read(tls.key_file) if tls.key_file else None,
        certificate_chain=_read(tls.cert_file) if tls.cert_file else None,
    )


def bind_port(server: grpc.Server, address: str, tls: TLSConfig = PLAINTEXT) -> int:
    """Bind ``address`` with TLS when ``tls`` has a certificate, else plaintext; returns the port."""
    if tls.cert_file:
        port = server.add_secure_port(address, server_credentials(tls))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return port


def open_channel(address: str, tls: TLSConfig = PLAINTEXT, options: Sequence[tuple[str, Any]] = (),
                 token: str = "") -> grpc.Channel:
    """A channel to ``address``: TLS if ``tls`` is enabled, and ``token`` on every call if given."""
    import grpc

    from cachefs.auth import TokenChannel

    if tls.enabled:
        channel = grpc.secure_channel(address, channel_credentials(tls), options=list(options))
    else:
        channel = grpc.insecure_channel(address, options=list(options))
    return TokenChannel(channel, token) if token else channel


def explain(details: str | None, tls: TLSConfig = PLAINTEXT) -> str:
    """A hint for a connection that failed in a way TLS settings usually cause ('' if none)."""
    text = (details or "").lower()
    if any(s in text for s in ("certificate_verify_failed", "certificate verify failed", "unknown ca",
                               "self signed", "self-signed")):
        return "the server's certificate is not signed by tls_ca_file (or the server wants a client certificate)"
    if "handshake" in text or "ssl" in text or "tls" in text:
        if not tls.enabled:
            return "the server may require TLS: set tls_ca_file"
        return "TLS handshake failed: check tls_ca_file, and tls_cert_file/tls_key_file if the server wants a client certificate"
    if any(s in text for s in ("socket closed", "connection reset", "end of file")):
        if not tls.enabled:
            return "the server may require TLS: set tls_ca_file"
        return ("the server ended the TLS handshake: it may require a client certificate signed by its CA "
                "(tls_cert_file/tls_key_file)")
    return ""


# -- the framed ports (the workers' data ports, the master's client port): Python's ssl ------------
def server_context(tls: TLSConfig) -> ssl.SSLContext:
    """The server side of ``tls`` for a framed port: the certificates gRPC's ports serve with,
    client certificates required (against ``ca_file``) exactly where gRPC requires them."""
    if not tls.cert_file:
        raise ValueError("a TLS server needs tls_cert_file and tls_key_file")
    _warn_if_key_is_open(tls.key_file)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(tls.cert_file, tls.key_file)
    if tls.require_client_cert:
        context.load_verify_locations(cafile=tls.ca_file)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


@functools.lru_cache(maxsize=8)
def shared_client_context(tls: TLSConfig) -> ssl.SSLContext:
    """``client_context``, made once per process and settings (certificates read then)."""
    return client_context(tls)


def client_context(tls: TLSConfig) -> ssl.SSLContext:
    """The client side of ``tls`` for a framed port: the server verified against ``ca_file`` (else
    the system's roots) and its name, as a gRPC channel verifies it; a client certificate if set."""
    context = ssl.create_default_context(cafile=tls.ca_file or None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert_file:
        context.load_cert_chain(tls.cert_file, tls.key_file)
    return context
