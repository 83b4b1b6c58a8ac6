"""The operator's client of one server pod's admin API (the contract is in docs/operator.md).

Every call carries the Bearer admin token; every failure is an ``AdminError`` whose ``reason`` is a
condition reason (PodUnreachable for connection errors and timeouts, else the pod's own reason).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import aiohttp

from loraplane.operator import conditions as C

# Pod-side adapter states, as GET /admin/adapters reports them.
PULLING, CACHED, LOADED, WARM, FAILED = "pulling", "cached", "loaded", "warm", "failed"


class AdminError(Exception):
    def __init__(self, reason: str, message: str, pod: str = ""):
        super().__init__(f"{pod}: {reason}: {message}" if pod else f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.pod = pod


@dataclass(frozen=True, slots=True)
class PodAddress:
    name: str
    ip: str
    port: int  # the container port named "admin"

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{self.port}"


@dataclass(frozen=True, slots=True)
class LoadedVersion:
    """One version of one adapter on one pod."""

    name: str
    version: str
    digest: str
    state: str  # pulling | cached | loaded | warm | failed
    serving: bool  # the alias ``name`` points at this version
    message: str = ""

    @classmethod
    def parse(cls, obj: dict) -> LoadedVersion:
        return cls(
            name=str(obj.get("name", "")),
            version=str(obj.get("version", "")),
            digest=str(obj.get("digest", "")),
            state=str(obj.get("state", "")),
            serving=bool(obj.get("serving", False)),
            message=str(obj.get("message", ""))[:512],
        )


@dataclass(frozen=True, slots=True)
class LoadRequest:
    uri: str
    version: str
    manifest_digest: str
    pin: bool
    warm: str

    def body(self) -> dict:
        return {
            "uri": self.uri,
            "version": self.version,
            "manifest_digest": self.manifest_digest,
            "pin": self.pin,
            "warm": self.warm,
        }


@dataclass(frozen=True, slots=True)
class Answer:
    """A pod's answer, read in full."""

    status_code: int
    reason_phrase: str
    content: bytes

    def json(self):
        return json.loads(self.content)


# Under the server's keep-alive (uvicorn closes an idle connection after 5 s): a connection is never reused
# just as the pod closes it.
KEEPALIVE_S = 4.0


class AdminClient:
    """One shared aiohttp session for every pod; a pod is addressed by its IP and its admin port. (aiohttp,
    not httpx: with thousands of adapters, httpx's pool scanned every connection it held on each request and
    response, which was a large part of the operator's CPU.)"""

    def __init__(
        self,
        *,
        connect_timeout: float = 2.0,
        read_timeout: float = 30.0,
        connections: int = 72,
        per_pod: int = 8,
    ):
        """``connections``: at most this many open at once (the calls in flight are bounded anyway, by the
        operator's ``pod_concurrency``); ``per_pod``: at most this many to one pod, the rest queue for them."""
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout, sock_read=read_timeout
        )
        self._connections = connections
        self._per_pod = per_pod
        self._session: aiohttp.ClientSession | None = None  # made in the running loop, on first use

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(
                limit=self._connections, limit_per_host=self._per_pod, keepalive_timeout=KEEPALIVE_S
            )
            self._session = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._session

    async def _call(self, pod: PodAddress, token: str, method: str, path: str, **kw) -> Answer:
        url = pod.url + path
        headers = {"Authorization": f"Bearer {token}"}
        try:
            async with self._http().request(method, url, headers=headers, **kw) as response:
                answer = Answer(response.status, response.reason or "", await response.read())
        except TimeoutError as exc:  # aiohttp's connect and read timeouts are TimeoutErrors
            raise AdminError(
                C.POD_UNREACHABLE, f"{method} {path} timed out ({type(exc).__name__})", pod.name
            ) from None
        except (aiohttp.ClientError, OSError) as exc:
            raise AdminError(C.POD_UNREACHABLE, f"{method} {path}: {type(exc).__name__}", pod.name) from None
        if answer.status_code >= 400 and not (method == "DELETE" and answer.status_code == 404):
            raise _error(pod.name, method, path, answer)
        return answer

    async def ready(self, pod: PodAddress, token: str) -> dict:
        """GET /health/ready -> {"status": "ready", "base_hash": "<64 hex>"}."""
        return (await self._call(pod, token, "GET", "/health/ready")).json()

    async def list(self, pod: PodAddress, token: str, name: str | None = None) -> list[LoadedVersion]:
        """GET /admin/adapters[?name=]: the versions the pod holds (its truth, rebuilt after a restart)."""
        params = {"name": name} if name else None
        body = (await self._call(pod, token, "GET", "/admin/adapters", params=params)).json()
        return [LoadedVersion.parse(item) for item in body.get("adapters", [])]

    async def load(self, pod: PodAddress, token: str, name: str, request: LoadRequest) -> LoadedVersion:
        """PUT /admin/adapters/{name}: pull, verify and warm ``name@version`` (idempotent).

        200 when warm, 202 while still pulling or warming (call again later). The alias switches to it
        only if the pod serves no version of ``name`` yet.
        """
        response = await self._call(pod, token, "PUT", f"/admin/adapters/{name}", json=request.body())
        return LoadedVersion.parse(response.json())

    async def switch(self, pod: PodAddress, token: str, name: str, version: str) -> None:
        """POST /admin/adapters/{name}/alias: route ``name`` to ``version`` (already warm) atomically."""
        await self._call(pod, token, "POST", f"/admin/adapters/{name}/alias", json={"version": version})

    async def unload(self, pod: PodAddress, token: str, name: str, version: str | None = None) -> None:
        """DELETE /admin/adapters/{name}[?version=]: unload one version, or all; absent is success."""
        params = {"version": version} if version else None
        await self._call(pod, token, "DELETE", f"/admin/adapters/{name}", params=params)

    async def set_split(self, pod: PodAddress, token: str, name: str, version: str, weight: int) -> dict:
        """PUT /admin/adapters/{name}/split: send ``weight`` percent of ``name``'s requests to ``version``."""
        body = {"version": version, "weight": weight}
        return (await self._call(pod, token, "PUT", f"/admin/adapters/{name}/split", json=body)).json()

    async def split(self, pod: PodAddress, token: str, name: str) -> dict | None:
        """GET /admin/adapters/{name}/split: the split and each version's window; None when there is none."""
        try:
            return (await self._call(pod, token, "GET", f"/admin/adapters/{name}/split")).json()
        except AdminError as exc:
            if exc.reason == "NotFound":
                return None
            raise

    async def drop_split(self, pod: PodAddress, token: str, name: str) -> None:
        """DELETE /admin/adapters/{name}/split: every request to the serving version; absent is success."""
        await self._call(pod, token, "DELETE", f"/admin/adapters/{name}/split")


def _error(pod: str, method: str, path: str, response: Answer) -> AdminError:
    try:
        body = response.json()
    except ValueError:
        body = {}
    reason = body.get("reason") if isinstance(body, dict) else None
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(reason, str) or not reason.isalnum():
        reason = C.POD_UNREACHABLE if response.status_code in (502, 503, 504) else C.POD_FAILED
    return AdminError(
        reason, f"{method} {path} -> HTTP {response.status_code}: {message or response.reason_phrase}", pod
    )
