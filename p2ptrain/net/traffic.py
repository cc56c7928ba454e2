"""Bytes of our own messages, by kind and direction: what a round's protocol costs beside its payload.

Counted where the frames are written and read (net/streams.py), on both paths (libp2p and direct), for both ends
of an exchange: the caller's request, chunk frames and trailer are ``sent`` under the exchange's kind and its reply
``received``; the peer's side the other way round. What the counts leave out is the transport's own overhead (TCP/IP
headers, libp2p's multiplexer and encryption, the direct path's records) and the DHT: a link's byte counter minus
the sum of the kinds' ``sent`` is those (bench/utilization.py reports both).
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["Traffic"]


class Traffic:
    """Running totals of message bytes per kind: ``sent`` and ``received``, frames' length headers included."""

    def __init__(self) -> None:
        self._sent: defaultdict[str, int] = defaultdict(int)
        self._received: defaultdict[str, int] = defaultdict(int)

    def sent(self, kind: str, nbytes: int) -> None:
        self._sent[kind] += nbytes

    def received(self, kind: str, nbytes: int) -> None:
        self._received[kind] += nbytes

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{kind: {"sent": bytes, "received": bytes}}`` so far, kinds sorted. Safe to call from another thread
        (a metrics scrape): each table is copied in one step first."""
        sent, received = self._sent.copy(), self._received.copy()
        return {k: {"sent": sent.get(k, 0), "received": received.get(k, 0)} for k in sorted(set(sent) | set(received))}

    def total_sent(self) -> int:
        return sum(self._sent.values())
