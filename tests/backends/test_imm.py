"""ImmCounter: arrivals before or after an expect, FIFO waiters, withdrawing and forgetting."""

from __future__ import annotations

import pytest

from backends.errors import ChannelError
from backends.imm import ImmCounter


def test_imm_counter_discard_withdraws_only_that_waiter() -> None:
    c = ImmCounter()
    a, b = c.expect(5, 1), c.expect(5, 1)
    assert c.discard(5, a) is True
    assert c.discard(5, a) is False
    c.arrive(5)
    assert b.done()
    assert not a.done()
    assert c.discard(6, b) is False


def test_consumed_values_leave_no_state_behind() -> None:
    c = ImmCounter()
    for v in range(1000):
        c.arrive(v, 2)
        c.expect(v, 1).result(0)
        c.expect(v, 1).result(0)
    assert c.pending(7) == 0
    assert c._counts == {}
    assert c._waiters == {}


def test_forget_drops_counts_and_fails_waiters_of_a_range_only() -> None:
    c = ImmCounter()
    c.arrive(100, 3)
    c.arrive(110)
    c.arrive(99)
    inside, outside = c.expect(105, 1), c.expect(200, 1)
    c.forget(100, 10, ChannelError("channel 'x' closed"))
    assert c.pending(100) == 0
    assert c.pending(110) == 1
    assert c.pending(99) == 1
    with pytest.raises(ChannelError, match="closed"):
        inside.result(0)
    assert not outside.done()
