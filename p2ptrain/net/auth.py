"""Private swarms: a shared secret key authenticates every DHT record and stream message of a run.

With ``--swarm-key FILE`` each peer adds an HMAC-SHA256 tag to what it stores in the DHT (over the
record, the run's key and its subkey: the announcing peer's id) and to every request and reply on
its streams (over the message, the sender's peer id, the protocol and the run). Receivers drop
anything untagged or mistagged, so a peer without the key cannot announce itself, join a group or
get a single tensor accepted. The DHT's routing stays open (anyone may relay records); only what a
keyed peer accepts is gated. The key itself is never logged: its fingerprint identifies it.

Without a key the swarm is open, and the CLI says so at start.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from pathlib import Path
from typing import Any

from .wire import encode_message

__all__ = ["MAC_FIELD", "SwarmKey", "generate_key_file"]

MAC_FIELD = "_mac"
MIN_KEY_BYTES = 16


class SwarmKey:
    """A run's shared secret (``repr`` and ``str`` show only its fingerprint)."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"a swarm key needs at least {MIN_KEY_BYTES} bytes of secret, got {len(secret)}")
        self._secret = bytes(secret)

    @classmethod
    def load(cls, path: str | Path) -> SwarmKey:
        """Read a key file (the text it holds, stripped, or raw bytes); ValueError with a clear reason."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as e:
            raise ValueError(f"swarm key {path}: cannot read it ({e.strerror})") from None
        secret = raw.strip()
        if len(secret) < MIN_KEY_BYTES:
            raise ValueError(f"swarm key {path}: too short ({len(secret)} bytes; at least {MIN_KEY_BYTES})")
        return cls(secret)

    @property
    def fingerprint(self) -> str:
        return hashlib.sha256(b"p2ptrain-key-fingerprint" + self._secret).hexdigest()[:12]

    def __repr__(self) -> str:
        return f"SwarmKey(fingerprint={self.fingerprint})"

    __str__ = __repr__

    def tag(self, *parts: bytes) -> bytes:
        h = hmac.new(self._secret, digestmod=hashlib.sha256)
        for p in parts:
            h.update(len(p).to_bytes(8, "big"))
            h.update(p)
        return h.digest()[:16]

    def seal(self, msg: dict[str, Any], *context: str) -> dict[str, Any]:
        """``msg`` with its tag over the message and ``context`` (e.g. sender, protocol, run)."""
        body = {k: v for k, v in msg.items() if k != MAC_FIELD}
        return {**body, MAC_FIELD: self.tag(encode_message(body), *(c.encode() for c in context))}

    def verify(self, msg: Any, *context: str) -> bool:
        """Whether ``msg`` carries a valid tag for ``context`` (constant-time comparison)."""
        if not isinstance(msg, dict) or not isinstance(msg.get(MAC_FIELD), bytes):
            return False
        body = {k: v for k, v in msg.items() if k != MAC_FIELD}
        try:
            want = self.tag(encode_message(body), *(c.encode() for c in context))
        except (TypeError, ValueError):
            return False
        return hmac.compare_digest(want, msg[MAC_FIELD])


def generate_key_file(path: str | Path) -> SwarmKey:
    """Write a new random key (64 hex characters) readable by its owner only; refuses to overwrite."""
    path = Path(path)
    secret = secrets.token_hex(32).encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
    with os.fdopen(fd, "wb") as f:
        f.write(secret + b"\n")
    return SwarmKey(secret)
