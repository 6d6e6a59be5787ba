"""Lowering: the collectives of the plan's backend (`communication.backend`),
for the passes (`PassContext.comm`).

Requires: the plan and the graph's InstanceKeys. Guarantees: an object with
the operations parallax_ng/comm/collectives.py lists, TensorFlow's or
Horovod's; `host_lowering` those among layer-to-layer's hosts.
"""
from __future__ import annotations

from ..errors import ConfigError
from .collectives import HostCollectives, TFCollectives


def lowering(plan, instance_keys):
    """The plan's backend's collectives."""
    if plan.backend == "horovod":
        from .horovod import HorovodCollectives  # Horovod is imported only when asked for
        return HorovodCollectives(plan)
    return TFCollectives(plan, instance_keys)


def host_lowering(backend: str, workers: int, worker: int) -> HostCollectives:
    """The collectives among the workers' hosts (layer-to-layer execution's
    EPS, one per worker): TensorFlow's."""
    if backend != "tf":
        raise ConfigError("config key 'l2l' keeps the model on the host of one process; "
                          f"'communication.backend: {backend}' does not apply to it")
    return HostCollectives(workers, worker)
