"""JSON over HTTP to an SGLang server, for the engine clients (``client.SGLangClient``,
``plain_client.PlainClient``)."""

from __future__ import annotations

import json


class JsonPoster:
    """POSTs JSON to ``base_url`` and returns the decoded answer; a non-200 answer raises with the
    server's reason. A connection per request: a pooled one goes stale while the trainer holds the
    event loop longer than the server's keep-alive, and a request sent on it is lost."""

    def __init__(self, base_url: str, *, timeout_s: float = 600.0):
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self._http = None

    async def post(self, route: str, payload: dict):
        return await self._request("post", route, json=payload)

    async def get(self, route: str):
        return await self._request("get", route)

    async def _request(self, method: str, route: str, **kwargs):
        import aiohttp

        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                               connector=aiohttp.TCPConnector(force_close=True, limit=0))
        async with self._http.request(method, self.base_url + route, **kwargs) as resp:
            text = await resp.text()
            body = json.loads(text) if text else None
            if resp.status != 200:
                raise RuntimeError(f"SGLang {route} failed ({resp.status}): {body}")
            return body

    async def aclose(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
