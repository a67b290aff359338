"""How commands find a running stack: the NATS URL is written into the data directory."""

from __future__ import annotations

from pathlib import Path

from .nats_access import Credentials, load_credentials, local_credentials

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


def nats_url_file(data_dir: Path) -> Path:
    return data_dir / "nats.url"


def find_nats_url(data_dir: Path, explicit: str | None) -> str:
    """--nats wins; else the URL a running `gpumesh up`/`controller` wrote; else the default."""
    if explicit:
        return explicit
    path = nats_url_file(data_dir)
    if path.exists():
        return path.read_text().strip() or DEFAULT_NATS_URL
    return DEFAULT_NATS_URL


def write_nats_url(data_dir: Path, url: str) -> None:
    data_dir.mkdir(parents=True, exist_ok=True)
    nats_url_file(data_dir).write_text(url + "\n")


def clear_nats_url(data_dir: Path, url: str) -> None:
    path = nats_url_file(data_dir)
    if path.exists() and path.read_text().strip() == url:
        path.unlink()


def credentials_for(
    data_dir: Path, url: str, name: str, explicit: Path | None = None
) -> Credentials | None:
    """`--nats-creds FILE` wins; else `name`'s credentials in the local stack's data directory
    when its NATS is secured (tls://); else None (a server without authentication)."""
    if explicit is not None:
        return load_credentials(explicit)
    return local_credentials(data_dir, url, name)
