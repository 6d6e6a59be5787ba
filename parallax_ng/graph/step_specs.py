"""A TF2 step's arguments as its trace takes them: which leaves are fed
(`tensor_leaves`: not None nor Python values, which are traced as
constants) and the spec each is traced with (`spec`: its first dimension
open, the batch the replicas split; a scalar whole; a ragged batch as its
sparse rows), or a GraphError naming a leaf that no batch can be (a
dataset, a SparseTensor of no rows, a RaggedTensor of higher rank).

Requires: the step's arguments as the program passes them. Guarantees:
reads them only (graph/tracing.py traces with the specs; step_args.py
feeds the leaves).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from ..errors import GraphError

INPUT = "parallax_input_{}"         # a traced step's placeholder for argument leaf i


def tensor_leaves(args) -> list:
    """The leaves of a step's arguments that are fed: every leaf but None
    and Python numbers and strings, which the step gets as they are
    (Keras's `train_on_batch` passes (x, y, None) where no sample weights
    are given; a Python `training=True` is traced as a constant, as a
    tf.function traces it). A scalar tensor or array (a learning rate) is
    fed whole to every replica; the others are batches they split."""
    return [a for a in tf.nest.flatten(args) if not python_value(a)]


def python_value(leaf) -> bool:
    """Whether a step's argument leaf is traced as a constant: None, a
    Python bool, number or string."""
    return leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes)) and \
        not isinstance(leaf, np.generic)


def spec(value, i: int, opened=None):
    """The spec a step is traced with for argument leaf `value` (numbered
    `i`): its first dimension unknown (a batch the replicas split; a scalar
    whole); dimensions `opened` leaves open, open too."""
    if isinstance(value, tf.compat.v1.SparseTensorValue):
        value = tf.SparseTensor(*value)
    if isinstance(value, tf.RaggedTensor) and value.ragged_rank == 1 and value.shape.rank == 2:
        return tf.SparseTensorSpec([None, None], value.dtype)   # rows of several lengths
    if isinstance(value, tf.SparseTensor):       # a batch of sparse rows
        if value.shape.rank is not None and value.shape.rank < 1:
            raise GraphError(f"argument leaf {i} of the step is a SparseTensor of no rows; "
                             "every argument is a batch whose first dimension the replicas "
                             "split")
        known = value.shape.as_list()[1:] if value.shape.rank is not None else None
        return tf.SparseTensorSpec(None if known is None else [None] + known, value.dtype)
    try:
        t = tf.convert_to_tensor(value)
    except (TypeError, ValueError) as e:
        data = isinstance(value, (tf.data.Dataset, tf.data.Iterator))
        what = f"a {type(value).__name__}, not a tensor or array"
        if isinstance(value, tf.RaggedTensor):
            what = f"a RaggedTensor of rank {value.shape.rank} and ragged rank " \
                f"{value.ragged_rank}: a batch of rows of several lengths (rank 2, ragged " \
                "rank 1) is split by rows; pass this one padded (x.to_tensor())"
        raise GraphError(f"argument leaf {i} of the step is {what}" + (
            ": a step takes one global batch; iterate outside it and pass the batch (for x, y "
            "in dataset: step(x, y))" if data else "" if isinstance(value, tf.RaggedTensor)
            else f": {e}")) from None
    if t.shape.rank == 0:           # a number every replica takes whole (a learning rate)
        return tf.TensorSpec([], t.dtype, name=INPUT.format(i))
    dims = t.shape.as_list()[1:]
    if opened is not None and opened.rank == t.shape.rank:
        dims = [d if o is not None else None for d, o in zip(dims, opened.as_list()[1:])]
    return tf.TensorSpec([None] + dims, t.dtype, name=INPUT.format(i))
