"""`gpumesh certs` and `gpumesh node` issue and revoke the direct transport's certificates
alongside the NATS identities (issue 22, part 1): what each certificate says, where it is
kept, and what the revocation list holds after each change."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from gpumesh.cli import main
from gpumesh.security import identities
from nodeagent.fencing_front import read_crl
from wire.nats_access import SecurityLayout, load_credentials, tls_identity


def _cert(pem: str) -> x509.Certificate:
    return x509.load_pem_x509_certificate(pem[pem.index("-----BEGIN CERTIFICATE-----") :].encode())


def _revoked(layout: SecurityLayout) -> frozenset[int]:
    return read_crl(layout.crl.read_bytes(), layout.ca_cert.read_text())


def test_a_node_serves_for_its_addresses_and_a_gateway_dials(tmp_path: Path) -> None:
    data = tmp_path / "d"
    assert main(["--data-dir", str(data), "certs", "init"]) == 0
    argv = ["--data-dir", str(data), "node", "issue", "gpu-7"]
    assert main([*argv, "--address", "10.0.0.7", "--address", "gpu-7.example.org"]) == 0
    layout = SecurityLayout(data)
    node = _cert(load_credentials(layout.creds("gpu-7")).tls_pem)
    names = node.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://gpumesh/node/gpu-7"
    ]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    assert names.get_values_for_type(x509.DNSName) == ["gpu-7.example.org"]
    usage = node.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    gateway = _cert(load_credentials(layout.creds("gateway")).tls_pem)
    usage = gateway.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    ou = gateway.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    assert ou[0].value == "gateway"
    # The front reads the identity from what ssl shows of a verified peer.
    assert tls_identity({"subjectAltName": (("URI", "spiffe://gpumesh/gateway/gw"),)}) == (
        "gateway",
        "gw",
    )
    assert tls_identity({"subjectAltName": (("DNS", "gw"),)}) is None
    # Roles that call no front get no certificate; --address is a node's only.
    assert not load_credentials(layout.creds("admin")).tls_pem
    with pytest.raises(identities.SecurityError, match="nodes only"):
        identities.issue(layout, "gw-3", "gateway", hosts=["10.0.0.3"])


def test_revoking_or_replacing_a_certificate_lists_it(tmp_path: Path) -> None:
    layout = SecurityLayout(tmp_path)
    identities.init(layout)
    assert _revoked(layout) == frozenset()  # init writes an empty list: fronts find a file
    identities.issue(layout, "gw-2", "gateway")
    first = identities.load_registry(layout).find("gw-2")
    assert first is not None and first.tls_serial
    # A new certificate (`gpumesh certs tls gw-2`): the old one is revoked, the key kept.
    seed = load_credentials(layout.creds("gw-2")).seed
    identities.issue_tls(layout, "gw-2")
    second = identities.load_registry(layout).find("gw-2")
    assert second is not None and second.tls_serial != first.tls_serial
    assert load_credentials(layout.creds("gw-2")).seed == seed
    assert _revoked(layout) == {int(first.tls_serial, 16)}
    identities.revoke(layout, "gw-2")
    assert _revoked(layout) == {int(first.tls_serial, 16), int(second.tls_serial, 16)}
    with pytest.raises(identities.SecurityError, match="revoked"):
        identities.issue_tls(layout, "gw-2")


def test_a_file_of_another_identity_is_not_rewritten(tmp_path: Path) -> None:
    layout = SecurityLayout(tmp_path)
    identities.init(layout)
    identities.issue(layout, "gw-2", "gateway")
    with pytest.raises(identities.SecurityError, match="another identity"):
        identities.issue_tls(layout, "gw-2", out=layout.creds("gateway"))
    with pytest.raises(identities.SecurityError, match="only nodes and gateways"):
        identities.issue_tls(layout, "admin")


def test_a_data_directory_from_before_gets_its_certificates(tmp_path: Path) -> None:
    """Credentials written before fronts had certificates: `certs init` (and `gpumesh up`,
    for its nodes) add them, keeping each identity's key."""
    layout = SecurityLayout(tmp_path)
    identities.init(layout)
    identities.issue(layout, "node-0", "node")
    for name in ("gateway", "node-0"):
        path = layout.creds(name)
        old = msgspec.structs.replace(load_credentials(path), tls_pem="")
        path.write_bytes(msgspec.json.encode(old))
    assert str(layout.creds("gateway")) in identities.init(layout)
    assert identities.ensure_tls(layout, "node-0")
    assert not identities.ensure_tls(layout, "node-0")  # once
    for name in ("gateway", "node-0"):
        assert load_credentials(layout.creds(name)).tls_pem
