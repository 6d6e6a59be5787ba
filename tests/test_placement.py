"""Placements: mirrored, shared on one device, sharded at row or element offsets."""
import pytest

from parallax_ng.planning.placement import MIRRORED, Shard, Sharded, Shared, home, part_name

CPU = [f"/cpu:{k}" for k in range(3)]


def test_even_shards_cover_every_row_once():
    p = Sharded.even(0, 40, CPU)
    assert [(s.start, s.size) for s in p.shards] == [(0, 13), (13, 13), (26, 14)]
    assert p.length == 40 and p.home == CPU[0]
    assert Sharded.even(None, 2, CPU).shards == (Shard(CPU[1], 0, 1), Shard(CPU[2], 1, 1))


def test_shards_must_be_contiguous_and_the_axis_rows_or_elements():
    with pytest.raises(ValueError, match="contiguous"):
        Sharded(0, (Shard(CPU[0], 0, 5), Shard(CPU[1], 6, 5)))
    with pytest.raises(ValueError, match="contiguous"):
        Sharded(None, (Shard(CPU[0], 0, 0),))
    with pytest.raises(ValueError, match="axis 1"):
        Sharded(1, (Shard(CPU[0], 0, 5),))


def test_home_description_and_part_names():
    rows = Sharded(0, (Shard(CPU[0], 0, 7), Shard(CPU[1], 7, 20)))
    assert home(rows) == CPU[0] and home(Shared(CPU[2])) == CPU[2] and home(MIRRORED) is None
    assert rows.describe() == f"sharded rows 0..6 on {CPU[0]}, rows 7..26 on {CPU[1]}"
    assert Sharded(None, rows.shards).describe().startswith("sharded elements 0..6")
    assert part_name("emb/Adam", 1) == "emb/Adam/part_1"
    assert Shared(CPU[1]) == Shared(CPU[1]) and MIRRORED.describe() == "mirrored"


def test_row_ranges_cut_by_the_rows_a_step_touches():
    """Rows 0..9 touched three times as often as the rest: four ranges of
    30 touched rows each, where even ranges would give the first 45."""
    touched = sorted([r for r in range(10) for _ in range(3)] + list(range(10, 100)))
    p = Sharded.by_rows_touched(100, CPU + ["/cpu:3"], touched)
    assert [(s.start, s.size) for s in p.shards] == [(0, 10), (10, 30), (40, 30), (70, 30)]
    assert p.shares(touched) == [0.25] * 4
    assert Sharded.even(0, 100, CPU + ["/cpu:3"]).shares(touched)[0] == 45 / 120
    assert p.shares() == [0.1, 0.3, 0.3, 0.3]            # without a sample: of the rows


def test_zipf_ids_split_evenly_within_the_memory_bound():
    """Ids drawn as lm_small draws them (Zipf 1.3 over 20,000 rows): cut by
    8 steps' distinct rows, 20 other steps send each of 4 servers at most
    30% of their rows (even ranges: the first over 70%), and no range holds
    more than 3 times an even share of the rows."""
    import numpy as np

    from parallax_ng.planning.profile import sample
    rng = np.random.RandomState(0)

    def step():
        return np.unique(rng.zipf(1.3, 512 * 4) % 20000)
    devices = [f"/job:ps/task:{j}" for j in range(4)]
    p = Sharded.by_rows_touched(20000, devices, sample(np.concatenate(
        [step() for _ in range(8)])))
    assert max(s.size for s in p.shards) <= 3 * 20000 / 4 and p.length == 20000
    other = sample(np.concatenate([step() for _ in range(20)]))
    assert max(p.shares(other)) <= 0.3
    assert Sharded.even(0, 20000, devices).shares(other)[0] > 0.7
    narrow = Sharded.by_rows_touched(20000, devices, other, widest=1.2)
    assert max(s.size for s in narrow.shards) <= 6000


def test_a_cut_by_rows_touched_falls_back_to_even_ranges():
    assert Sharded.by_rows_touched(40, CPU, ()) == Sharded.even(0, 40, CPU)
    assert Sharded.by_rows_touched(2, CPU, (0, 1)) == Sharded.even(0, 2, CPU)
    one = Sharded.by_rows_touched(10, CPU[:2], (9, 9, 9))     # every touched row on one end
    assert [(s.start, s.size) for s in one.shards] == [(0, 9), (9, 1)]
    assert one.shares((9, 9, 9)) == [0.0, 1.0]
