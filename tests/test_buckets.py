"""The all-reduce bucket model and the bucketings: MG-WFBP's merge is the
optimum (checked against every contiguous bucketing), the others are what
their names say."""
import itertools
import random

import pytest

from parallax_ng.buckets import (Cost, Layer, iteration_time, mgwfbp, ready_times, single,
                                 threshold, wfbp)


def every_bucketing(n):
    """All ways to cut n layers (backward order) into consecutive buckets."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        out, bucket = [], [0]
        for i, cut in enumerate(cuts, start=1):
            if cut:
                out.append(bucket)
                bucket = []
            bucket.append(i)
        yield out + [bucket]


def random_profile(rng, n):
    layers = [Layer(f"l{i}", rng.choice([rng.randint(1, 10**4), rng.randint(10**5, 10**7)]),
                    rng.uniform(0, 5e-3)) for i in range(n)]
    return rng.uniform(0, 0.02), layers, Cost(rng.uniform(1e-5, 5e-3), rng.uniform(1e-10, 2e-9))


@pytest.mark.parametrize("seed", range(40))
def test_mgwfbp_is_the_best_contiguous_bucketing(seed):
    rng = random.Random(seed)
    forward, layers, cost = random_profile(rng, rng.randint(1, 12))
    got = iteration_time(forward, layers, mgwfbp(forward, layers, cost), cost)
    best = min(iteration_time(forward, layers, b, cost) for b in every_bucketing(len(layers)))
    assert got == pytest.approx(best, rel=1e-12, abs=1e-15)


def test_the_model_on_a_hand_worked_profile():
    """Two layers (input first): backward runs l1 (ready at 1.0 + 0.5) then
    l0 (at 1.0 + 0.5 + 0.25); a + b*M = 0.1 + M/100."""
    layers = [Layer("l0", 10, 0.25), Layer("l1", 20, 0.5)]
    cost = Cost(0.1, 0.01)
    assert ready_times(1.0, layers) == [1.5, 1.75]
    # wfbp: l1 at 1.5 .. 1.8, l0 at max(1.75, 1.8) .. 2.0
    assert iteration_time(1.0, layers, wfbp(layers), cost) == pytest.approx(2.0)
    # single: both at 1.75 .. 1.75 + 0.1 + 0.3
    assert iteration_time(1.0, layers, single(layers), cost) == pytest.approx(2.15)
    assert mgwfbp(1.0, layers, cost) == [[0], [1]]
    # with a large startup cost one bucket wins
    assert mgwfbp(1.0, layers, Cost(1.0, 0.01)) == [[0, 1]]


def test_fixed_bucketings():
    layers = [Layer(f"l{i}", b, 0.0) for i, b in enumerate([5, 1, 4, 3])]   # backward: 3 4 1 5
    assert wfbp(layers) == [[0], [1], [2], [3]]
    assert single(layers) == [[0, 1, 2, 3]] and single([]) == []
    assert threshold(layers, 5) == [[0, 1], [2, 3]]
    assert threshold(layers, 100) == [[0, 1, 2, 3]]
