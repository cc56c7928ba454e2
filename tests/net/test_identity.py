"""Signatures checked against a peer id alone (Ed25519 ids) or with the key sent along (RSA ids), kept per id."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric import rsa

from p2ptrain.net.identity import Identity, _verifier, verify_signature


def test_an_ed25519_signature_is_checked_against_the_id_alone_and_binds_data_and_signer() -> None:
    me, other = Identity.generate(), Identity.generate()
    sig = me.sign(b"a commitment")
    assert me.public == b"" and me.peer_id.startswith("12D3KooW")
    for _ in range(2):  # the second time from the key kept for the id
        assert verify_signature(me.peer_id, b"a commitment", sig)
    assert not verify_signature(me.peer_id, b"a commitment!", sig)
    assert not verify_signature(other.peer_id, b"a commitment", sig)
    assert not verify_signature(me.peer_id, b"a commitment", sig[:-1] + bytes([sig[-1] ^ 1]))


def test_an_rsa_signature_needs_the_key_that_hashes_to_the_id() -> None:
    me = Identity(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    other = Identity(rsa.generate_private_key(public_exponent=65537, key_size=2048))
    assert me.peer_id.startswith("Qm") and me.public
    sig = me.sign(b"a result")
    assert verify_signature(me.peer_id, b"a result", sig, public=me.public)
    assert not verify_signature(me.peer_id, b"a result", sig)  # no key sent along
    assert not verify_signature(me.peer_id, b"a result", sig, public=other.public)  # not the id's key
    assert not verify_signature(me.peer_id, b"another result", sig, public=me.public)
    # a key kept for the id with one public key is not used for the id with another
    assert verify_signature(me.peer_id, b"a result", sig, public=me.public)


def test_ids_that_are_not_keys_are_refused_without_raising_and_the_kept_keys_are_bounded() -> None:
    for bad in ("", "0", "QmQmQmQm", "12D3KooWnotbase58!!", "1" * 60):
        assert not verify_signature(bad, b"x", b"\x00" * 64)
        assert _verifier(bad, b"") is None
    assert _verifier.cache_info().maxsize is not None
