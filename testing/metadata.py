"""A fake cloud metadata service on loopback: AWS IMDSv2 and GCP, per-worker notices.

Each worker is pointed at its own base URL, ``http://127.0.0.1:PORT/<node>``,
so a test can reclaim one node of many:

    with FakeMetadata() as md:
        env["RENDERFLEET_AWS_METADATA_URL"] = md.url("node-1")
        ...
        md.aws_notice("node-1", seconds=120)
"""

from __future__ import annotations

import json
import threading
import time
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeMetadata:
    def __init__(self) -> None:
        self.aws: dict[str, dict[str, Any]] = {}
        self.rebalance: set[str] = set()
        self.gcp: set[str] = set()
        self.requests: list[tuple[str, str]] = []
        self.tokens_issued = 0
        self.noticed_at: dict[str, float] = {}
        self.instance_ids: dict[str, str] = {}  # node -> its EC2 instance id
        self.regions: dict[str, str] = {}  # node -> its EC2 region (placement/region)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _node_path(self) -> tuple[str, str]:
                _, node, rest = self.path.split("/", 2)
                return node, "/" + rest

            def _send(self, code: int, body: str = "", ctype: str = "text/plain") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                node, path = self._node_path()
                outer.requests.append(("PUT", self.path))
                if path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    outer.tokens_issued += 1
                    self._send(200, f"token-{node}")
                else:
                    self._send(400)

            def do_GET(self) -> None:
                node, path = self._node_path()
                outer.requests.append(("GET", self.path))
                if path.startswith("/computeMetadata/"):
                    if self.headers.get("Metadata-Flavor") != "Google":
                        self._send(403)
                    elif path == "/computeMetadata/v1/instance/preempted":
                        self._send(200, "TRUE" if node in outer.gcp else "FALSE")
                    else:
                        self._send(404)
                    return
                if self.headers.get("X-aws-ec2-metadata-token") != f"token-{node}":
                    self._send(401)
                elif path == "/latest/meta-data/spot/instance-action" and node in outer.aws:
                    self._send(200, json.dumps(outer.aws[node]), "application/json")
                elif path == "/latest/meta-data/instance-id" and node in outer.instance_ids:
                    self._send(200, outer.instance_ids[node])
                elif path == "/latest/meta-data/placement/region" and node in outer.regions:
                    self._send(200, outer.regions[node])
                elif path == "/latest/meta-data/events/recommendations/rebalance" and node in outer.rebalance:
                    self._send(200, json.dumps({"noticeTime": _stamp(0)}), "application/json")
                else:
                    self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.port}/{node}"

    def aws_notice(self, node: str, seconds: float = 120) -> None:
        """A spot interruption notice: terminate ``seconds`` from now."""
        self.noticed_at[node] = time.monotonic()
        self.aws[node] = {"action": "terminate", "time": _stamp(seconds)}

    def aws_rebalance(self, node: str) -> None:
        self.noticed_at[node] = time.monotonic()
        self.rebalance.add(node)

    def gcp_preempt(self, node: str) -> None:
        self.noticed_at[node] = time.monotonic()
        self.gcp.add(node)

    def __enter__(self) -> FakeMetadata:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _stamp(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
