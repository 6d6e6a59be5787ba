"""The specs a TF2 step is traced with (parallax_ng/graph/step_specs.py)."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from parallax_ng.graph.step_specs import INPUT, spec, tensor_leaves


def test_the_leaves_fed_and_the_specs_a_step_is_traced_with():
    """Batches with their first dimension open (the replicas split it), a
    scalar whole, opened dimensions open, a ragged batch as its sparse rows;
    Python values are not fed; a dataset is no batch (named, with the way
    to pass one)."""
    x, lr = np.zeros((4, 6), np.float32), np.float32(0.1)
    args = (x, lr, None, True, 3)
    assert [id(a) for a in tensor_leaves(args)] == [id(x), id(lr)]
    assert spec(x, 0) == tf.TensorSpec([None, 6], tf.float32, name=INPUT.format(0))
    assert spec(lr, 1).shape.rank == 0
    assert spec(x, 0, tf.TensorShape([None, None])).shape.as_list() == [None, None]
    ragged = tf.ragged.constant([[1, 2], [3]])
    assert spec(ragged, 2) == tf.SparseTensorSpec([None, None], tf.int32)
    with pytest.raises(pn.GraphError, match="argument leaf 3 of the step is a .*Dataset.*for x, "
                                            "y in dataset: step"):
        spec(tf.data.Dataset.range(3), 3)
