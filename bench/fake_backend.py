"""A deliberately minimal, very fast api_server stand-in for the overhead benchmark.

It is an asyncio protocol on uvloop that answers every POST with a fixed chat completion (or a
fixed SSE stream when the body asks for ``"stream": true``), and GET /health and /v1/models like
lmdeploy. Being much faster than any real backend, it makes the gateway's own cost visible.

    python bench/fake_backend.py --port 9001 [--model bench-model] [--chunks 16] [--workers N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal

import orjson

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None  # type: ignore[assignment]


def responses(model: str, chunks: int) -> dict[str, bytes]:
    completion = orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello from the bench"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 8, "completion_tokens": 4, "total_tokens": 12},
        }
    )
    events = b""
    for i in range(chunks):
        chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": model,
                 "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}]}
        events += b"data: " + orjson.dumps(chunk) + b"\n\n"
    events += b'data: {"id":"c","object":"chat.completion.chunk","created":0,"model":"' + model.encode() + b'","choices":[],"usage":{"prompt_tokens":8,"completion_tokens":' + str(chunks).encode() + b',"total_tokens":0}}\n\n'
    events += b"data: [DONE]\n\n"

    def http(status: str, ctype: bytes, body: bytes) -> bytes:
        return (f"HTTP/1.1 {status}\r\n".encode() + b"content-type: " + ctype + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)

    stream_head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    stream = stream_head + hex(len(events))[2:].encode() + b"\r\n" + events + b"\r\n0\r\n\r\n"
    return {
        "chat": http("200 OK", b"application/json", completion),
        "stream": stream,
        "health": http("200 OK", b"application/json", b'{"status":"healthy","message":""}'),
        "models": http("200 OK", b"application/json", orjson.dumps({"object": "list", "data": [{"id": model, "object": "model"}]})),
        "404": http("404 Not Found", b"application/json", b'{"error":"not found"}'),
    }


class FakeBackend(asyncio.Protocol):
    def __init__(self, canned: dict[str, bytes]):
        self.canned = canned
        self.buf = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            line = head.split(b"\r\n", 1)[0]
            if line.startswith(b"POST"):
                key = "stream" if b'"stream":true' in body.replace(b" ", b"") else "chat"
            elif b" /health" in line:
                key = "health"
            elif b" /v1/models" in line:
                key = "models"
            else:
                key = "404"
            self.transport.write(self.canned[key])  # type: ignore[attr-defined]


async def serve(port: int, model: str, chunks: int, reuse_port: bool = False) -> None:
    canned = responses(model, chunks)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: FakeBackend(canned), "127.0.0.1", port, backlog=4096, reuse_port=reuse_port)
    print(f"fake backend ready on http://127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--model", default="bench-model")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--workers", type=int, default=1,
                    help="processes sharing the port (SO_REUSEPORT), so that on a many-core machine the backend is not the limit")
    args = ap.parse_args()
    if not 1 <= args.workers <= 64:
        ap.error("--workers must be 1-64")
    if uvloop is not None:
        uvloop.install()
    children: list[int] = []  # the first process's forks (the bench stops the whole process group anyway)
    for _ in range(args.workers - 1):
        pid = os.fork()
        if pid == 0:
            children = []  # a child serves and forks nothing
            break
        children.append(pid)
    try:
        asyncio.run(serve(args.port, args.model, args.chunks, reuse_port=args.workers > 1))
    except KeyboardInterrupt:
        pass
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)


if __name__ == "__main__":
    main()
