"""Peers known live from direct contact (net/contacts.py): heard from within the ttl, greeted at most once a ttl."""

from __future__ import annotations

from p2ptrain.net.contacts import Addresses, Contacts


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


def test_addresses_of_a_peer_not_seen_for_forget_after_or_gone_are_forgotten() -> None:
    """Re-pings and dials go to the peers seen live lately only: a swarm under churn (every restart a new id) must
    not re-ping every id it ever saw for as long as it runs."""
    now = [0.0]
    book = Addresses(forget_after=600.0, clock=lambda: now[0])
    book.seen("a", ["/ip4/1.2.3.4/tcp/1"])
    book.seen("b", ["/ip4/1.2.3.4/tcp/2"])
    book.seen("c", ["/ip4/1.2.3.4/tcp/3"])
    book.forget("c")  # announced its departure
    assert book.current() == {"a": ["/ip4/1.2.3.4/tcp/1"], "b": ["/ip4/1.2.3.4/tcp/2"]}
    now[0] = 500.0
    book.seen("b", ["/ip4/1.2.3.4/tcp/4"])  # seen again, at a new address
    now[0] = 600.5
    assert book.current() == {"b": ["/ip4/1.2.3.4/tcp/4"]}  # a: 600.5 s unseen
    assert book.get("a") == [] and book.get("c") == [] and book.get("b") == ["/ip4/1.2.3.4/tcp/4"]
    book.current()["b"].append("x")  # copies: the book stays as it is
    assert book.get("b") == ["/ip4/1.2.3.4/tcp/4"]
    now[0] = 1100.6
    assert book.current() == {}
