"""The load generator's HTTP/1.1 client (benchmarks/http_client.py) against a raw server that answers
with known bytes: chunked, Content-Length and close-delimited bodies, keep-alive reuse, a kept-alive
connection the server closed meanwhile, a non-200 answer."""
import asyncio

import pytest

from linrnn_bench.http_client import StreamClient

SSE = b"data: {\"a\": 1}\n\ndata: [DONE]\n\n"


def chunked(*parts: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def serve(answers, close_after: set[int] = frozenset()):
    """A server answering the i-th request (over any connection) with answers[i]; records requests and
    connections. Connections whose request index is in `close_after` are closed after the answer."""
    seen: list[tuple[int, bytes]] = []
    conns = [0]

    async def handle(reader, writer):
        conns[0] += 1
        conn = conns[0]
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                             if line.lower().startswith(b"content-length")))
                body = await reader.readexactly(n)
                i = len(seen)
                seen.append((conn, head.split(b"\r\n")[0] + b" " + body))
                writer.write(answers[i])
                await writer.drain()
                if i in close_after:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/base", seen


def test_bodies_and_keep_alive():
    answers = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(SSE[:9], SSE[9:20], SSE[20:]),
        b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(SSE) + SSE,
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found",
        b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n" + SSE,
        b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n",
    ]

    async def go():
        server, url, seen = await serve(answers, close_after={3})
        out = []
        async with server, StreamClient(url) as c:
            for i in range(5):
                async with c.post("/v1/x", b'{"i": %d}' % i, {"Authorization": "Bearer k"}) as r:
                    out.append((r.status, [line async for line in r.lines()] if r.status == 200 else await r.read()))
        return out, seen

    out, seen = asyncio.run(go())
    lines = ['data: {"a": 1}', "", "data: [DONE]", ""]
    assert out == [(200, lines), (200, lines), (404, b"not found"), (200, lines), (200, [])]
    assert [s for _, s in seen] == [b'POST /base/v1/x HTTP/1.1 {"i": %d}' % i for i in range(5)]
    # one connection for the first four (kept alive); the server closed it after the fourth: a new one
    assert [conn for conn, _ in seen] == [1, 1, 1, 1, 2]


def test_idle_connection_closed_by_server_is_replaced():
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    async def go():
        server, url, seen = await serve([ok, ok], close_after={0})  # closes without saying so
        async with server, StreamClient(url) as c:
            bodies = []
            for _ in range(2):
                async with c.post("/v", b"{}") as r:
                    bodies.append(await r.read())
                await asyncio.sleep(0.05)  # the close reaches the client while the connection is idle
        return bodies, seen

    bodies, seen = asyncio.run(go())
    assert bodies == [b"ok", b"ok"] and [conn for conn, _ in seen] == [1, 2]


def test_refused_connection_raises():
    async def go():
        async with StreamClient("http://127.0.0.1:9") as c:
            async with c.post("/v", b"{}"):
                pass

    with pytest.raises(Exception, match="cannot connect"):
        asyncio.run(go())


def test_bad_url():
    with pytest.raises(ValueError):
        StreamClient("ftp://x")
