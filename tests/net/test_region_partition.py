"""A region cut off from the others and healed, with hierarchical rounds (peers announce regions): while cut, the
region holds no quorum and trains no θ of its own (the majority, if there is one, goes on); θ must agree on every
peer again within two rounds of healing, as it does with flat rounds (tests/net/test_robust_training.py).

Found by bench/churn.py: after a 60 s cut of one region of three, every later round of the 16-peer swarm ended with
two or three different θ. While cut off, the region averaged on its own; afterwards its members agreed with each
other (the fingerprint check inside the region passed) and only its carriers were outvoted across regions, and they
"repaired" from the first contributor, a member of their own region holding the same outvoted θ."""

from __future__ import annotations

import math
import threading
import time

import pytest

from p2ptrain.algo.methods import method_config
from p2ptrain.data import Corpus
from p2ptrain.net.memory import MemorySwarm

from .peers import Spec, SwarmRun, memory_transports, run_peers

pytestmark = [pytest.mark.timeout(120)]


@pytest.mark.parametrize("regions", [["a", "a", "b", "b", "c", "c"], ["a", "a", "a", "b", "b", "b"]],
                         ids=["three-regions", "two-regions"])
def test_a_region_cut_off_agrees_again_after_healing_with_hierarchical_rounds(corpus: Corpus,
                                                                               regions: list[str]) -> None:
    method = method_config("streaming", H=8, P=2, tau=2, codec="fp32", timeout=3)
    swarm = MemorySwarm(join_window=0.5, ttl=1.0)
    cut = [i for i, r in enumerate(regions) if r == "a"]
    names = [f"peer{i}" for i in range(len(regions))]
    box: dict[str, SwarmRun] = {}
    times: dict[str, float] = {}
    errors: list[BaseException] = []

    def sent_by_all(after: float, before: float = math.inf) -> list[str]:
        peers = box["run"].peers
        sent = [p.replica.sent_at for p in peers]
        keys = set.intersection(*(set(s) for s in sent)) & set.intersection(*(set(p.applied_log) for p in peers))
        return sorted((k for k in keys if all(after < s[k] < before for s in sent)), key=lambda k: sent[0][k])

    def weather() -> None:
        try:
            deadline = time.time() + 60
            while time.time() < deadline and not ("run" in box and all(
                    p.transport is not None and p.applied_log for p in box["run"].peers)):
                time.sleep(0.1)
            if time.time() >= deadline:
                raise TimeoutError("the peers did not all start and apply a round within 60 s")
            time.sleep(1.0)
            swarm.partition([names[i] for i in cut], [n for i, n in enumerate(names) if i not in cut])
            times["split"] = time.time()
            time.sleep(5.0)
            swarm.heal()
            times["heal"] = time.time()
            deadline = time.time() + 40
            while time.time() < deadline:
                frags = [k.split(".")[0] for k in sent_by_all(times["heal"])]
                if all(frags.count(f"f{f}") >= 4 for f in range(method.P)):
                    break
                time.sleep(0.2)
        except BaseException as e:
            errors.append(e)
        finally:
            for p in box["run"].peers if "run" in box else []:
                p.request_stop()

    t = threading.Thread(target=weather, daemon=True)
    t.start()
    run = run_peers(method, [Spec(steps=100_000, delay=0.02, region=r) for r in regions], corpus,
                    memory_transports(swarm), timeout=110, shared_loop=True, step_seconds=0.05,
                    started=lambda r: box.setdefault("run", r))
    t.join(30)
    assert not errors and not run.errors, (errors, run.errors)
    logs = [p.applied_log for p in run.peers]
    # While cut: the cut-off region (a minority, or one half of two) holds no quorum and applies no round of its
    # own (a round formed before the cut may still end, on more than half of the swarm alike: a member whose part the
    # cut kept out applies none and repairs); a majority of the others goes on.
    sent = [p.replica.sent_at for p in run.peers]
    rest = [i for i in range(len(regions)) if i not in cut]

    def sent_while_cut(peers: list[int]) -> set[str]:
        return {k for i in peers for k, t in sent[i].items() if times["split"] + 0.5 < t < times["heal"]}

    own = sorted(k for k in sent_while_cut(cut) if any(k in logs[i] for i in cut)
                 and not (2 * sum(k in lg for lg in logs) > len(logs)
                          and len({lg[k][0] for lg in logs if k in lg}) == 1))
    assert not own, ("the cut-off region applied rounds of its own", own)
    if 2 * len(rest) > len(regions):
        assert any(all(k in logs[i] for i in rest) and len({logs[i][k][0] for i in rest}) == 1
                   for k in sent_while_cut(rest)), "the majority did not go on while the region was cut off"
    after = sent_by_all(times["heal"])
    for f in range(method.P):
        rounds = [k for k in after if k.startswith(f"f{f}.")]
        assert len(rounds) >= 3, (f, after)
        for k in rounds[2:]:  # the first two after healing may still repair
            assert len({lg[k][0] for lg in logs}) == 1, (k, [lg[k][0][:6] for lg in logs])
