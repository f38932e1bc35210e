"""``Prefetched``: the items in order, the next one prepared while the caller holds the current
one, errors raised where their item is taken, and nothing left running when the caller stops."""

from __future__ import annotations

import threading

import pytest

from harts.plan.prefetch import Prefetched


def test_items_in_order_and_equal_to_calling_each_function():
    fns = [lambda i=i: {"k": i, "rows": list(range(i))} for i in range(7)]
    want = [fn() for fn in fns]
    for ahead in (True, False):
        assert list(Prefetched(fns, ahead=ahead)) == want
    assert list(Prefetched([])) == []
    assert list(Prefetched(fns[:1])) == want[:1]


def test_the_next_item_is_prepared_while_the_caller_holds_the_current_one():
    started = [threading.Event() for _ in range(3)]

    def prepare(i: int) -> int:
        started[i].set()
        return i

    seen = []
    for item in Prefetched([lambda i=i: prepare(i) for i in range(3)]):
        if item + 1 < 3:
            # item + 1 starts without the caller asking for it (the wait is a deadlock guard:
            # without prefetching the event is never set while the caller sits here)
            assert started[item + 1].wait(timeout=30), f"item {item + 1} was not prepared ahead"
        seen.append(item)
    assert seen == [0, 1, 2]


def test_without_ahead_nothing_is_prepared_before_it_is_taken():
    calls: list[int] = []
    it = iter(Prefetched([lambda i=i: calls.append(i) or i for i in range(3)], ahead=False))
    assert next(it) == 0 and calls == [0]
    assert next(it) == 1 and calls == [0, 1]


def test_an_error_is_raised_where_its_item_is_taken():
    def bad() -> int:
        raise ValueError("microbatch 2: token id 999 outside the vocabulary")

    got = []
    with pytest.raises(ValueError, match="microbatch 2: token id 999"):
        for item in Prefetched([lambda: 0, lambda: 1, bad, lambda: 3]):
            got.append(item)
    assert got == [0, 1]


def test_a_caller_that_stops_early_leaves_no_later_item_started():
    release = threading.Event()
    calls: list[int] = []

    def prepare(i: int) -> int:
        calls.append(i)
        if i == 1:
            release.wait(timeout=30)
        return i

    items = Prefetched([lambda i=i: prepare(i) for i in range(5)])
    with pytest.raises(RuntimeError, match="stop"):
        for item in items:
            if item == 0:
                raise RuntimeError("stop")
    release.set()
    # item 1 was in flight; nothing after it was submitted
    assert calls in ([0], [0, 1])
    assert items.waited >= 0.0
