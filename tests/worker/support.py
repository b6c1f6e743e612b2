"""Test support for the worker tests: raw HTTP (no client-side path normalisation)."""

from __future__ import annotations

import asyncio
import socket
from urllib.parse import urlsplit


async def raw_get(base_url: str, raw_path: str) -> tuple[int, bytes]:
    """Send `GET raw_path` byte for byte; returns the status and body."""
    parts = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(
            f"GET {raw_path} HTTP/1.1\r\nHost: {parts.netloc}\r\nConnection: close\r\n\r\n".encode()
        )
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    return status, body


async def raw_request(base_url: str, head: bytes, body: bytes = b"") -> tuple[int, bytes, bytes]:
    """Send a request whose head (request line and headers, no blank line) is given byte for
    byte; returns the status, the response head and the body."""
    parts = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        extra = f"\r\nHost: {parts.netloc}\r\nContent-Length: {len(body)}\r\nConnection: close"
        writer.write(head + extra.encode() + b"\r\n\r\n" + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    response_head, _, response_body = data.partition(b"\r\n\r\n")
    return int(response_head.split(b" ", 2)[1]), response_head, response_body


async def never_reading(port: int, path: str) -> socket.socket:
    """A connection that asks for `path` and never reads a byte of the answer (a small
    receive buffer, so the server's side fills soon)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    sock.send(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    return sock
