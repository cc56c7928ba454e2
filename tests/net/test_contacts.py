"""Peers known live from direct contact (net/contacts.py): heard from within the ttl, greeted at most once a ttl."""

from __future__ import annotations

from p2ptrain.net.contacts import Contacts


def test_a_peer_heard_from_is_live_for_one_ttl_and_is_greeted_once_a_ttl() -> None:
    now = [100.0]
    c = Contacts(ttl=3.0, clock=lambda: now[0])
    c.heard("a")
    now[0] = 102.0
    c.heard("b")
    assert c.live() == {"a", "b"}
    now[0] = 103.5
    assert c.live() == {"b"}  # a expired
    c.forget("b")
    assert c.live() == set()
    assert c.to_greet(["x", "y", "x"]) == ["x", "y"]
    now[0] = 105.0
    assert c.to_greet(["x", "z"]) == ["z"]  # x was greeted 1.5 s ago
    now[0] = 106.6
    assert c.to_greet(["x", "z"]) == ["x"]
