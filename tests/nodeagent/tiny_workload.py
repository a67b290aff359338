"""A tiny HTTP workload for the process driver tests (standard library only).

    tiny_workload.py RECORD PORT [ARG...] [--ignore-sigterm] [--no-serve] [--exit-now CODE]
                     [--fork-child]

Writes its argv, CUDA_VISIBLE_DEVICES and TINY_* variables as JSON to RECORD, then serves on
127.0.0.1:PORT: GET /health answers 200 (500 once /sick was requested); GET /exit?code=N
answers and exits with N. --fork-child starts a grandchild in the same process group that
ignores SIGTERM too if --ignore-sigterm is given; its pid is in RECORD.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import time
import urllib.parse


def main() -> None:
    record, port, *rest = sys.argv[1:]
    flags = set(rest)
    if "--ignore-sigterm" in flags:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    info: dict[str, object] = {
        "argv": sys.argv[1:],
        "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "env": {k: v for k, v in os.environ.items() if k.startswith(("TINY_", "GPUMESH_"))},
        "pid": os.getpid(),
    }
    if "--fork-child" in flags:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        info["child"] = child.pid
    with open(record + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(record + ".tmp", record)  # readers never see half a record
    print(f"tiny workload on port {port}", flush=True)
    if "--exit-now" in rest:
        sys.exit(int(rest[rest.index("--exit-now") + 1]))
    if "--no-serve" in flags:
        while True:
            time.sleep(1)
    sick = False

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            nonlocal sick
            url = urllib.parse.urlparse(self.path)
            if url.path == "/sick":
                sick = True
            status = 500 if sick and url.path == "/health" else 200
            self.send_response(status)
            self.end_headers()
            self.wfile.write(b"ok")
            self.wfile.flush()
            if url.path == "/exit":
                code = int(urllib.parse.parse_qs(url.query).get("code", ["0"])[0])
                os._exit(code)

        def log_message(self, format: str, *args: object) -> None:
            pass

    http.server.HTTPServer(("127.0.0.1", int(port)), Handler).serve_forever()


if __name__ == "__main__":
    main()
