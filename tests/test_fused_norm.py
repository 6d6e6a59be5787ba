"""The fused batch normalization kernel lowered (graph/fused_norm.py): on
one device it computes what the kernel does, outputs and gradients; where
another op reads what the kernel keeps, it stays fused. (2 replicas
against one device: tests/test_normalization.py.)"""
import numpy as np
import pytest
import tensorflow as tf

from parallax_ng.graph import cond_lowering, fused_norm

tf1 = tf.compat.v1


@pytest.mark.parametrize("layout,dtype,version", [
    ("NHWC", tf.float32, "V3"), ("NCHW", tf.float32, "V3"), ("NHWC", tf.float16, "V3"),
    ("NHWC", tf.float32, "V1")])
def test_the_lowered_kernel_computes_what_the_fused_one_does(layout, dtype, version):
    """On one device the lowered fused op (`fused_norm.edit`)
    gives the kernel's outputs and gradients: the normalized values, the
    unbiased batch variance, the moving statistics it moves with an
    averaging factor, and the gradients of x, scale and offset, for both
    layouts (NCHW, the GPU's, against the kernel on the transposed
    batch), float16 values and the first op version; 1e-5 (float16: its
    rounding, 2e-3)."""
    rng = np.random.RandomState(0)
    batch = (rng.randn(6, 3, 4, 2) * 2 + 1).astype(np.float32)     # NHWC
    weight = rng.randn(6, 3, 4, 2).astype(np.float32)
    moving = [rng.rand(2).astype(np.float32) for _ in range(2)]

    def build(fmt, factor):
        g = tf.Graph()
        with g.as_default():
            x = tf1.placeholder(dtype, [None, 3, 4, 2] if fmt == "NHWC" else [None, 2, 3, 4])
            scale, offset = tf.constant([1.5, 0.5]), tf.constant([0.2, -0.1])
            if version == "V1":
                y, mean, var = tf1.nn.fused_batch_norm(x, scale, offset, data_format=fmt,
                                                       is_training=True)
            else:
                y, mean, var, *_ = tf.raw_ops.FusedBatchNormV3(
                    x=x, scale=scale, offset=offset, mean=moving[0], variance=moving[1],
                    epsilon=1e-3, exponential_avg_factor=factor, data_format=fmt,
                    is_training=True)
            w = weight if fmt == "NHWC" else weight.transpose(0, 3, 1, 2)
            grads = tf.gradients(tf.reduce_sum(tf.cast(y, tf.float32) * w), [x, scale, offset])
        return g, x, [y, mean, var] + grads

    tol = 2e-3 if dtype == tf.float16 else 1e-5
    for factor in (1.0, 0.3) if version == "V3" else (1.0,):
        g, x, outs = build(layout, factor)
        low = cond_lowering.lowered(g, fused_norm.edit(g))
        assert not any(op.type.startswith("FusedBatchNorm") for op in low.get_operations())
        fed = batch if layout == "NHWC" else batch.transpose(0, 3, 1, 2)
        with tf1.Session(graph=low) as sess:
            got = sess.run([t.name for t in outs], {x.name: fed.astype(dtype.as_numpy_dtype)})
        g, x, outs = build("NHWC", factor)
        with tf1.Session(graph=g) as sess:
            want = sess.run(outs, {x: batch.astype(dtype.as_numpy_dtype)})
        if layout == "NCHW":
            got[0], got[3] = (a.transpose(0, 2, 3, 1) for a in (got[0], got[3]))
        for k, (a, b) in enumerate(zip(got, want)):
            np.testing.assert_allclose(np.float32(a), np.float32(b), atol=tol, rtol=tol,
                                       err_msg=f"output {k}, factor {factor}")


def test_a_kernel_whose_reserve_space_another_op_reads_stays_fused():
    """Only a forward op whose reserve spaces feed its one gradient op
    (and tf.gradients' zeros of them) is lowered: another reader would get
    what the kernel keeps there no more."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2, 2, 3])
        y, _, _, reserve, *_ = tf.raw_ops.FusedBatchNormV3(
            x=x, scale=tf.ones([3]), offset=tf.zeros([3]), mean=tf.zeros([0]),
            variance=tf.zeros([0]), is_training=True)
        tf.identity(reserve, name="reads_it")
        tf.gradients(tf.reduce_sum(y), [x])
    low = cond_lowering.lowered(g, fused_norm.edit(g))
    assert [op.type for op in low.get_operations() if op.type.startswith("FusedBatchNorm")] == \
        ["FusedBatchNormV3", "FusedBatchNormGradV3"]
