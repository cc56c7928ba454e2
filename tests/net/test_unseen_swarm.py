"""A peer that joined through initial peers and never saw another peer of its run does not average alone until
``quorum_memory`` has passed: its swarm may be behind a cut it cannot tell from an empty swarm."""

from __future__ import annotations

import asyncio
import time

import pytest

from p2ptrain.net.groups import unseen_check
from p2ptrain.net.transport import Group, JoinRequest, PeerInfo, RoundFailed


def _group(*members: str) -> Group:
    return Group(key="f0.L7", members=tuple(members), leader=members[0], fragment=0)


def test_a_group_of_one_that_never_saw_its_run_waits_out_the_quorum_memory() -> None:
    with pytest.raises(RoundFailed, match="no other peer of the run seen"):
        unseen_check(_group("me"), "me", {"me"}, True, 5.0, 120.0)
    unseen_check(_group("me"), "me", {"me"}, True, 120.0, 120.0)  # alone for quorum_memory: a swarm of its own
    unseen_check(_group("me"), "me", {"me"}, False, 5.0, 120.0)  # no initial peers: it starts the swarm
    unseen_check(_group("me"), "me", {"me", "other"}, True, 5.0, 120.0)  # saw the run: the quorum rules hold
    unseen_check(_group("a", "me"), "me", {"me"}, True, 5.0, 120.0)  # not alone


@pytest.mark.net
@pytest.mark.timeout(120)
def test_a_peer_pointed_at_a_node_of_another_run_averages_alone_only_after_the_quorum_memory() -> None:
    """Real libp2p peers: ``lone`` joins through a node that is no peer of its run (a bootstrap node, or the other
    side of a cut), so it sees nobody of its run. Its first round fails; after quorum_memory (2 s) it averages alone."""
    from p2ptrain.net.swarm import HivemindTransport, SwarmConfig

    async def go() -> None:
        boot = await HivemindTransport.create(SwarmConfig(run_id="someone-else"))
        lone = None
        try:
            lone = await HivemindTransport.create(SwarmConfig(run_id="lonely", initial_peers=await boot.visible_maddrs(),
                                                              join_window=0.5, quorum_memory=2.0))
            born = time.monotonic()
            await lone.announce(PeerInfo(peer_id=lone.peer_id))

            def join(key: str) -> object:
                return lone.form_group(JoinRequest(key=key, peer_id=lone.peer_id, weight=1.0, fragment=0), None,
                                       timeout=10)

            with pytest.raises(RoundFailed, match="no other peer of the run seen"):
                await join("r0")
            await asyncio.sleep(max(0.0, born + 2.2 - time.monotonic()))
            group = await join("r1")
            assert group.members == (lone.peer_id,)
        finally:
            await asyncio.gather(boot.aclose(), *([lone.aclose()] if lone else []), return_exceptions=True)

    asyncio.run(go())
