"""A loopback TCP proxy in front of a real ``idem serve`` that loses answers or answers 503 on
command: the network faults the library must ride out, made on a real connection."""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field


def read_message(sock: socket.socket, buf: bytearray) -> bytes | None:
    """One HTTP/1.1 message (headers and a Content-Length body) from ``sock``; None at EOF."""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf.extend(chunk)
    head_end = buf.index(b"\r\n\r\n") + 4
    length = 0
    for line in bytes(buf[:head_end]).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(buf) < head_end + length:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        buf.extend(chunk)
    message = bytes(buf[: head_end + length])
    del buf[: head_end + length]
    return message


@dataclass
class Rule:
    """What to do with requests whose first line starts with ``prefix`` (``POST /v1/operations``):
    ``drop`` answers lost after the server processed the request, ``unavailable`` 503s answered
    by the proxy without forwarding, ``internal`` a 500 in place of the server's answer; each
    for the next ``times`` matching requests."""

    prefix: bytes
    action: str
    times: int
    retry_after: int = 1
    hits: int = 0


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    rules: list[Rule] = field(default_factory=list)
    seen: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def rule(self, prefix: str, action: str, times: int = 1, retry_after: int = 1) -> Rule:
        r = Rule(prefix.encode(), action, times, retry_after)
        with self._lock:
            self.rules.append(r)
        return r

    def _match(self, request: bytes) -> Rule | None:
        with self._lock:
            self.seen.append(request.split(b"\r\n", 1)[0])
            for r in self.rules:
                if request.startswith(r.prefix) and r.hits < r.times:
                    r.hits += 1
                    return r
        return None

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream)
        cbuf, ubuf = bytearray(), bytearray()
        try:
            while (request := read_message(client, cbuf)) is not None:
                rule = self._match(request)
                if rule is not None and rule.action == "unavailable":
                    body = (
                        b'{"type":"/problems/unavailable","title":"The store is unavailable","status":503,'
                        b'"detail":"the database did not answer"}'
                    )
                    client.sendall(
                        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/problem+json\r\n"
                        + f"retry-after: {rule.retry_after}\r\nx-request-id: proxy-{rule.hits}\r\n".encode()
                        + f"content-length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                    continue
                upstream.sendall(request)
                answer = read_message(upstream, ubuf)
                if answer is None:
                    return
                if rule is not None and rule.action == "drop":
                    return  # the server acted; its answer never reaches the client
                if rule is not None and rule.action == "internal":
                    # A gateway's 500 in place of the server's answer (the server acted).
                    body = b'{"type":"/problems/internal","title":"Internal error","status":500}'
                    answer = (
                        b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/problem+json\r\n"
                        + f"content-length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                client.sendall(answer)
        except OSError:
            return
        finally:
            client.close()
            upstream.close()

    def close(self) -> None:
        self._listener.close()


def proxy_for(url: str) -> FaultProxy:
    host, _, port = url.removeprefix("http://").partition(":")
    return FaultProxy((host, int(port)))
