"""Lowering: the collectives of the plan's backend (`communication.backend`),
for the passes (`PassContext.comm`).

Requires: the plan and the graph's InstanceKeys. Guarantees: an object with
the operations parallax_ng/comm/collectives.py lists, TensorFlow's or
Horovod's.
"""
from __future__ import annotations

from .collectives import TFCollectives


def lowering(plan, instance_keys):
    """The plan's backend's collectives."""
    if plan.backend == "horovod":
        from .horovod import HorovodCollectives  # Horovod is imported only when asked for
        return HorovodCollectives(plan)
    return TFCollectives(plan, instance_keys)
