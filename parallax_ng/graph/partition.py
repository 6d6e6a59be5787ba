"""`partitioner()`: split a large variable into row ranges, one per server.

Requires: a variable made with `tf.compat.v1.get_variable(..., partitioner=pn.partitioner())`
(and, for row ranges end to end, `tf.compat.v1.nn.embedding_lookup(...,
partition_strategy="div")`).
Guarantees: the variable is made of `parts` row ranges as equal as the row
count allows (the first ones one row longer); by default one part per
parameter-server task of the job this process belongs to, so the plan, which
spreads variables over servers by bytes, puts each range on its own server;
one part outside a job with servers. Each part is an ordinary variable with
its own gradient and update, so the single-device graph and the parallel one
compute the same thing.
"""
from __future__ import annotations

from .. import compat
from ..errors import ConfigError


def partitioner(parts: int | None = None, min_rows: int = 1):
    """A tf.compat.v1 variable partitioner: `parts` row ranges (default: the
    job's parameter servers), never ranges shorter than `min_rows`."""
    if parts is not None and (not isinstance(parts, int) or parts < 1):
        raise ConfigError(f"partitioner(parts=...) must be a positive integer, not {parts!r}")
    wanted = parts if parts is not None else job_servers()

    def partition(shape, dtype=None):
        rows = (compat.dim(shape, 0) or 1) if shape.rank else 1
        n = max(1, min(wanted, rows // max(1, min_rows)))
        return [n] + [1] * (len(shape) - 1)

    return partition


def job_servers() -> int:
    """Parameter-server tasks of the job this process runs in (at least 1)."""
    from .. import cluster
    info = cluster.from_env()
    return max(1, len(info.ps)) if info is not None else 1
