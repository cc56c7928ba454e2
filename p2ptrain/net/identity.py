"""A peer's libp2p identity as a signing key: what it signs, anyone can check against its peer id alone.

libp2p derives a peer id from the public key of the daemon's identity: for an Ed25519 key the id *is* the
key (an identity multihash of its protobuf encoding, ids ``12D3KooW…``); for an RSA key (``--identity``
files made by hivemind, ids ``Qm…``) it is the SHA-256 of the key, so an RSA signature travels with the
public key it was made with, and a verifier checks that key against the id. Either way a signature binds
what was signed to the peer that the libp2p connection authenticated: a part owner can later prove what a
member sent it (net/verify.py), and nobody can make up a member's contribution.

Without ``--identity`` a peer used to let its daemon draw a key that no Python code could read; it now
draws an Ed25519 key itself (:meth:`Identity.generate`), hands it to the daemon through a private
temporary file that is removed once the daemon has read it, and keeps it in memory to sign with.
"""

from __future__ import annotations

import functools
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ed25519, padding, rsa

__all__ = ["Identity", "IdentityError", "verify_signature"]

# libp2p's protobuf key types (crypto.proto) and multihash codes.
_RSA, _ED25519 = 0, 1
_IDENTITY_MH, _SHA256_MH = 0x00, 0x12


class IdentityError(ValueError):
    """An identity file that cannot be used to sign (unreadable, or a key type p2ptrain does not handle)."""


def _pb_key(key_type: int, data: bytes, *, private: bool = False) -> bytes:
    """libp2p's protobuf ``PublicKey`` (or ``PrivateKey``) message."""
    from hivemind.proto import crypto_pb2

    cls = crypto_pb2.PrivateKey if private else crypto_pb2.PublicKey
    return cls(key_type=key_type, data=data).SerializeToString()


def _parse_pb_key(buf: bytes, *, private: bool = False) -> tuple[int, bytes]:
    """(key type, key bytes) of a protobuf key message; ValueError if it is not one."""
    from google.protobuf.message import DecodeError
    from hivemind.proto import crypto_pb2

    cls = crypto_pb2.PrivateKey if private else crypto_pb2.PublicKey
    try:
        msg = cls.FromString(buf)
    except DecodeError as e:
        raise ValueError(f"not a libp2p key ({e})") from None
    return int(msg.key_type), bytes(msg.data)


def peer_id_of(public_pb: bytes) -> str:
    """The libp2p peer id of a protobuf-encoded public key (identity multihash up to 42 bytes, else SHA-256)."""
    if len(public_pb) <= 42:
        return base58.b58encode(bytes([_IDENTITY_MH, len(public_pb)]) + public_pb).decode()
    return base58.b58encode(bytes([_SHA256_MH, 32]) + hashlib.sha256(public_pb).digest()).decode()


class Identity:
    """The private key behind this peer's id: :meth:`sign` bytes; :attr:`public` is what a verifier needs
    besides the id (empty for Ed25519, whose id holds the key)."""

    def __init__(self, key: ed25519.Ed25519PrivateKey | rsa.RSAPrivateKey) -> None:
        self._key = key
        if isinstance(key, ed25519.Ed25519PrivateKey):
            raw = key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
            self._public_pb = _pb_key(_ED25519, raw)
        else:
            der = key.public_key().public_bytes(serialization.Encoding.DER,
                                                serialization.PublicFormat.SubjectPublicKeyInfo)
            self._public_pb = _pb_key(_RSA, der)
        self.peer_id = peer_id_of(self._public_pb)
        self.public = b"" if len(self._public_pb) <= 42 else self._public_pb

    @classmethod
    def generate(cls) -> Identity:
        return cls(ed25519.Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: str | Path) -> Identity:
        """The key of a libp2p identity file (RSA as hivemind writes them, or Ed25519); IdentityError if the
        file cannot be read or holds something else."""
        try:
            kt, data = _parse_pb_key(Path(path).read_bytes(), private=True)
            if kt == _ED25519 and len(data) in (32, 64):
                return cls(ed25519.Ed25519PrivateKey.from_private_bytes(data[:32]))
            if kt == _RSA:
                key = serialization.load_der_private_key(data, password=None)
                if isinstance(key, rsa.RSAPrivateKey):
                    return cls(key)
        except OSError as e:
            raise IdentityError(f"identity {path}: cannot read it ({e.strerror})") from None
        except ValueError as e:
            raise IdentityError(f"identity {path}: not a libp2p private key ({e})") from None
        raise IdentityError(f"identity {path}: a key of a type p2ptrain cannot sign with (RSA or Ed25519 only)")

    def private_pb(self) -> bytes:
        """The key as a libp2p identity file holds it (what the daemon reads)."""
        if isinstance(self._key, ed25519.Ed25519PrivateKey):
            seed = self._key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())
            return _pb_key(_ED25519, seed + self._public_pb[-32:], private=True)
        der = self._key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.TraditionalOpenSSL,
                                      serialization.NoEncryption())
        return _pb_key(_RSA, der, private=True)

    @contextmanager
    def as_file(self) -> Iterator[str]:
        """A private temporary identity file for the daemon to read, removed on leaving."""
        fd, path = tempfile.mkstemp(prefix="p2ptrain-id-")
        try:
            os.fchmod(fd, stat.S_IRUSR | stat.S_IWUSR)
            with os.fdopen(fd, "wb") as f:
                f.write(self.private_pb())
            yield path
        finally:
            Path(path).unlink(missing_ok=True)

    def save(self, path: str | Path) -> None:
        """Write the key to a new file ``path``, readable by its owner only (FileExistsError if there is one:
        a key is never overwritten)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, stat.S_IRUSR | stat.S_IWUSR)
        with os.fdopen(fd, "wb") as f:
            f.write(self.private_pb())

    def sign(self, data: bytes) -> bytes:
        if isinstance(self._key, ed25519.Ed25519PrivateKey):
            return self._key.sign(data)
        return self._key.sign(data, padding.PKCS1v15(), hashes.SHA256())


def verify_signature(peer_id: str, data: bytes, signature: bytes, public: bytes = b"") -> bool:
    """Whether ``signature`` over ``data`` was made by the key behind ``peer_id`` (``public``: the protobuf
    public key an RSA signer sends along; ignored for ids that hold their key). Never raises."""
    key = _verifier(peer_id, public)
    if key is None:
        return False
    try:
        if isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        else:
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        return True
    except (InvalidSignature, ValueError, TypeError):
        return False


@functools.lru_cache(maxsize=4096)
def _verifier(peer_id: str, public: bytes) -> ed25519.Ed25519PublicKey | rsa.RSAPublicKey | None:
    """The public key behind ``peer_id`` (None: not a key id, or ``public`` is not its key). Kept per id: a
    member checks every other member's signatures every round, and decoding the id each time cost about as
    much as the check (bounded: an id a liar makes up takes one of a fixed number of places)."""
    try:
        mh = base58.b58decode(peer_id)
        if len(mh) < 2:
            return None
        if mh[0] == _IDENTITY_MH:
            public = mh[2:]
        elif mh[0] != _SHA256_MH or peer_id_of(public) != peer_id:
            return None
        kt, key = _parse_pb_key(public)
        if kt == _ED25519 and len(key) == 32:
            return ed25519.Ed25519PublicKey.from_public_bytes(key)
        if kt == _RSA:
            pub = serialization.load_der_public_key(key)
            return pub if isinstance(pub, rsa.RSAPublicKey) else None
        return None
    except (ValueError, TypeError):
        return None
