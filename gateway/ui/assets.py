"""The dashboard's files, shipped inside the package (gateway/ui/static, gateway/ui/templates;
pyproject.toml lists them as package data): read once, served from memory.

A page names each asset with `?v=<its digest>`, so a browser may keep it for good (a new
version of the file is a new URL); the same asset asked without the digest, or with an old
one, is revalidated every time through its ETag.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from importlib import resources
from string import Template
from typing import Final

from aiohttp import web

CONTENT_TYPES: Final = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
_FOREVER: Final = "public, max-age=31536000, immutable"


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    digest: str  # the first 16 hex digits of its SHA-256: its ETag and its `?v=`


class Assets:
    def __init__(self) -> None:
        root = resources.files(__package__) / "static"
        self._files: dict[str, Asset] = {}
        for entry in root.iterdir():
            suffix = "." + entry.name.rpartition(".")[2]
            if entry.is_file() and suffix in CONTENT_TYPES:
                body = entry.read_bytes()
                digest = hashlib.sha256(body).hexdigest()[:16]
                self._files[entry.name] = Asset(body, CONTENT_TYPES[suffix], digest)

    def names(self) -> list[str]:
        return sorted(self._files)

    def url(self, name: str) -> str:
        """Where a page finds it: /ui/static/<name>?v=<digest>."""
        return f"/ui/static/{name}?v={self._files[name].digest}"

    async def serve(self, request: web.Request) -> web.Response:
        asset = self._files.get(request.match_info["name"])
        if asset is None:
            raise web.HTTPNotFound()
        etag = f'"{asset.digest}"'
        cache = _FOREVER if request.query.get("v") == asset.digest else "no-cache"
        headers = {"ETag": etag, "Cache-Control": cache}
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers=headers)
        return web.Response(
            body=asset.body, headers={**headers, "Content-Type": asset.content_type}
        )


def template(name: str) -> Template:
    """A page template from gateway/ui/templates (`$name` placeholders)."""
    text = (resources.files(__package__) / "templates" / name).read_text(encoding="utf-8")
    return Template(text)
