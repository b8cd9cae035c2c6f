"""A stand-in llama-server that ignores SIGTERM, for the checks that servers draftsmith starts never outlive it.

    python tests/fake_llama_server.py --port N [llama-server's other options, ignored]

It answers GET /health with 200 on 127.0.0.1:N and ignores SIGTERM, as a server busy with a long request can seem
to: only SIGKILL ends it. `install(folder)` writes `folder/llama-server` (a shell script that execs this file with
this interpreter), which llama_cpp finds with DRAFTSMITH_LLAMA_CPP=folder.
"""

from __future__ import annotations

import shlex
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def install(folder: Path) -> Path:
    """`folder/llama-server`, executable, running this stand-in."""
    path = folder / "llama-server"
    path.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "
                    '"$@"\n')
    path.chmod(0o755)
    return path


class Health(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):  # quiet
        pass


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    HTTPServer(("127.0.0.1", int(sys.argv[sys.argv.index("--port") + 1])), Health).serve_forever()
