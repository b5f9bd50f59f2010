"""A stand-in for the Kubernetes API server on loopback: the one endpoint a worker calls.

``PATCH /api/v1/namespaces/NS/pods/NAME`` with a JSON merge patch (RFC 7386)
and a bearer token, answering the patched pod as the API server does, so the
real ``kubernetes`` client can be pointed at it (a test double of the server,
not a mock of the client):

    with FakeKubeApi(token="t") as api:
        api.pods[("renderfleet", "worker-0")] = {}
        core = api.client()          # kubernetes.client.CoreV1Api configured for this server
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

MERGE_PATCH = "application/merge-patch+json"


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge key by key, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


class FakeKubeApi:
    def __init__(self, token: str = "test-token") -> None:
        self.token = token
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name) -> the pod's metadata
        self.requests: list[tuple[str, str, str]] = []  # (method, path, content type)
        self.fail_next = 0  # answer this many PATCHes with a 500
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _status(self, code: int, reason: str, message: str) -> None:
                self._answer(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
                                    "reason": reason, "message": message})

            def do_PATCH(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                ctype = self.headers.get("Content-Type", "")
                outer.requests.append(("PATCH", self.path, ctype))
                if self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._status(401, "Unauthorized", "no or wrong bearer token")
                parts = self.path.split("?", 1)[0].strip("/").split("/")
                if len(parts) != 6 or parts[:3] != ["api", "v1", "namespaces"] or parts[4] != "pods":
                    return self._status(404, "NotFound", f"this fake serves only pods, not {self.path}")
                if ctype.split(";")[0].strip() != MERGE_PATCH:
                    return self._status(415, "UnsupportedMediaType", f"{ctype!r}: this fake takes {MERGE_PATCH}")
                namespace, name = parts[3], parts[5]
                if (namespace, name) not in outer.pods:
                    return self._status(404, "NotFound", f'pods "{name}" not found')
                if outer.fail_next:
                    outer.fail_next -= 1
                    return self._status(500, "InternalError", "injected failure")
                patch = json.loads(raw)
                metadata = merge_patch(outer.pods[(namespace, name)], patch.get("metadata", {}))
                outer.pods[(namespace, name)] = metadata
                self._answer(200, {"kind": "Pod", "apiVersion": "v1",
                                   "metadata": {**metadata, "name": name, "namespace": namespace}})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-kube-api", daemon=True)

    def annotations(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self.pods[(namespace, name)].get("annotations") or {})

    def client(self) -> Any:
        """A real ``kubernetes.client.CoreV1Api`` configured for this server and its token."""
        from kubernetes import client

        config = client.Configuration(host=self.url, api_key={"BearerToken": self.token},
                                      api_key_prefix={"BearerToken": "Bearer"})
        return client.CoreV1Api(client.ApiClient(config))

    def __enter__(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
