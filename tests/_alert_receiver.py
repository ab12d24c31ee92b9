"""A real HTTP receiver on 127.0.0.1 for the alert tests: it takes the generic webhook's JSON
POSTs and keeps each one it answered 200 (a request whose answer could not be written — the
sender was killed while waiting — did not arrive). It can be taken down (the port closed)
and brought back on the same port, made to fail a share of requests after reading them (a
sender must retry; the receiver then holds a repeat, dropped by the alert id), and made to
hold its first answers (a sender killed mid-delivery). Every request it read is also kept
whole (path, headers, raw body) in ``requests_seen``, before its answer is written: the Slack
and ntfy channels are checked against it byte for byte (their bodies are not the webhook's
JSON, so only JSON bodies count as ``arrivals``)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    def __init__(self, port: int = 0, path: str = "/hook"):
        self.path = path
        self.arrivals: list[dict] = []  # every body answered 200, repeats included
        self.arrived_at: list[float] = []
        self.fail_every = 0  # answer 500 to every n-th request (0: never)
        self.hold_first_s = 0.0  # the first request waits this long before its answer
        self.requests = 0
        self.requests_seen: list[dict] = []  # {path, headers, body: bytes}, answered 200
        self._lock = threading.Lock()
        self._server = None
        self.port = port
        self.up()

    def _handler(self):
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with outer._lock:
                    outer.requests += 1
                    n = outer.requests
                    hold = outer.hold_first_s if n == 1 else 0.0
                    fail = outer.fail_every and n % outer.fail_every == 0
                    # kept before the answer goes, so that a sender that has its answer finds it here
                    outer.requests_seen.append({"path": self.path, "headers": dict(self.headers.items()),
                                                "body": body})
                if self.path != outer.path:
                    self.send_response(404)
                    self.end_headers()
                    return
                if hold:
                    time.sleep(hold)
                if fail:
                    self.send_response(500)
                    self.end_headers()
                    return
                try:
                    self.send_response(200)
                    self.send_header("Content-Length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                    self.wfile.flush()
                except OSError:
                    return  # the sender is gone: it never learnt of this one
                with outer._lock:
                    if (self.headers.get("Content-Type") or "").startswith("application/json"):
                        outer.arrivals.append(json.loads(body))
                        outer.arrived_at.append(time.time())

            def log_message(self, *a):  # quiet
                pass

        return Handler

    def up(self) -> None:
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def down(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    def alerts(self) -> dict[str, dict]:
        """The alerts that arrived, de-duplicated by id (the receiver's side of at-least-once)."""
        with self._lock:
            return {a["id"]: a for a in self.arrivals}

    def of_kind(self, kind: str) -> list[dict]:
        return [a for a in self.alerts().values() if a["kind"] == kind]


def sim_notify_config(sim_node, path, ctid) -> "object":
    """A controller config holding the sim node with container ``ctid`` alone and one webhook
    channel whose URL is read from ALERT_WEBHOOK_URL (the tests' receiver)."""
    from controller import config as cfg

    entry = sim_node.node_config()
    node = cfg.NodeConfig(host=entry["host"], port=entry["port"], user=entry["user"],
                          identity_file=entry["identity_file"], known_hosts=entry["known_hosts"],
                          containers={k: cfg.ContainerConfig(**v) for k, v in entry["containers"].items()
                                      if str(k) == str(ctid)})
    cfg.save(cfg.Config(default_node="sim", nodes={"sim": node},
                        notify={"channels": {"hook": {"type": "webhook", "url_env": "ALERT_WEBHOOK_URL"}}}), path)
    return path
