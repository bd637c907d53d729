"""A stand-in for the Hugging Face Hub's file endpoint, on localhost (CI cannot reach the Hub).

It answers what huggingface_hub's ``hf_hub_download`` asks of the Hub (HEAD, then GET, of
``/<repo>/resolve/<revision>/<file>`` with the commit and ETag headers), so that the library itself
writes a real cache layout (blobs, snapshots, refs) wherever ``HF_HUB_CACHE`` points, and autotune's
download path runs against it with ``HF_ENDPOINT``. Every request is kept, to show what was fetched.
"""

from __future__ import annotations

import hashlib
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from tests.conftest import free_port


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[tuple[str, str], dict[str, bytes]] = {}  # (repo id, revision) -> file name -> content
        self.requests: list[tuple[str, str]] = []  # (method, path)
        self.url = ""

    def add(self, repo: str, files: dict[str, bytes | Path], revision: str = "main") -> str:
        """Serve ``files`` as ``repo`` at ``revision``; returns the commit hash the Hub would give it."""
        self.repos[(repo, revision)] = {n: (f.read_bytes() if isinstance(f, Path) else f) for n, f in files.items()}
        return self.commit(repo, revision)

    @staticmethod
    def commit(repo: str, revision: str) -> str:
        return hashlib.sha1(f"{repo}@{revision}".encode()).hexdigest()

    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, body: bool) -> None:
                hub.requests.append((self.command, self.path))
                path = unquote(self.path.split("?", 1)[0]).lstrip("/")
                repo, sep, rest = path.partition("/resolve/")
                revision, _, name = rest.partition("/")
                content = hub.repos.get((repo, revision), {}).get(name) if sep else None
                if content is None:
                    known = any(r == repo for r, _ in hub.repos)
                    self.send_response(404)
                    self.send_header("X-Error-Code", "EntryNotFound" if known else "RepoNotFound")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("X-Repo-Commit", hub.commit(repo, revision))
                self.send_header("ETag", f'"{hashlib.sha256(content).hexdigest()}"')
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                if body:
                    self.wfile.write(content)

            def do_HEAD(self):  # noqa: N802 (http.server's names)
                self._answer(body=False)

            def do_GET(self):  # noqa: N802
                self._answer(body=True)

            def log_message(self, *args):
                pass

        return Handler

    @contextmanager
    def serving(self):
        server = ThreadingHTTPServer(("127.0.0.1", free_port()), self._handler())
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.url = f"http://127.0.0.1:{server.server_address[1]}"
        try:
            yield self
        finally:
            server.shutdown()
            server.server_close()
