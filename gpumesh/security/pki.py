"""A private CA, the nats-server's TLS certificate, and the certificates of HTTP between nodes
and gateways.

On NATS, identities are NKEYs, not client certificates: a NKEY is revoked by deleting one line
of the server's configuration, and the CA is there to let clients verify the server. Between a
gateway and a node's front (the direct transport) there is no server to ask, so both ends hold
a certificate of the CA naming their identity (`identity_cert`) and the CA's signed revocation
list (`write_crl`) tells fronts which gateways no longer count. Keys are ECDSA P-256: small,
fast, and accepted by Go's TLS stack.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from wire.nats_access import Role, tls_uri

# One reading of a certificate's names, shared with the embedded server's start-up check.
from wire.nats_server import certificate_hosts as certificate_hosts

CA_YEARS = 10
SERVER_DAYS = 825  # the longest validity clients such as macOS still accept for a leaf
DEFAULT_HOSTS = ("127.0.0.1", "localhost")


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def write_private(path: Path, data: bytes) -> None:
    """Create `path` readable by its owner only, from the first byte (no chmod window)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def create_ca(cert_path: Path, key_path: Path, *, common_name: str = "gpumesh CA") -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365 * CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def create_server_cert(
    ca_cert_path: Path,
    ca_key_path: Path,
    cert_path: Path,
    key_path: Path,
    hosts: Sequence[str] = DEFAULT_HOSTS,
    *,
    common_name: str = "",
    client_auth: bool = False,
) -> None:
    """A certificate for nats-server, valid for every name and address in `hosts`: clients
    check the address they dialled against these. `client_auth`: the certificate also proves
    who dials (a route between servers is mutual TLS: each server is the other's client)."""
    ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    unique = list(dict.fromkeys(hosts))
    usages = [ExtendedKeyUsageOID.SERVER_AUTH]
    if client_auth:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    subject = common_name or unique[0]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in unique]), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    write_private(key_path, _key_pem(key))
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _load_ca(
    ca_cert_path: Path, ca_key_path: Path
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    ca_cert = x509.load_pem_x509_certificate(ca_cert_path.read_bytes())
    ca_key = serialization.load_pem_private_key(ca_key_path.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca_key_path} is not an ECDSA key")
    return ca_cert, ca_key


def identity_cert(
    ca_cert_path: Path,
    ca_key_path: Path,
    role: Role,
    name: str,
    hosts: Sequence[str] = (),
    *,
    server: bool = False,
    client: bool = False,
) -> tuple[str, int]:
    """A certificate of `name` in `role` (its URI SAN, `spiffe://gpumesh/<role>/<name>`; its
    subject's CN and OU too, for people), with its new key: (key and certificate as one PEM,
    serial). `server`: it serves TLS at `hosts` (a node's front); `client`: it dials (a
    gateway)."""
    ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    usages = []
    if server:
        usages.append(ExtendedKeyUsageOID.SERVER_AUTH)
    if client:
        usages.append(ExtendedKeyUsageOID.CLIENT_AUTH)
    if not usages:
        raise ValueError("a certificate that neither serves nor dials")
    names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(tls_uri(role, name))]
    names += [_san(h) for h in dict.fromkeys(hosts)]
    serial = x509.random_serial_number()
    subject = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, role),
            x509.NameAttribute(NameOID.COMMON_NAME, name),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(serial)
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = _key_pem(key) + cert.public_bytes(serialization.Encoding.PEM)
    return pem.decode(), serial


def write_crl(ca_cert_path: Path, ca_key_path: Path, serials: Sequence[int], path: Path) -> None:
    """The CA's signed list of revoked certificates, replacing `path` in one rename: a front
    that re-reads it never sees half a file. Nobody checks its dates (fronts re-read it when
    it changes), so it says it is good for as long as the CA."""
    ca_cert, ca_key = _load_ca(ca_cert_path, ca_key_path)
    now = _now()
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - datetime.timedelta(minutes=5))
        .next_update(now + datetime.timedelta(days=365 * CA_YEARS))
    )
    for serial in dict.fromkeys(serials):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder()
            .serial_number(serial)
            .revocation_date(now - datetime.timedelta(minutes=5))
            .build()
        )
    crl = builder.sign(ca_key, hashes.SHA256())
    write_private(path, crl.public_bytes(serialization.Encoding.PEM))


def not_after(cert_path: Path) -> datetime.datetime:
    return x509.load_pem_x509_certificate(cert_path.read_bytes()).not_valid_after_utc
