"""Test certificates, made at test time with ``cryptography``: a CA, a server certificate for
127.0.0.1/localhost, a client certificate, and a second, unrelated CA with its own client
certificate (the "wrong CA" cases). EC P-256 keys: quick to make, and gRPC takes them."""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class PKI:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str
    other_client_cert: str
    other_client_key: str
    other_server_cert: str
    other_server_key: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "wb") as f:
        f.write(data)
    return str(path)


def _write_cert(path: Path, cert: x509.Certificate) -> str:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(path)


def _ca(common_name: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(_name(common_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str,
          server: bool) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = [ExtendedKeyUsageOID.CLIENT_AUTH] + ([ExtendedKeyUsageOID.SERVER_AUTH] if server else [])
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    if server:  # daemons serve and dial with one certificate, hence both usages
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
    return key, builder.sign(ca_key, hashes.SHA256())


def make_pki(directory: Path) -> PKI:
    """Write every file into ``directory`` (keys 0600) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = _ca("cachefs test CA")
    server_key, server_cert = _leaf(ca_key, ca_cert, "cachefs daemon", server=True)
    client_key, client_cert = _leaf(ca_key, ca_cert, "cachefs client", server=False)
    other_key, other_cert = _ca("some other CA")
    other_client_key, other_client_cert = _leaf(other_key, other_cert, "stranger", server=False)
    other_server_key, other_server_cert = _leaf(other_key, other_cert, "impostor daemon", server=True)
    d = directory
    return PKI(
        ca=_write_cert(d / "ca.pem", ca_cert),
        server_cert=_write_cert(d / "server.pem", server_cert), server_key=_write_key(d / "server.key", server_key),
        client_cert=_write_cert(d / "client.pem", client_cert), client_key=_write_key(d / "client.key", client_key),
        other_ca=_write_cert(d / "other-ca.pem", other_cert),
        other_client_cert=_write_cert(d / "other-client.pem", other_client_cert),
        other_client_key=_write_key(d / "other-client.key", other_client_key),
        other_server_cert=_write_cert(d / "other-server.pem", other_server_cert),
        other_server_key=_write_key(d / "other-server.key", other_server_key),
    )
