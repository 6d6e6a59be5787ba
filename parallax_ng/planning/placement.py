"""Where a variable lives: the three placements a plan gives variables.

- `Mirrored`: one copy per replica, all kept equal;
- `Shared(device)`: one copy, on a parameter server (the host CPU in-process);
- `Sharded(axis, shards)`: one copy cut into parts on several devices, each
  an ordinary variable named `part_name(var, k)`: along axis 0 (row ranges),
  or, with `axis=None`, the flattened variable at element offsets;
- `Columns(shards)`: one part per replica of the job, replica j's copy of
  the variable holding columns [start, start+size) of every row (EmbRace's
  column-wise partitioning; parallax_ng/planning/column_cut.py).

A shared or sharded variable exists once in the job; the plan puts a
variable's optimizer state where the variable is (slots of the same shape
are sharded alike). Pure data: printable and comparable.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass


@dataclass(frozen=True)
class Mirrored:
    def describe(self) -> str:
        return "mirrored"


@dataclass(frozen=True)
class Shared:
    device: str

    def describe(self) -> str:
        return f"shared on {self.device}"


@dataclass(frozen=True)
class Shard:
    device: str
    start: int     # first row (axis 0) or first element (flattened)
    size: int      # rows or elements


@dataclass(frozen=True)
class Sharded:
    axis: int | None               # 0: row ranges; None: element ranges of the flattened variable
    shards: tuple[Shard, ...]

    def __post_init__(self):
        if self.axis not in (0, None):
            raise ValueError(f"a variable is sharded by rows (axis 0) or by elements "
                             f"(axis None), not along axis {self.axis}")
        end = 0
        for s in self.shards:
            if s.start != end or s.size <= 0:
                raise ValueError(f"shards must be contiguous and non-empty from 0: {self.shards}")
            end += s.size

    @property
    def length(self) -> int:
        """Rows (axis 0) or elements (flattened) of the whole variable."""
        return sum(s.size for s in self.shards)

    @property
    def home(self) -> str:
        """The device of the first shard, where the variable's other state
        and its gradient's aggregation live."""
        return self.shards[0].device

    def describe(self) -> str:
        unit = "rows" if self.axis == 0 else "elements"
        return "sharded " + ", ".join(f"{unit} {s.start}..{s.start + s.size - 1} on {s.device}"
                                      for s in self.shards)

    @classmethod
    def even(cls, axis: int | None, length: int, devices) -> "Sharded":
        """`length` rows or elements cut as evenly as possible over `devices`."""
        bounds = [length * k // len(devices) for k in range(len(devices) + 1)]
        return cls(axis, tuple(Shard(d, bounds[k], bounds[k + 1] - bounds[k])
                               for k, d in enumerate(devices) if bounds[k + 1] > bounds[k]))

    @classmethod
    def by_rows_touched(cls, length: int, devices, touched, widest: float = 3.0
                        ) -> "Sharded":
        """`length` rows cut into one range per device so that the busiest
        range holds as few of `touched` (a sorted sample of the rows steps
        touch, a row as often as steps touched it) as it can, no range
        holding more than `widest` times an even share of the rows (a
        server's memory); even when `touched` is empty or that cannot help.
        Binary search over the busiest range's count, each range taken as
        long as the count and the width allow, left to right. (Zipf ids
        crowd the first rows: even ranges would send most of a step's rows
        to the first server.)"""
        n = len(devices)
        ids = [i for i in touched if 0 <= i < length]
        cap = max(1, int(widest * length / n))
        if n < 2 or not ids or cap * n < length:
            return cls.even(0, length, devices)

        def cut(most: int) -> list[int] | None:
            bounds = [0]
            for _ in range(n - 1):
                start = bounds[-1]
                first = bisect.bisect_left(ids, start)
                end = ids[first + most] if first + most < len(ids) else length
                end = min(end, start + cap, length - (n - len(bounds)))
                if end <= start:
                    return None
                bounds.append(end)
            return bounds + [length] if length - bounds[-1] <= cap and \
                len(ids) - bisect.bisect_left(ids, bounds[-1]) <= most else None

        low, high = 1, len(ids)          # the fewest touched rows the busiest range can hold
        while low < high:
            mid = (low + high) // 2
            low, high = (low, mid) if cut(mid) else (mid + 1, high)
        bounds = cut(low)
        if bounds is None:
            return cls.even(0, length, devices)
        return cls(0, tuple(Shard(d, bounds[k], bounds[k + 1] - bounds[k])
                            for k, d in enumerate(devices)))

    def shares(self, touched=()) -> list[float]:
        """Each shard's share of a step's rows: of the sorted sample
        `touched` when given (the rows it holds), else of the variable's."""
        ids = list(touched)
        if self.axis != 0 or not ids:
            return [s.size / self.length for s in self.shards]
        return [(bisect.bisect_left(ids, s.start + s.size) - bisect.bisect_left(ids, s.start))
                / len(ids) for s in self.shards]


@dataclass(frozen=True)
class Columns:
    """Shard j: the columns job replica j's copy holds, on its device."""
    shards: tuple[Shard, ...]

    def __post_init__(self):
        Sharded(0, self.shards)      # the same contiguity rule

    @property
    def width(self) -> int:
        return sum(s.size for s in self.shards)

    def describe(self) -> str:
        return "columns " + ", ".join(f"{s.start}..{s.start + s.size - 1} on {s.device}"
                                      for s in self.shards)

    @classmethod
    def even(cls, width: int, devices) -> "Columns":
        """`width` columns cut as evenly as possible, one part per device
        (the first `width % len(devices)` parts one column wider)."""
        n = len(devices)
        if width < n:
            raise ValueError(f"{width} columns cannot give each of {n} replicas one")
        sizes = [width // n + (k < width % n) for k in range(n)]
        starts = [sum(sizes[:k]) for k in range(n)]
        return cls(tuple(Shard(d, a, b) for d, a, b in zip(devices, starts, sizes)))


Placement = Mirrored | Shared | Sharded | Columns
MIRRORED = Mirrored()


def part_name(var: str, k: int) -> str:
    """The variable that holds part k of a sharded variable."""
    return f"{var}/part_{k}"


def home(placement) -> str | None:
    """The one device of a shared variable, the first shard's of a sharded
    one, None for a mirrored one."""
    if isinstance(placement, Shared):
        return placement.device
    if isinstance(placement, Sharded):
        return placement.home
    return None
