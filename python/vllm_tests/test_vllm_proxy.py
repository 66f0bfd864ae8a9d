"""``python -m pdxfer.vllm.proxy`` between stand-in prefill and decode servers
(aiohttp apps that record what they get): the prefill gets the request with
``max_tokens`` 1, no stream and ``do_remote_decode``; the decode gets the
original request with the prefill's ``kv_transfer_params`` verbatim; the
client gets the decode's answer, streamed as it streams; a prefill error or a
prefill without ``kv_transfer_params`` is the client's error and the decode is
not called. (scripts/vllm-serve-check.sh runs it between real servers.)"""

from __future__ import annotations

import asyncio
import json
import socket

from aiohttp import ClientSession, web

from pdxfer.vllm import proxy

PARAMS = {"do_remote_prefill": True, "pdxfer_room_key": "cmpl-1-0-ab", "remote_bootstrap_addr": "http://h:1",
          "remote_num_tokens": 5, "nested": {"a": [1, 2]}}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    port = _port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def _fake(seen: list, reply) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append((request.path, body, request.headers.get("X-Request-Id")))
        return await reply(request, body)

    async def health(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    app.router.add_post("/v1/chat/completions", handle)
    app.router.add_get("/health", health)
    return app


async def _prefill_ok(request, body):
    return web.json_response({"choices": [{"token_ids": [9]}], "kv_transfer_params": PARAMS})


async def _decode_stream(request, body):
    if not body.get("stream"):
        return web.json_response({"choices": [{"token_ids": [9, 8, 7]}], "got": body["kv_transfer_params"]})
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for t in (9, 8, 7):
        await out.write(f"data: {json.dumps({'t': t})}\n\n".encode())
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


def _run(coro):
    return asyncio.new_event_loop().run_until_complete(coro)


async def _with_proxy(prefill_reply, decode_reply, client):
    p_seen, d_seen = [], []
    pr, p_url = await _serve(_fake(p_seen, prefill_reply))
    dr, d_url = await _serve(_fake(d_seen, decode_reply))
    xr, x_url = await _serve(proxy.app([p_url], [d_url]))
    try:
        async with ClientSession() as s:
            return await client(s, x_url), p_seen, d_seen
    finally:
        for r in (xr, dr, pr):
            await r.cleanup()


def test_sequential_flow_forwards_params_verbatim():
    req = {"model": "m", "prompt": [1, 2, 3, 4, 5], "max_tokens": 16, "temperature": 0}

    async def client(s, url):
        async with s.get(url + "/health") as r:
            assert r.status == 200
        async with s.post(url + "/v1/completions", json=req, headers={"X-Request-Id": "rid-7"}) as r:
            return r.status, await r.json()

    (status, got), p_seen, d_seen = _run(_with_proxy(_prefill_ok, _decode_stream, client))
    assert status == 200
    assert got == {"choices": [{"token_ids": [9, 8, 7]}], "got": PARAMS}
    [(path, pbody, prid)] = p_seen
    assert path == "/v1/completions" and prid == "rid-7"
    assert pbody == {**req, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
    [(path, dbody, drid)] = d_seen
    assert path == "/v1/completions" and drid == "rid-7"
    assert dbody == {**req, "kv_transfer_params": PARAMS}


def test_streamed_decode_and_chat_route():
    req = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 4,
           "stream": True, "stream_options": {"include_usage": True}}

    async def client(s, url):
        async with s.post(url + "/v1/chat/completions", json=req) as r:
            return r.status, (await r.read()).decode()

    (status, text), p_seen, d_seen = _run(_with_proxy(_prefill_ok, _decode_stream, client))
    assert status == 200
    assert [json.loads(line[6:])["t"] for line in text.split("\n\n") if line.startswith("data: {")] == [9, 8, 7]
    assert text.rstrip().endswith("data: [DONE]")
    pbody = p_seen[0][1]
    assert pbody["max_tokens"] == 1 and pbody["max_completion_tokens"] == 1 and pbody["stream"] is False
    assert "stream_options" not in pbody
    assert d_seen[0][1] == {**req, "kv_transfer_params": PARAMS}


def test_prefill_failures_do_not_reach_the_decode():
    async def prefill_400(request, body):
        return web.json_response({"error": "bad prompt"}, status=400)

    async def prefill_no_params(request, body):
        return web.json_response({"choices": [{"token_ids": [9]}], "kv_transfer_params": None})

    async def client(s, url):
        async with s.post(url + "/v1/completions", json={"model": "m", "prompt": [1]}) as r:
            return r.status, await r.json()

    (status, got), _, d_seen = _run(_with_proxy(prefill_400, _decode_stream, client))
    assert (status, got, d_seen) == (400, {"error": "bad prompt"}, [])
    (status, got), _, d_seen = _run(_with_proxy(prefill_no_params, _decode_stream, client))
    assert status == 502 and "kv_transfer_params" in got["error"] and d_seen == []
