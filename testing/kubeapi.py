"""A stand-in for the Kubernetes API server on loopback: the endpoints renderfleet calls.

``PATCH /api/v1/namespaces/NS/pods/NAME`` (a worker's pod-deletion-cost) and
``GET``/``PATCH /apis/apps/v1/namespaces/NS/deployments/NAME/scale`` (the
``kubernetes`` autoscale backend), each with a JSON merge patch (RFC 7386)
and a bearer token, answering as the API server does, so the real
``kubernetes`` client can be pointed at it (a test double of the server, not
a mock of the client).  ``scalable``, when set, is the RBAC Role's
``resourceNames`` on deployments/scale: any other Deployment is a 403.

    with FakeKubeApi(token="t") as api:
        api.pods[("renderfleet", "worker-0")] = {}
        core = api.client()          # kubernetes.client.CoreV1Api configured for this server
        api.replicas[("renderfleet", "worker-spot")] = 0
        apps = api.apps()            # kubernetes.client.AppsV1Api
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
        self.replicas: dict[tuple[str, str], int] = {}  # (namespace, name) -> a Deployment's spec.replicas
        self.scalable: set[str] | None = None  # the Role's resourceNames on deployments/scale; None: any
        self.requests: list[tuple[str, str, str]] = []  # (method, path, content type)
        self.fail_next = 0  # answer this many PATCHes of a pod, or calls on a scale, with a 500
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
                self._answer(
                    code,
                    {
                        "kind": "Status",
                        "apiVersion": "v1",
                        "status": "Failure",
                        "code": code,
                        "reason": reason,
                        "message": message,
                    },
                )

            def _scale(self, namespace: str, name: str) -> None:
                replicas = outer.replicas[(namespace, name)]
                self._answer(
                    200,
                    {
                        "kind": "Scale",
                        "apiVersion": "autoscaling/v1",
                        "metadata": {"name": name, "namespace": namespace},
                        "spec": {"replicas": replicas},
                        "status": {"replicas": replicas},
                    },
                )

            def _deployment_scale(self, method: str, raw: bytes) -> bool:
                """``.../deployments/NAME/scale``; False when the path is not one."""
                parts = self.path.split("?", 1)[0].strip("/").split("/")
                if (
                    len(parts) != 8
                    or parts[:4] != ["apis", "apps", "v1", "namespaces"]
                    or parts[5] != "deployments"
                    or parts[7] != "scale"
                ):
                    return False
                namespace, name = parts[4], parts[6]
                if outer.scalable is not None and name not in outer.scalable:
                    self._status(
                        403,
                        "Forbidden",
                        f'deployments.apps "{name}" is forbidden: cannot {method.lower()} resource "deployments/scale"',
                    )
                elif (namespace, name) not in outer.replicas:
                    self._status(404, "NotFound", f'deployments.apps "{name}" not found')
                elif method == "PATCH" and self.headers.get("Content-Type", "").split(";")[0].strip() != MERGE_PATCH:
                    self._status(415, "UnsupportedMediaType", f"this fake takes {MERGE_PATCH}")
                elif outer.fail_next:
                    outer.fail_next -= 1
                    self._status(500, "InternalError", "injected failure")
                else:
                    if method == "PATCH":
                        spec = json.loads(raw).get("spec", {})
                        outer.replicas[(namespace, name)] = int(spec.get("replicas", outer.replicas[(namespace, name)]))
                    self._scale(namespace, name)
                return True

            def do_GET(self) -> None:
                outer.requests.append(("GET", self.path, ""))
                if self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._status(401, "Unauthorized", "no or wrong bearer token")
                if not self._deployment_scale("GET", b""):
                    self._status(404, "NotFound", f"this fake serves no GET of {self.path}")

            def do_PATCH(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                ctype = self.headers.get("Content-Type", "")
                outer.requests.append(("PATCH", self.path, ctype))
                if self.headers.get("Authorization") != f"Bearer {outer.token}":
                    return self._status(401, "Unauthorized", "no or wrong bearer token")
                if self._deployment_scale("PATCH", raw):
                    return None
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
                self._answer(
                    200, {"kind": "Pod", "apiVersion": "v1", "metadata": {**metadata, "name": name, "namespace": namespace}}
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="fake-kube-api", daemon=True)

    def annotations(self, namespace: str, name: str) -> dict[str, str]:
        return dict(self.pods[(namespace, name)].get("annotations") or {})

    def _api_client(self) -> Any:
        from kubernetes import client

        config = client.Configuration(
            host=self.url, api_key={"BearerToken": self.token}, api_key_prefix={"BearerToken": "Bearer"}
        )
        return client.ApiClient(config)

    def client(self) -> Any:
        """A real ``kubernetes.client.CoreV1Api`` configured for this server and its token."""
        from kubernetes import client

        return client.CoreV1Api(self._api_client())

    def apps(self) -> Any:
        """A real ``kubernetes.client.AppsV1Api`` configured for this server and its token."""
        from kubernetes import client

        return client.AppsV1Api(self._api_client())

    def __enter__(self) -> FakeKubeApi:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
