"""Collective instance keys: every collective op of one transformed graph
takes its own key (TensorFlow matches an op across workers by group and
instance key), so the passes that add collectives draw them from one
InstanceKeys.

Guarantees: single keys counting up from `start`, and ranges of
RANGE_KEYS keys above RANGES_START for a collective whose shape changes
from step to step; a GraphError when the ranges run out.
"""
from __future__ import annotations

from ..errors import GraphError

RANGE_KEYS = 1 << 22        # instance keys in a range (one per shape)
RANGES_START = 1 << 30      # ranges above the single keys, up to 2**31


class InstanceKeys:
    """Collective instance keys, unique within one transformed graph: single
    keys, and ranges of RANGE_KEYS keys for a collective whose shape changes
    from step to step (its key is the range's first plus its size)."""

    def __init__(self, start: int = 1):
        self._next = start
        self._ranges = 0

    def take(self) -> int:
        self._next += 1
        return self._next - 1

    def take_range(self) -> int:
        first = RANGES_START + self._ranges * RANGE_KEYS
        if first + RANGE_KEYS > 2**31:
            raise GraphError(f"more than {(2**31 - RANGES_START) // RANGE_KEYS} collectives "
                             "of changing shape (all-gathered sparse gradients) in one graph")
        self._ranges += 1
        return first
