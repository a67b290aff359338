"""How a process proves who it is to a secured NATS: one credentials file per identity.

`gpumesh certs init` and `gpumesh node issue` (gpumesh/security/) write these files; every
process that connects (controller, agent, gateway, CLI, integrator) reads one. A file holds
the identity's NKEY seed (the secret: never leaves the machine it was issued for), its role, the
inbox prefix its permissions allow, and the CA certificate that signed the server's TLS
certificate, so one file is all an operator copies to a new node. A node's and a gateway's file
also hold their TLS certificate and its key for HTTP between them (`tls_pem`): a node's front
serves with it, and a gateway calls fronts with it (docs/security.md, "The node front").

The layout of a data directory's security files lives here too, because clients that find a
local stack through its data directory (`gpumesh nodes`, `gpumesh agent --data-dir`) look for
their credentials the same way the issuing side writes them.
"""

from __future__ import annotations

import ssl
import tempfile
from pathlib import Path
from typing import Any, Final, Literal

import msgspec

from .errors import WireError

Role = Literal["controller", "admin", "node", "gateway", "integrator"]
ROLES: Final[tuple[Role, ...]] = ("controller", "admin", "node", "gateway", "integrator")


class CredentialsError(WireError):
    """A credentials file is missing, unreadable or malformed; the message is one line."""


class Credentials(msgspec.Struct, frozen=True, forbid_unknown_fields=False):
    """One identity's NATS credentials, as stored in `<name>.creds.json`."""

    name: str
    role: Role
    seed: str  # the NKEY seed ("SU..."): whoever holds it is this identity
    public_key: str  # the NKEY public key ("U..."), the server's name for this identity
    inbox_prefix: str  # replies to this identity's requests arrive under `<prefix>.>`
    ca_pem: str  # the CA that signed the server's certificate; TLS trusts only it
    version: int = 1
    # The identity's certificate and private key (PEM), by the same CA, for HTTP between the
    # stack's processes: a node's front (server) and a gateway (client); "": none (other roles,
    # and files issued before fronts had certificates).
    tls_pem: str = ""

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=self.ca_pem)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        return context

    def tls_context(self, *, server: bool) -> ssl.SSLContext:
        """Mutual TLS with `tls_pem`, trusting only the stack's CA. `server`: a node's front,
        which requires a certificate of every caller; else a gateway dialling fronts, which
        checks the front's certificate names the address it dialled."""
        if not self.tls_pem:
            raise CredentialsError(f"{self.role} {self.name!r}'s credentials hold no certificate")
        if server:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(cadata=self.ca_pem)
        else:
            context = ssl.create_default_context(cadata=self.ca_pem)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # ssl loads a key only from a file: one that lives for this call, in a private folder.
        with tempfile.TemporaryDirectory(prefix="gpumesh-tls-") as folder:
            path = Path(folder) / "identity.pem"
            path.touch(mode=0o600)
            path.write_text(self.tls_pem)
            try:
                context.load_cert_chain(path)
            except ssl.SSLError as exc:
                raise CredentialsError(
                    f"{self.role} {self.name!r}'s certificate is unusable: {exc}"
                ) from None
        return context

    def connect_options(self) -> dict[str, Any]:
        """Keyword arguments for nats-py's `Client.connect`."""
        options: dict[str, Any] = {"tls": self.ssl_context(), "inbox_prefix": self.inbox_prefix}
        if self.seed:  # without a seed: TLS only, which a secured server refuses
            options["nkeys_seed_str"] = self.seed
        return options


_decoder = msgspec.json.Decoder(Credentials)


def load_credentials(path: Path) -> Credentials:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CredentialsError(f"credentials file {path} does not exist") from None
    except OSError as exc:
        raise CredentialsError(f"cannot read credentials file {path}: {exc.strerror}") from None
    try:
        return _decoder.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CredentialsError(f"{path} is not a gpumesh credentials file: {exc}") from None


def inbox_prefix(role: Role, name: str) -> str:
    """Each identity gets its own inbox subtree, so its permissions can let it read replies to
    its own requests and nobody else's."""
    return f"_INBOX.{role}.{name}"


# A certificate names its holder's identity in a URI SAN, `spiffe://gpumesh/<role>/<name>`: a
# node's front serves only `gateway` certificates, a gateway dials only `node` fronts.
TLS_URI_PREFIX: Final = "spiffe://gpumesh/"


def tls_uri(role: Role, name: str) -> str:
    return f"{TLS_URI_PREFIX}{role}/{name}"


def tls_identity(peercert: Any) -> tuple[str, str] | None:
    """(role, name) from a verified peer's certificate (`SSLObject.getpeercert()`), or None
    when it names no gpumesh identity."""
    names = peercert.get("subjectAltName", ()) if peercert else ()
    for kind, value in names:
        if kind == "URI" and value.startswith(TLS_URI_PREFIX):
            role, sep, name = value.removeprefix(TLS_URI_PREFIX).partition("/")
            if sep and role in ROLES and name:
                return role, name
    return None


def secure_url(url: str) -> str:
    """nats:// -> tls://, so nats-py starts TLS; other schemes are left as they are. Each of
    a comma-separated list of servers is converted."""
    return ",".join(
        "tls://" + one.removeprefix("nats://") if one.startswith("nats://") else one
        for one in server_list(url)
    )


def server_list(url: str) -> list[str]:
    """`a,b,c` -> the servers, in order (nats-py's convention for a cluster); blanks dropped."""
    return [one.strip() for one in url.split(",") if one.strip()]


class SecurityLayout:
    """Where a data directory keeps its security files (created by `gpumesh certs init`)."""

    def __init__(self, data_dir: Path) -> None:
        self.root = Path(data_dir) / "security"

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def ca_key(self) -> Path:
        return self.root / "ca-key.pem"

    @property
    def server_cert(self) -> Path:
        return self.root / "server.pem"

    @property
    def server_key(self) -> Path:
        return self.root / "server-key.pem"

    @property
    def identities(self) -> Path:
        return self.root / "identities.json"

    @property
    def server_config(self) -> Path:
        return self.root / "nats.conf"

    @property
    def crl(self) -> Path:
        """The CA's list of revoked certificates, which nodes' fronts re-read when it changes."""
        return self.root / "crl.pem"

    @property
    def creds_dir(self) -> Path:
        return self.root / "creds"

    def creds(self, name: str) -> Path:
        return self.creds_dir / f"{name}.creds.json"

    @property
    def initialised(self) -> bool:
        return self.server_config.is_file()


def local_credentials(data_dir: Path, url: str, name: str) -> Credentials | None:
    """The credentials `name` has in a local stack's data directory, or None when the stack's
    NATS runs without security (its URL is not tls://: `gpumesh up --insecure`, or no
    `gpumesh certs init`)."""
    layout = SecurityLayout(data_dir)
    if not url.startswith("tls://") or not layout.initialised:
        return None
    return load_credentials(layout.creds(name))
