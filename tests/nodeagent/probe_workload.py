"""A tiny HTTP workload for the probe tests (standard library only).

    probe_workload.py PORT [--ready-after SECONDS]

Serves on 127.0.0.1:PORT: GET /ready answers 503 until SECONDS after the start, then 200;
GET /live answers 200, or 500 while failures ordered by GET /fail?n=K remain (K in a row);
GET /hits answers the requests counted per path as JSON; any other path answers 404.
"""

from __future__ import annotations

import http.server
import json
import sys
import time
import urllib.parse
from collections import Counter


def main() -> None:
    port, *rest = sys.argv[1:]
    ready_after = float(rest[rest.index("--ready-after") + 1]) if "--ready-after" in rest else 0
    ready_at = time.monotonic() + ready_after
    hits: Counter[str] = Counter()
    failing = 0

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            nonlocal failing
            url = urllib.parse.urlparse(self.path)
            hits[url.path] += 1
            body = b"ok"
            if url.path == "/ready":
                status = 200 if time.monotonic() >= ready_at else 503
            elif url.path == "/live":
                status = 500 if failing > 0 else 200
                failing = max(failing - 1, 0)
            elif url.path == "/fail":
                failing = int(urllib.parse.parse_qs(url.query)["n"][0])
                status = 200
            elif url.path == "/hits":
                status, body = 200, json.dumps(hits).encode()
            else:
                status = 404
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    http.server.HTTPServer(("127.0.0.1", int(port)), Handler).serve_forever()


if __name__ == "__main__":
    main()
