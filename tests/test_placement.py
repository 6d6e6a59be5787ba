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
