"""A peer whose rounds kept its outer loop waiting catches up with the swarm's clock (peer/outer.py's
steps_to_advance): it skips the steps too far behind to meet any group instead of sending ever older round
keys (on the testbed, the two halves of a healed region cut fell 18 s apart that way and never met again)."""

from __future__ import annotations

from p2ptrain.peer.outer import steps_to_advance


def test_on_time_every_step_is_taken_and_a_still_clock_repeats_its_step() -> None:
    assert list(steps_to_advance(10, lambda: 13, max_behind=5)) == [11, 12, 13]
    assert list(steps_to_advance(10, lambda: 10, max_behind=5)) == [10]
    assert list(steps_to_advance(10, lambda: 16, max_behind=5)) == [11, 12, 13, 14, 15, 16]


def test_steps_too_far_behind_the_clock_are_skipped_as_the_clock_moves() -> None:
    assert list(steps_to_advance(10, lambda: 30, max_behind=5)) == [30]  # resumes on the grid of 5
    assert list(steps_to_advance(10, lambda: 33, max_behind=5)) == [30, 31, 32, 33]
    # Two peers that fell behind from different steps resume on the same step, so they send the same keys.
    assert list(steps_to_advance(3, lambda: 34, max_behind=5)) == list(steps_to_advance(17, lambda: 34, max_behind=5))
    # Each step taken costs the clock 3 steps (a round kept the loop waiting): the loop keeps up.
    clock = [20]

    def now() -> int:
        return clock[0]

    taken = []
    for step in steps_to_advance(10, now, max_behind=2):
        taken.append(step)
        clock[0] += 3
    assert taken == [20]  # 11..19 too far behind: resumed at 20 (a multiple of 2)
    clock[0] = 40
    taken = []
    for step in steps_to_advance(35, now, max_behind=10):  # 36 is 4 behind: on time, until the clock runs away
        taken.append(step)
        clock[0] += 4
    assert taken == [36, 37, 38, 50], taken  # 39 came up 13 behind: resumed at 50 (the grid of 10 below 52)
