"""graph/selections.py on small graphs: rows a mask of the batch picks (by
tf.boolean_mask, tf.gather at tf.where, tf.gather_nd, and row-wise
functions of them) and what is not so picked; the forms a loss over them
takes (graph/forms.py: a mean is `selected`, a sum a sum); the gradient's
divisions by a selected mean's count; a mean taken into rows again."""
import numpy as np
import tensorflow as tf

from parallax_ng.graph import forms, selections

tf1 = tf.compat.v1


def graph():
    """Tensors of a graph with a batch of rows x [b, 3], targets y [b] and
    lengths [b] of 4 tokens: picked rows and others."""
    g = tf.Graph()
    t = {}
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        y = tf1.placeholder(tf.float32, [None], name="y")
        lengths = tf1.placeholder(tf.int32, [None], name="lengths")
        w = tf1.get_variable("w", initializer=np.ones((3, 1), np.float32))
        pred = tf.squeeze(tf.matmul(x, w), 1)
        keep = y > 0
        t["masked"] = tf.boolean_mask(pred - y, keep)
        t["gathered"] = tf.gather(pred, tf.where(keep)[:, 0])
        t["squeezed"] = tf.gather(pred, tf.squeeze(tf.where(keep), 1))
        t["gather_nd"] = tf.gather_nd(pred, tf.where(keep))
        t["row-wise"] = tf.square(tf.boolean_mask(pred, keep) - tf.boolean_mask(y, keep)) * 2.0
        t["rows-times-weight"] = tf.reduce_sum(
            tf.matmul(tf.boolean_mask(x, keep), w), 1)
        tokens = tf.tile(x[:, :1], [1, 4])                         # [b, 4]
        t["tokens"] = tf.boolean_mask(tokens, tf.sequence_mask(lengths, 4))
        t["partitioned"] = tf.dynamic_partition(pred, tf.cast(keep, tf.int32), 2)[1]
        # not picked from the batch: a constant's rows, a mask of constants, a fixed gather
        table = tf.constant(np.arange(6, dtype=np.float32))
        t["of-a-constant"] = tf.boolean_mask(table, table > 2)
        t["fixed-indices"] = tf.gather(pred, [0, 1])
        t["along-axis-1"] = tf.gather(x, tf.where(tf.constant([True, False, True]))[:, 0],
                                      axis=1)
        t["rows"], t["whole"] = pred, tf.reduce_mean(pred)
        t["size"] = tf.size(t["masked"])
        t["length"] = tf.cast(tf.shape(t["gathered"])[0], tf.float32)
        t["batch size"] = tf.size(pred)
        t["mean"] = tf.reduce_mean(t["masked"])
        t["sum"] = tf.reduce_sum(t["gathered"])
        t["rmse"] = tf.sqrt(tf.reduce_mean(tf.square(t["masked"])))
        t["centre"] = tf.reduce_mean(t["gathered"])
        t["centred"] = t["gathered"] - t["centre"]        # a normalization of rows by it
        t["gradient"] = tf.gradients(t["mean"], [w])[0]
    return g, t


def test_rows_a_mask_of_the_batch_picks_and_others():
    g, t = graph()
    sources = forms.sources(g)
    for name in ("masked", "gathered", "squeezed", "gather_nd", "row-wise",
                 "rows-times-weight", "tokens", "partitioned"):
        assert selections.picked(t[name], sources), name
    for name in ("of-a-constant", "fixed-indices", "along-axis-1", "rows", "mean"):
        assert not selections.picked(t[name], sources), name


def test_a_mean_of_picked_rows_is_a_selected_mean_and_a_sum_of_them_a_sum():
    g, t = graph()
    sources = forms.sources(g)
    read = {k: forms.loss_form(t[k], sources, None, strict=False)
            for k in ("mean", "sum", "rmse")}
    assert read["mean"].kind == "mean" and read["mean"].selected == [t["mean"].op.name]
    assert read["sum"].kind == "sum" and read["sum"].selected == []
    mean = t["rmse"].op.inputs[0]           # the square root's mean: the job's, and selected
    assert read["rmse"].kind == "mean" and read["rmse"].exchanged == [mean.name]
    assert read["rmse"].selected == [mean.op.name] != [t["mean"].op.name]
    whole = forms.loss_form(t["whole"], sources, None, strict=False)
    assert whole.kind == "mean" and whole.selected == []    # every row: no count to share


def test_the_gradient_divides_a_selected_means_sum_by_its_count():
    g, t = graph()
    divisions = selections.gradient_divisions(t["mean"].op)
    assert [d.type for d in divisions] == ["RealDiv"]
    assert divisions[0].name.startswith(f"gradients/{t['mean'].op.name}_grad/")
    assert selections.gradient_divisions(t["rmse"].op.inputs[0].op) == []   # no gradient


def test_a_mean_that_flows_into_scalars_only_and_one_taken_into_rows():
    g, t = graph()
    sources = forms.sources(g)
    assert selections.used_per_row(t["mean"].op, sources) is None     # its gradient aside
    assert selections.used_per_row(t["centre"].op, sources) == t["centred"].op.name


def test_a_count_of_picked_rows_adds_up_over_the_replicas():
    g, t = graph()
    sources = forms.sources(g)
    for name in ("size", "length"):
        assert selections.counted(t[name].op, sources), name
        assert forms.loss_form(t[name], sources, None, strict=False).kind == "sum", name
    assert not selections.counted(t["batch size"].op, sources)      # (rows.counts_rows's)
    assert not selections.counted(t["mean"].op, sources)


def test_a_deep_chain_of_row_wise_ops_is_read_briefly():
    """picked walks at most a few row-wise ops back: a deep model's
    activations (here 3,000 ops from the data) answer False at once,
    where a walk to the data would pass Python's recursion limit."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 3], name="x")
        h = x
        for _ in range(1500):
            h = tf.tanh(h + 1.0)
        picked_late = tf.boolean_mask(x, x[:, 0] > 0)
        for _ in range(3):
            picked_late = tf.abs(picked_late) * 2.0
    sources = forms.sources(g)
    assert not selections.picked(h, sources)
    assert selections.picked(picked_late, sources)
