"""Rounds whose outcome this peer did not see, held until the swarm's θ says whether they counted it.

A peer's Δ can reach the swarm's θ without the peer seeing it:

* a round failed here after its group formed while the others averaged our Δ (a hierarchical cell's mean crossed,
  then no carrier delivered the result here);
* a round was in flight in the checkpoint this peer resumed from;
* a round was sent after that checkpoint was written (the kill came before the next one).

Counted by the others and not here, its progress stayed in the local model (θ_i − θ) and went into the fragment's
next round: averaged twice, and its tokens counted twice (or, from a checkpoint, its tokens lost while its Δ was
kept). The swarm can say which: a θ it serves (``before:KEY`` for a repair, the ``outer`` state for a join or a
resume) names the round last in it and whom that round counted (``made``, see
:class:`~p2ptrain.peer.replica.ReplicaState`). Named, our Δ of that round is in that θ: the rebase onto it leaves
that round's progress out (``θ_new + (x − θ) + Δ``, Δ = θ − the local fragment at its send), and its tokens are
counted. Not named, or no word: everything since our θ is kept, with its tokens, as for an aborted round.

Pure bookkeeping (no clock, no network); the driver and the peer call it. What it holds: per fragment, at most one
round's Δ (a reference: one fragment of memory while held), and after a resume the whole progress at the checkpoint
(one model's worth, until the state taken after the warm-up).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Unseen", "UnseenRounds", "named_round", "same_theta"]

#: The keys of the rounds a peer sent, kept per fragment (a checkpoint's: which rounds it knew of).
SENT_KEPT = 4


@dataclass(frozen=True)
class Unseen:
    """A round whose outcome this peer did not see.

    ``key``: the round's ("" after a resume: any round of the fragment that this peer sent after its checkpoint,
    one not among the keys it had sent); ``theta``: θ^(p) at its send; ``delta``: θ^(p) − the local fragment at its
    send (minus the progress it carried); ``after``: the tokens mark its send had set (the fragment's tokens
    through it, counted once its Δ is known to be in θ)."""

    key: str
    theta: list[torch.Tensor]
    delta: list[torch.Tensor]
    after: int


def named_round(made: Any, me: str) -> str | None:
    """The key of the round a ``made`` entry ([key, contributors]) says counted ``me``; None otherwise (also for
    a malformed entry: a peer's word, at worst we drop progress of ours)."""
    if (isinstance(made, list | tuple) and len(made) == 2 and isinstance(made[0], str)
            and isinstance(made[1], list | tuple) and me in {str(c) for c in made[1]}):
        return made[0]
    return None


class UnseenRounds:
    """One peer's rounds of unseen outcome (see the module docstring)."""

    def __init__(self) -> None:
        self.held: dict[int, Unseen] = {}  # fragment -> its last round that failed here / was in flight at the ckpt
        self.since_checkpoint: dict[int, Unseen] = {}  # fragment -> the progress at the checkpoint resumed from
        self.sent: dict[int, list[str]] = {}  # fragment -> the keys of its last rounds sent

    def __bool__(self) -> bool:
        return bool(self.held or self.since_checkpoint)

    def sent_round(self, fragment: int, key: str) -> None:
        keys = self.sent.setdefault(fragment, [])
        keys.append(key)
        del keys[:-SENT_KEPT]

    def failed(self, fragment: int, unseen: Unseen) -> None:
        """A round of ``fragment`` failed here after its group formed (the fragment's last such round is held)."""
        self.held[fragment] = unseen

    def applied(self, fragment: int) -> Unseen | None:
        """A round of ``fragment`` is being applied: what was held of it (None if nothing) is no longer."""
        self.since_checkpoint.pop(fragment, None)
        return self.held.pop(fragment, None)

    def resumed(self, held: Sequence[tuple[int, Unseen]], sent: Mapping[int, Sequence[str]],
                since: Mapping[int, Unseen]) -> None:
        """A resume from a checkpoint: the rounds it held or had in flight, the keys it had sent, and per fragment
        the progress it held (key "")."""
        for f, u in held:
            self.held[f] = u
        self.sent = {f: list(k)[-SENT_KEPT:] for f, k in sent.items()}
        self.since_checkpoint = dict(since)

    def counted_in(self, made: Any, me: str) -> dict[int, Unseen]:
        """A state about to be taken says, per fragment, which round its θ was last made by and whom that round
        counted (``made``: fragment -> [key, contributors]). Per fragment whose θ holds our Δ of a round of unseen
        outcome: that round (its Δ leaves the rebase; its tokens are counted); it is no longer held. A held round
        the state's θ holds without us is no longer held either (its progress stays, with its tokens)."""
        out: dict[int, Unseen] = {}
        if not isinstance(made, Mapping):
            return out
        for f in sorted(set(self.held) | set(self.since_checkpoint)):
            entry = made.get(str(f))
            if not isinstance(entry, list | tuple) or len(entry) != 2:
                continue  # (no word of it: a θ replaced at the source since; a later state may say)
            key, mine = entry[0], named_round(entry, me)
            u, since = self.held.get(f), self.since_checkpoint.get(f)
            if u is not None and key == u.key:
                del self.held[f]
                if mine is None:
                    continue
                out[f] = u
                if since is not None:  # what the checkpoint held beyond that round's progress
                    self.since_checkpoint[f] = Unseen("", since.theta, [s - d for s, d in
                                                                        zip(since.delta, u.delta, strict=True)],
                                                      since.after)
            elif mine is not None and since is not None and mine not in self.sent.get(f, ()):
                # A round sent after the checkpoint, counted: it carried all the progress the checkpoint held.
                self.held.pop(f, None)
                out[f] = self.since_checkpoint.pop(f)
        return out

    def outvoted(self, fragment: int, held_round: str, theta: Sequence[torch.Tensor]) -> Unseen | None:
        """A round of ``fragment`` arrived outvoted and its repair took a θ whose last round counted us
        (``held_round``, "" for none; ``theta``: our θ^(p) before the repair). The held round that is, if our θ
        is still the one it was sent from (its Δ is then in our local progress); it is no longer held."""
        u = self.applied(fragment)
        if u is not None and u.key and held_round == u.key and same_theta(u.theta, theta):
            return u
        return None

    def clear(self) -> None:
        """The local progress was dropped (a state taken without it): nothing held is in it any more."""
        self.held.clear()
        self.since_checkpoint.clear()


def same_theta(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    """Whether two θ^(p) are the same version: the same tensor objects (θ is replaced, never written in place)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
