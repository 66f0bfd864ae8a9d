"""A PD proxy for a prefill and a decode ``vllm serve`` (vLLM's toy proxy
protocol, the sequential flow):

1. the request goes to the prefill with ``max_tokens`` 1, no streaming, and
   ``"kv_transfer_params": {"do_remote_decode": true}``;
2. the same request goes to the decode with the ``kv_transfer_params`` the
   prefill returned, unchanged; the decode's answer (streamed or not) is the
   client's.

Run it as ``python -m pdxfer.vllm.proxy --prefill http://P:8100 --decode
http://D:8200 --port 8000``; several ``--prefill``/``--decode`` URLs are used
round-robin. It serves ``/v1/completions`` and ``/v1/chat/completions`` and a
``/health`` that answers once every server does. Built on aiohttp (vLLM's
own dependency): no HTTP is hand-written here.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import uuid
from typing import Any, Dict, List

from aiohttp import ClientSession, ClientTimeout, web

logger = logging.getLogger("pdxfer.vllm.proxy")

ROUTES = ("/v1/completions", "/v1/chat/completions")


def prefill_body(body: Dict[str, Any]) -> Dict[str, Any]:
    """The request as the prefill gets it: one token, no stream, remote decode."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def decode_body(body: Dict[str, Any], kv_transfer_params: Dict[str, Any]) -> Dict[str, Any]:
    """The request as the decode gets it: the prefill's kv_transfer_params verbatim."""
    out = dict(body)
    out["kv_transfer_params"] = kv_transfer_params
    return out


class Proxy:
    def __init__(self, prefill: List[str], decode: List[str], timeout_s: float = 600.0):
        self.prefill = [u.rstrip("/") for u in prefill]
        self.decode = [u.rstrip("/") for u in decode]
        self._p = itertools.cycle(self.prefill)
        self._d = itertools.cycle(self.decode)
        self.timeout = ClientTimeout(total=timeout_s)
        self.session: ClientSession | None = None

    async def start(self, app: web.Application) -> None:
        self.session = ClientSession(timeout=self.timeout)

    async def stop(self, app: web.Application) -> None:
        if self.session is not None:
            await self.session.close()

    async def health(self, request: web.Request) -> web.Response:
        assert self.session is not None
        for url in self.prefill + self.decode:
            try:
                async with self.session.get(url + "/health") as r:
                    if r.status != 200:
                        return web.json_response({"unhealthy": url, "status": r.status}, status=503)
            except OSError as e:
                return web.json_response({"unhealthy": url, "error": str(e)}, status=503)
        return web.json_response({"ok": True})

    async def forward(self, request: web.Request) -> web.StreamResponse:
        assert self.session is not None
        try:
            body = await request.json()
        except json.JSONDecodeError as e:
            return web.json_response({"error": f"the request body is not JSON: {e}"}, status=400)
        path = request.path
        rid = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        headers = {"X-Request-Id": rid}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        p_url = next(self._p) + path
        async with self.session.post(p_url, json=prefill_body(body), headers=headers) as r:
            text = await r.text()
            if r.status != 200:
                logger.error("prefill %s answered %d: %s", p_url, r.status, text[:500])
                return web.Response(status=r.status, text=text, content_type="application/json")
            params = json.loads(text).get("kv_transfer_params")
        if not params:
            msg = (f"prefill {p_url} returned no kv_transfer_params: is it started with "
                   "--kv-transfer-config and kv_role kv_producer?")
            logger.error(msg)
            return web.json_response({"error": msg}, status=502)
        d_url = next(self._d) + path
        async with self.session.post(d_url, json=decode_body(body, params), headers=headers) as r:
            out = web.StreamResponse(status=r.status, headers={"Content-Type": r.headers.get(
                "Content-Type", "application/json")})
            await out.prepare(request)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out


def app(prefill: List[str], decode: List[str]) -> web.Application:
    p = Proxy(prefill, decode)
    a = web.Application(client_max_size=64 << 20)
    a.on_startup.append(p.start)
    a.on_cleanup.append(p.stop)
    a.router.add_get("/health", p.health)
    for route in ROUTES:
        a.router.add_post(route, p.forward)
    return a


def main(argv: List[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pdxfer.vllm.proxy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", action="append", required=True, help="a prefill server's URL (repeatable)")
    ap.add_argument("--decode", action="append", required=True, help="a decode server's URL (repeatable)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    web.run_app(app(a.prefill, a.decode), host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
