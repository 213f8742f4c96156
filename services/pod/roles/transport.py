"""How the pod's roles talk when they run apart: JSON over a Unix socket, tensors in shared memory.

The roles may be child processes of the pod (``--mode processes``) or the containers of one
Kubernetes Pod (``--role worker|learner|evaluator``). Containers are not parent and child, so
nothing here relies on inheritance: everything goes through one directory both sides can see
(a memory-backed emptyDir mounted at /dev/shm on Kubernetes):

- ``learner.sock``: the learner listens; the worker and the evaluator connect and introduce
  themselves with the ``token`` the learner wrote beside it (a new one per learner start, so a role
  never talks to a stale learner). Messages are length-prefixed JSON objects: control only, never
  pickle, never bulk data.
- ``*.shm`` files: named tensors mapped by both sides (``SharedTensors``), allocated once per
  build and written in place — the policy weights (learner → role) and a rollout
  (worker → learner). A message says which file and, when it is new, its layout.

CUDA tensors go through these host files too (one device-to-host and one host-to-device copy):
a container does not share a CUDA context with another, and CUDA IPC handles would need
torch.multiprocessing's pickling.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import secrets
import select
import socket
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

PROTOCOL = 1
SOCKET = "learner.sock"
TOKEN = "token"
#: Written by a learner that needs no (more) roles, e.g. an off-policy agent that trains fused:
#: the worker and evaluator containers waiting for it exit 0 instead of timing out.
RETIRED = "retired"
MAX_MESSAGE = 16 * 2**20  # a config or an evaluation result is a few KiB
POLL_S = 0.2
ALIGN = 64  # every tensor starts on a cache line (and so on its dtype's alignment)

#: The dtypes a layout may name; a layout read from the other side is checked against these.
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.bool,
    )
}


class TransportError(RuntimeError):
    """A malformed message or layout, or a connection that could not be set up."""


class ClosedError(TransportError):
    """The other side went away (its process or container exited)."""


class Channel:
    """One connection: ``send`` and ``receive`` JSON objects (``{"op": ..., ...}``)."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._buffer = bytearray()

    def send(self, message: dict[str, Any]) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        try:
            self.sock.sendall(len(data).to_bytes(4, "big") + data)
        except OSError as exc:  # EPIPE / ECONNRESET: the peer is gone
            raise ClosedError(f"connection lost ({exc})") from exc

    def receive(
        self, timeout: float | None = None, alive: Callable[[], bool] | None = None
    ) -> dict[str, Any]:
        """The next message; ``ClosedError`` when the peer is gone (end of stream, or ``alive()``
        turns false), ``TimeoutError`` after ``timeout`` seconds of silence."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            message = self._parse()
            if message is not None:
                return message
            wait = POLL_S
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    raise TimeoutError(f"no answer within {timeout:g}s")
            if alive is not None and not alive():
                raise ClosedError("the process exited")
            ready, _, _ = select.select([self.sock], [], [], wait)
            if not ready:
                continue
            try:
                chunk = self.sock.recv(1 << 16)
            except OSError as exc:
                raise ClosedError(f"connection lost ({exc})") from exc
            if not chunk:
                raise ClosedError("connection closed")
            self._buffer += chunk

    def _parse(self) -> dict[str, Any] | None:
        if len(self._buffer) < 4:
            return None
        size = int.from_bytes(self._buffer[:4], "big")
        if size > MAX_MESSAGE:
            raise TransportError(f"message of {size} bytes (at most {MAX_MESSAGE})")
        if len(self._buffer) < 4 + size:
            return None
        data = bytes(self._buffer[4 : 4 + size])
        del self._buffer[: 4 + size]
        try:
            message = json.loads(data)
        except ValueError as exc:
            raise TransportError(f"a message is not JSON: {exc}") from exc
        if not isinstance(message, dict) or not isinstance(message.get("op"), str):
            raise TransportError("a message is not a JSON object with an 'op'")
        return message

    def close(self) -> None:
        self.sock.close()


# -- rendezvous --------------------------------------------------------------------------------
def listen(directory: Path) -> tuple[socket.socket, str]:
    """The learner's side: a fresh token, then the socket (a role that read an older token is
    refused and reads it again)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / SOCKET
    if len(os.fsencode(path)) >= 100:  # sun_path holds 108 bytes on Linux, 104 on macOS
        raise TransportError(f"socket path {path} is too long for a Unix socket; use a shorter dir")
    path.unlink(missing_ok=True)  # a previous learner's
    (directory / RETIRED).unlink(missing_ok=True)
    token = secrets.token_urlsafe(32)
    tmp = directory / f".{TOKEN}.{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    tmp.replace(directory / TOKEN)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(8)
    return server, token


def retire(directory: Path) -> None:
    """Tell roles still waiting in ``directory`` that no learner will need them."""
    with contextlib.suppress(FileNotFoundError):
        (directory / RETIRED).write_text("the learner needs no roles\n")


def retired(directory: Path) -> bool:
    return (directory / RETIRED).exists()


def connect(directory: Path) -> tuple[Channel, str] | None:
    """One attempt to reach the learner: the channel and the token to introduce oneself with,
    or None while no learner listens there yet."""
    try:
        token = (directory / TOKEN).read_text()
    except FileNotFoundError:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(str(directory / SOCKET))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return Channel(sock), token


# -- shared tensors ----------------------------------------------------------------------------
Layout = dict[str, dict[str, Any]]


def layout_of(tensors: Mapping[str, torch.Tensor]) -> Layout:
    """Where each tensor goes in a file: dtype, shape and an aligned byte offset."""
    layout: Layout = {}
    offset = 0
    for name, t in tensors.items():
        layout[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
        layout[name]["offset"] = offset
        offset += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return layout


def _checked(layout: Any) -> tuple[dict[str, tuple[torch.dtype, list[int], int, int]], int]:
    """Entries as (dtype, shape, offset, nbytes) and the file size; a bad layout (it may come
    from the other process) is a TransportError, never an exception deep inside torch."""
    if not isinstance(layout, dict):
        raise TransportError("a layout is not a JSON object")
    out, size = {}, 0
    for name, entry in layout.items():
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            offset = int(entry["offset"])
        except (KeyError, TypeError, ValueError) as exc:
            raise TransportError(f"bad layout entry {name!r}: {exc!r}") from exc
        if offset < 0 or offset % ALIGN or any(n < 0 for n in shape):
            raise TransportError(f"bad layout entry {name!r}: {entry}")
        nbytes = math.prod(shape) * dtype.itemsize
        out[name] = (dtype, shape, offset, nbytes)
        size = max(size, offset + nbytes)
    return out, size


class SharedTensors:
    """Named tensors in one file of the shared directory, mapped (not copied) by every process
    that opens it: one side writes in place, the other reads in place."""

    def __init__(self, path: Path, layout: Layout, create: bool = False) -> None:
        entries, size = _checked(layout)
        if path.name != path.name.lstrip(".") or "/" in path.name:
            raise TransportError(f"bad shared file name {path.name!r}")
        if create:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, max(size, 1))
            finally:
                os.close(fd)
        elif not path.is_file() or path.stat().st_size < size:
            raise TransportError(f"shared file {path} is missing or shorter than its layout")
        self.path, self.layout = path, layout
        storage = torch.from_file(str(path), shared=True, size=max(size, 1), dtype=torch.uint8)
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (dtype, shape, offset, nbytes) in entries.items():
            if nbytes == 0:
                self.tensors[name] = torch.empty(shape, dtype=dtype)
            else:
                self.tensors[name] = storage[offset : offset + nbytes].view(dtype).view(shape)

    @classmethod
    def create(cls, path: Path, tensors: Mapping[str, torch.Tensor]) -> SharedTensors:
        shared = cls(path, layout_of(tensors), create=True)
        shared.write(tensors)
        return shared

    def fits(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        return layout_of(tensors) == self.layout

    @torch.no_grad()
    def write(self, tensors: Mapping[str, torch.Tensor]) -> None:
        for name, value in tensors.items():
            self.tensors[name].copy_(value)  # from a GPU: a synchronous device-to-host copy

    def unlink(self) -> None:
        """Remove the file; the mappings stay valid until the last one is dropped."""
        self.path.unlink(missing_ok=True)
