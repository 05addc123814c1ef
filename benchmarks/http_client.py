"""A lean HTTP/1.1 client for the load generator (`bench serve`): POST a JSON body, read the response
line by line (Server-Sent Events), keep-alive connections reused across requests.

    async with StreamClient(base_url, max_connections=32) as client:
        async with client.post("/v1/completions", body_bytes, headers) as r:
            if r.status != 200: err = await r.read()
            async for line in r.lines(): ...

Why not httpx: with 32 streams in one event loop, httpx's per-chunk work (its byte, text and line
iterators, h11's state machine) and the loop iterations its sends take (every write awaits a
checkpoint) made a request's send wait ~10 ms behind the other streams' chunks, and every token reach
the client late: the client's own overhead ended up in the server's TTFT (issue #16). Here a request
is one `write` of head + body, and a buffered chunk is read without leaving the task. Supports what
OpenAI-compatible servers send: `Transfer-Encoding: chunked`, `Content-Length`, or a body ended by
closing the connection; http and https.
"""
from __future__ import annotations

import asyncio
import ssl
from urllib.parse import urlsplit


class HTTPError(Exception):
    """The connection failed or the server broke the HTTP protocol."""


class Response:
    def __init__(self, client: "StreamClient", reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._client, self._reader, self._writer = client, reader, writer
        self.status = 0
        self.headers: dict[str, str] = {}
        self._chunked = False
        self._left: int | None = None  # Content-Length bytes still to read; None: chunked or until close
        self._done = False
        self._reusable = True

    async def _start(self) -> None:
        head = await self._reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1."):
            raise HTTPError(f"not an HTTP/1.x response: {lines[0]!r}")
        self.status = int(parts[1])
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                self.headers[k.strip().lower()] = v.strip()
        self._chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        if not self._chunked and "content-length" in self.headers:
            self._left = int(self.headers["content-length"])
        if self.headers.get("connection", "").lower() == "close" or (not self._chunked and self._left is None):
            self._reusable = False
        if self._left == 0:
            self._done = True

    async def chunks(self):
        """The body as it arrives (bytes)."""
        r = self._reader
        while not self._done:
            if self._chunked:
                size = int((await r.readuntil(b"\r\n")).split(b";", 1)[0], 16)
                if size == 0:
                    while (await r.readuntil(b"\r\n")) != b"\r\n":  # trailers, then the blank line
                        pass
                    self._done = True
                    return
                data = (await r.readexactly(size + 2))[:-2]
            elif self._left is not None:
                data = await r.read(min(self._left, 1 << 16))
                if not data:
                    raise HTTPError("the connection closed before the end of the body")
                self._left -= len(data)
                self._done = self._left == 0
            else:
                data = await r.read(1 << 16)
                if not data:
                    self._done = True
                    return
            yield data

    async def lines(self):
        """The body's lines (str, without the line break), e.g. SSE `data: ...` lines and blank separators."""
        buf = b""
        async for data in self.chunks():
            buf += data
            if b"\n" not in data:
                continue
            *full, buf = buf.split(b"\n")
            for line in full:
                yield line.rstrip(b"\r").decode("utf-8")
        if buf:
            yield buf.rstrip(b"\r").decode("utf-8")

    async def read(self) -> bytes:
        return b"".join([c async for c in self.chunks()])

    def _release(self) -> None:
        if self._done and self._reusable:
            self._client._idle.append((self._reader, self._writer))
        else:
            self._writer.close()
        self._client._slots.release()


class _Request:
    def __init__(self, client: "StreamClient", path: str, body: bytes, headers: dict[str, str] | None):
        self.client, self.path, self.body, self.headers = client, path, body, headers or {}
        self.response: Response | None = None

    async def __aenter__(self) -> Response:
        c = self.client
        await c._slots.acquire()
        try:
            self.response = await c._send(self.path, self.body, self.headers)
        except BaseException:
            c._slots.release()
            raise
        return self.response

    async def __aexit__(self, *exc) -> None:
        self.response._release()


class StreamClient:
    def __init__(self, base_url: str, max_connections: int = 100):
        u = urlsplit(base_url)
        if u.scheme not in ("http", "https") or not u.hostname:
            raise ValueError(f"base URL must be http(s)://host[:port][/prefix], got {base_url!r}")
        self.host, self.tls = u.hostname, u.scheme == "https"
        self.port = u.port or (443 if self.tls else 80)
        self.prefix = u.path.rstrip("/")
        self.authority = u.netloc.rsplit("@", 1)[-1]
        self._idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._slots = asyncio.Semaphore(max_connections)

    async def __aenter__(self) -> "StreamClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop()[1].close()

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> _Request:
        """`async with client.post(path, body) as response:` a JSON POST; the response's head is read."""
        return _Request(self, path, body, headers)

    async def _send(self, path: str, body: bytes, headers: dict[str, str]) -> Response:
        head = (f"POST {self.prefix}{path} HTTP/1.1\r\nHost: {self.authority}\r\nContent-Type: application/json\r\n"
                f"Accept: text/event-stream, application/json\r\nContent-Length: {len(body)}\r\n"
                + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n").encode("latin-1")
        while self._idle:  # a kept-alive connection; the server may have closed it meanwhile: then a new one
            reader, writer = self._idle.pop()
            if reader.at_eof() or writer.is_closing():
                writer.close()
                continue
            try:
                return await self._exchange(reader, writer, head + body)
            except (ConnectionError, asyncio.IncompleteReadError):
                writer.close()
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port,
                                                           ssl=ssl.create_default_context() if self.tls else None)
        except OSError as e:
            raise HTTPError(f"cannot connect to {self.host}:{self.port}: {e}") from None
        return await self._exchange(reader, writer, head + body)

    async def _exchange(self, reader, writer, data: bytes) -> Response:
        writer.write(data)
        await writer.drain()
        r = Response(self, reader, writer)
        try:
            await r._start()
        except BaseException:
            writer.close()
            raise
        return r
