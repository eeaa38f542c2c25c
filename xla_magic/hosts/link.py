"""The kernel's own link to each host's engine, for what a running cell asks (a rank's input(), pdb). Runs in the
kernel and in each host's engine (standard library only, XLA-free).

ipyparallel runs one call at a time on an engine and has no way from the
kernel into a call that runs; a rank's question needs one. The kernel
listens on its address toward the hosts (never every interface; a port
the system picks) until every host is linked, then closes the listener: a
link lives as long as the engine and the cluster, and a pool that starts
anew makes new ones. Each engine connects once and proves it holds the
pool's fresh token (challenge-response: the kernel sends a nonce, the
engine answers HMAC-SHA256(token, nonce + host index)), and the kernel
proves it holds it too. The token itself never travels: each end derives it
from a random salt (which does) and a secret both already hold, the
cluster's key (which came to each engine on its stdin, through the launch
command), since ipyparallel's own messages are signed but not encrypted. Every later frame carries a counter and an HMAC
under a key of that link alone, so that nothing else on the network can
inject, alter or replay one. A link that breaks or says anything it should
not is lost, and its host with it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import select
import socket
import struct
import time
from typing import Any, Callable

ASK = "ask"  # engine -> kernel: a rank's question (rank, prompt, password, what, who, why, line) and its id
ANSWER = "answer"  # kernel -> engine: the reply to the question of that id ({"text": ...} or {"eof": why})
GREET_TIMEOUT = 10.0  # for one connection's challenge-response
MAX_FRAME = 1 << 20
NONCE = 32
MAC = 32
_HEAD = struct.Struct("!Q")  # a frame's counter
_SIZE = struct.Struct("!I")
_INDEX = struct.Struct("!I")
_ENGINE, _KERNEL = b"e", b"k"  # who sends a frame: part of what its HMAC covers, so none can be reflected


class LinkError(Exception):
    """The link is lost, or the other end is not who it should be."""


def _mac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def token(secret: bytes, salt: bytes) -> bytes:
    """The pool's token: from ``secret`` (the cluster's key) and this pool's ``salt``."""
    if not secret:
        raise LinkError("no secret to make the link's token from (the cluster has no key)")
    return _mac(secret, b"xla_magic link " + salt)


def _proofs(token: bytes, nonce: bytes, index: int) -> tuple[bytes, bytes, bytes]:
    """The engine's answer to the challenge, the kernel's, and the link's own key."""
    said = nonce + _INDEX.pack(index)
    return _mac(token, said), _mac(token, b"kernel" + said), _mac(token, b"link" + said)


class Link:
    """One end of a link: frames of JSON, each with its counter and HMAC; ``side`` is the end this one is."""

    def __init__(self, sock: socket.socket, key: bytes, side: bytes, index: int) -> None:
        self.sock = sock
        self.key = key
        self.side, self.peer = side, _KERNEL if side == _ENGINE else _ENGINE
        self.index = index  # the host's
        self.sent = 0
        self.received = 0
        self._buffer = b""

    def send(self, kind: str, **fields: Any) -> None:
        self.sent += 1
        head = _HEAD.pack(self.sent)
        body = json.dumps({"kind": kind, **fields}).encode()
        frame = head + _mac(self.key, self.side + head + body) + body
        try:
            self.sock.sendall(_SIZE.pack(len(frame)) + frame)
        except OSError as exc:
            raise LinkError(f"the link could not send ({exc})") from None

    def receive(self, timeout: float) -> dict[str, Any] | None:
        """The next frame, within ``timeout`` seconds (0: only one already here); None if none came."""
        deadline = time.monotonic() + timeout
        while True:
            frame = self._frame()
            if frame is not None:
                return frame
            left = deadline - time.monotonic()
            try:
                ready, _, _ = select.select([self.sock], [], [], max(0.0, left))
                if not ready:
                    return None
                chunk = self.sock.recv(65536)
            except (OSError, ValueError) as exc:
                raise LinkError(f"the link broke ({exc})") from None
            if not chunk:
                raise LinkError("the link was closed at the other end")
            self._buffer += chunk

    def _frame(self) -> dict[str, Any] | None:
        buffer = self._buffer
        if len(buffer) < _SIZE.size:
            return None
        (size,) = _SIZE.unpack_from(buffer)
        if not _HEAD.size + MAC <= size <= MAX_FRAME:
            raise LinkError(f"a frame of {size} bytes, which no end of a link sends")
        if len(buffer) < _SIZE.size + size:
            return None
        frame, self._buffer = buffer[_SIZE.size:_SIZE.size + size], buffer[_SIZE.size + size:]
        head, mac, body = frame[:_HEAD.size], frame[_HEAD.size:_HEAD.size + MAC], frame[_HEAD.size + MAC:]
        if not hmac.compare_digest(mac, _mac(self.key, self.peer + head + body)):
            raise LinkError("a frame without the link's HMAC (not from the other end)")
        (counter,) = _HEAD.unpack(head)
        if counter != self.received + 1:
            raise LinkError(f"frame {counter} where {self.received + 1} was due (replayed or lost)")
        self.received = counter
        try:
            return json.loads(body)
        except ValueError as exc:
            raise LinkError(f"a frame that is not JSON ({exc})") from None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _read_exactly(sock: socket.socket, count: int, deadline: float) -> bytes:
    data = b""
    while len(data) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise LinkError("the other end did not finish the challenge in time")
        sock.settimeout(left)
        try:
            chunk = sock.recv(count - len(data))
        except OSError as exc:
            raise LinkError(f"the challenge broke off ({exc})") from None
        if not chunk:
            raise LinkError("the other end closed the connection during the challenge")
        data += chunk
    return data


class Listener:
    """The kernel's end while the hosts link: a TCP listener on ``address``, port 0, and the pool's token, made
    from ``secret`` (the cluster's key) and a fresh salt."""

    def __init__(self, address: str, secret: bytes) -> None:
        if address in ("", "0.0.0.0", "::"):
            raise ValueError("the link listens on the kernel's address toward the hosts, not on every interface")
        self.salt = secrets.token_bytes(32)
        self.token = token(secret, self.salt)
        self.sock = socket.create_server((address, 0))
        self.address, self.port = self.sock.getsockname()[:2]
        self.refused: list[str] = []  # connections that did not prove the token: who, and why

    def ticket(self) -> dict[str, Any]:
        """What an engine needs to link, but the secret it holds already: where, and the salt."""
        return {"address": self.address, "port": self.port, "salt": self.salt.hex()}

    def accept(self, hosts: int, timeout: float, problem: Callable[[], str | None] = lambda: None) -> dict[int, Link]:
        """A link from each of ``hosts`` engines, by host index; LinkError when they are not all there in time or
        ``problem`` says why they cannot be. A connection that does not prove the token is refused, and waited past."""
        links: dict[int, Link] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(links) < hosts:
                trouble = problem()
                if trouble:
                    raise LinkError(trouble)
                if time.monotonic() > deadline:
                    missing = ", ".join(f"h{index}" for index in range(hosts) if index not in links)
                    refused = f" (refused: {'; '.join(self.refused)})" if self.refused else ""
                    raise LinkError(f"host(s) {missing} did not link to the kernel within {timeout:g} s{refused}")
                ready, _, _ = select.select([self.sock], [], [], 0.1)
                if not ready:
                    continue
                conn, peer = self.sock.accept()
                try:
                    link = self._greet(conn, hosts, links)
                except (LinkError, OSError) as exc:
                    conn.close()
                    self.refused.append(f"{peer[0]}:{peer[1]}: {exc}")
                    continue
                links[link.index] = link
        except BaseException:
            for link in links.values():
                link.close()
            raise
        return links

    def _greet(self, conn: socket.socket, hosts: int, links: dict[int, Link]) -> Link:
        deadline = time.monotonic() + GREET_TIMEOUT
        (index,) = _INDEX.unpack(_read_exactly(conn, _INDEX.size, deadline))
        if index >= hosts or index in links:
            raise LinkError(f"host index {index} is not one still to link")
        nonce = secrets.token_bytes(NONCE)
        conn.sendall(nonce)
        engine_proof, kernel_proof, key = _proofs(self.token, nonce, index)
        if not hmac.compare_digest(_read_exactly(conn, MAC, deadline), engine_proof):
            raise LinkError("it does not hold the pool's token")
        conn.sendall(kernel_proof)
        conn.settimeout(None)
        return Link(conn, key, _KERNEL, index)

    def close(self) -> None:
        self.sock.close()


def connect(ticket: dict[str, Any], index: int, secret: bytes, timeout: float = GREET_TIMEOUT) -> Link:
    """The engine's end: connect to the kernel the ``ticket`` names, as host ``index``, and prove the token
    made from ``secret`` (the cluster's key)."""
    made = token(secret, bytes.fromhex(ticket["salt"]))
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((ticket["address"], ticket["port"]), timeout=timeout)
    except OSError as exc:
        raise LinkError(f"could not reach the kernel at {ticket['address']}:{ticket['port']} ({exc})") from None
    try:
        sock.sendall(_INDEX.pack(index))
        nonce = _read_exactly(sock, NONCE, deadline)
        engine_proof, kernel_proof, key = _proofs(made, nonce, index)
        sock.sendall(engine_proof)
        if not hmac.compare_digest(_read_exactly(sock, MAC, deadline), kernel_proof):
            raise LinkError("the other end does not hold the pool's token: it is not this pool's kernel")
    except OSError as exc:
        sock.close()
        raise LinkError(f"the challenge broke off ({exc})") from None
    except BaseException:
        sock.close()
        raise
    sock.settimeout(None)
    return Link(sock, key, _ENGINE, index)
