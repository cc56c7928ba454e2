"""Wire messages: msgpack maps in length-prefixed frames over byte streams.

A frame is a 4-byte big-endian length followed by that many bytes of msgpack.
Every read is bounded: the length is checked against ``max_size`` *before*
anything is allocated, and every read has a timeout, so a peer that lies about
sizes or stops mid-frame cannot exhaust memory or hang the reader.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack

__all__ = ["MAX_FRAME", "SCHEMA_ERRORS", "FrameError", "StreamClosed", "decode_message", "encode_message", "read_frame",
           "write_frame"]

MAX_FRAME = 512 * 1024 * 1024  # 512 MiB: above any single fragment part we send
_HEADER = 4


class FrameError(ValueError):
    """A frame or message is malformed, too large, or of the wrong shape."""


class StreamClosed(FrameError):
    """The stream ended before a whole frame was read; ``empty``: before any byte of it (the other end closed the
    stream without writing a frame at all)."""

    def __init__(self, message: str, *, empty: bool) -> None:
        super().__init__(message)
        self.empty = empty


# What reading fields of a decoded message that does not fit its schema can raise (a missing key, a
# string where a number belongs, int(inf), an index out of range): the handlers turn these into a
# refusal of the sender, never into a crash.
SCHEMA_ERRORS = (KeyError, TypeError, ValueError, OverflowError, IndexError, AttributeError)


def encode_message(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode_message(data: bytes, *, max_size: int = MAX_FRAME) -> dict[str, Any]:
    """Decode one msgpack map; FrameError on anything else (never raises other exceptions)."""
    if len(data) > max_size:
        raise FrameError(f"message of {len(data)} bytes exceeds the limit of {max_size}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as e:
        raise FrameError(f"undecodable message: {type(e).__name__}") from None
    except Exception as e:  # msgpack raises a few more kinds on hostile input
        raise FrameError(f"undecodable message: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"message must be a map, got {type(obj).__name__}")
    return obj


async def write_frame(writer: asyncio.StreamWriter, msg: dict[str, Any], *, timeout: float) -> int:
    """Send one message; returns the bytes written (header included)."""
    data = encode_message(msg)
    writer.write(len(data).to_bytes(_HEADER, "big"))
    writer.write(data)
    async with asyncio.timeout(timeout):  # (not wait_for: no task of its own for every frame)
        await writer.drain()
    return len(data) + _HEADER


async def read_frame(reader: asyncio.StreamReader, *, timeout: float, max_size: int = MAX_FRAME) -> tuple[dict[str, Any], int]:
    """Read one message within ``timeout`` seconds; returns (message, bytes read)."""

    begun = False
    try:
        async with asyncio.timeout(timeout):  # (not wait_for: no task of its own for every frame)
            header = await reader.readexactly(_HEADER)
            begun = True
            n = int.from_bytes(header, "big")
            if n > max_size:
                raise FrameError(f"frame of {n} bytes announced, limit is {max_size}")
            data = await reader.readexactly(n)
        return decode_message(data, max_size=max_size), n + _HEADER
    except asyncio.IncompleteReadError as e:
        raise StreamClosed("stream closed mid-frame", empty=not begun and not e.partial) from None
