"""The line protocol between a parent process and a child it drives (private).

One JSON object per line, behind :data:`CONTROL_PREFIX`, so that whatever else the child
prints (NIXL and UCX log to stdout) is never taken for a message. Used by
``aionixl.testing``'s remote engines, the bench's target process and the tests' helper
processes: written once here, with no I/O of its own beyond the helpers that take a file.
"""

from __future__ import annotations

import os
from typing import IO, Any

import msgspec

CONTROL_PREFIX = b"\x1eaionixl-ctl "

_encode = msgspec.json.encode
_decode = msgspec.json.decode


def encode_line(fields: dict[str, Any]) -> bytes:
    """One message as a line: the prefix, the JSON object, a newline."""
    return CONTROL_PREFIX + _encode(fields) + b"\n"


def decode_line(line: bytes | str) -> dict[str, Any] | None:
    """The message a line carries, or None for a line that is not one (other output).

    A line that has the prefix but no JSON object after it raises ``ValueError``: the
    child said something, and said it wrong.
    """
    raw = line.encode() if isinstance(line, str) else line
    raw = raw.strip(b"\r\n")
    if not raw.startswith(CONTROL_PREFIX):
        return None
    try:
        value = _decode(raw[len(CONTROL_PREFIX):])
    except msgspec.DecodeError as exc:
        raise ValueError(f"malformed control line {raw[:200]!r}: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"a control line must carry a JSON object, got {raw[:200]!r}")
    return value


def write_fd(fd: int, fields: dict[str, Any]) -> None:
    """Write one message to a file descriptor, all of it."""
    data = encode_line(fields)
    while data:
        data = data[os.write(fd, data):]


def write_file(stream: IO[str], fields: dict[str, Any]) -> None:
    """Write one message to a text stream and flush it."""
    stream.write(encode_line(fields).decode())
    stream.flush()


class LineReader:
    """Messages out of a byte stream that arrives in chunks (a pipe read with ``os.read``).

    ``feed`` each chunk as it comes; ``pop`` returns the next complete message, skipping
    lines that are not messages, or None until another one is complete. Lines are split
    at newlines only (``str.splitlines`` would also split at the prefix's first byte).
    """

    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, chunk: bytes) -> None:
        self._buffer += chunk

    def pop(self) -> dict[str, Any] | None:
        while True:
            line, newline, rest = self._buffer.partition(b"\n")
            if not newline:
                return None
            self._buffer = rest
            message = decode_line(line)
            if message is not None:
                return message
