"""Lookup tables in TF2 steps (parallax_ng/graph/tables.py): a table the
step reads (Keras 3 and tf_keras StringLookup, TextVectorization,
tf.lookup.StaticHashTable) is rebuilt in the training graph with the
entries it has at capture, and N replicas with the global batch equal one
device, every weight and optimizer variable and every loss, 1e-5; a table
the step changes is a GraphError naming it."""
import warnings

import keras            # Keras 3 by name, whatever TF_USE_LEGACY_KERAS says
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local
from parallax_ng.graph import tables
from test_tf2 import check_equal

ROWS, BATCH = 48, 12
WORDS = ["red", "green", "blue", "cyan", "gray"]


def string_data(seed=0):
    """Words (one in six outside the vocabulary) and labels, as a dataset
    of global batches (Keras 3's fit takes strings only from datasets)."""
    rng = np.random.default_rng(seed)
    words = rng.choice(WORDS + ["pink"], size=(ROWS, 2))
    y = np.isin(words[:, 0], WORDS[:2]).astype(np.float32)[:, None]
    return tf.data.Dataset.from_tensor_slices((words, y)).batch(BATCH)


def string_model(lib):
    lib.utils.set_random_seed(5)
    return lib.Sequential([lib.Input((2,), dtype="string"),
                           lib.layers.StringLookup(vocabulary=WORDS[:4]),
                           lib.layers.Embedding(5, 3), lib.layers.Flatten(),
                           lib.layers.Dense(1, activation="sigmoid")])


@pytest.mark.parametrize("lib", ["keras", "tf_keras"])
def test_a_string_lookup_model_fits_as_one_device(lib):
    k = keras if lib == "keras" else pytest.importorskip("tf_keras")
    parallel, single = string_model(k), string_model(k)
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(optimizer=k.optimizers.Adam(0.02), loss="binary_crossentropy")
    pn.parallelize(parallel, local(2))
    h1 = parallel.fit(string_data(), epochs=2, verbose=0)
    h2 = single.fit(string_data(), epochs=2, verbose=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-5, rtol=0)
    check_equal((parallel, parallel.optimizer), (single, single.optimizer))
    graph = parallel._parallax_ng.step.runner.program.tg.graph
    assert [op.name for op in graph.get_operations() if op.type == "HashTableV2"]


def test_text_vectorization_in_the_model_fits_as_one_device():
    texts = np.array(["the red fox", "a blue sky", "red red wine", "grey sky at night",
                      "the fox and the hound", "blue"] * 8)
    y = (np.char.find(texts, "red") >= 0).astype(np.float32)[:, None]

    def make():
        keras.utils.set_random_seed(2)
        vectorize = keras.layers.TextVectorization(max_tokens=12, output_sequence_length=4)
        vectorize.adapt(texts)
        return keras.Sequential([keras.Input((1,), dtype="string"), vectorize,
                                 keras.layers.Embedding(12, 3),
                                 keras.layers.GlobalAveragePooling1D(),
                                 keras.layers.Dense(1, activation="sigmoid")])
    parallel, single = make(), make()
    for m in (parallel, single):
        m.compile(optimizer=keras.optimizers.Adam(0.05), loss="binary_crossentropy")
    pn.parallelize(parallel, local(2))
    data = lambda: tf.data.Dataset.from_tensor_slices((texts[:, None], y)).batch(BATCH)  # noqa
    h1 = parallel.fit(data(), epochs=2, verbose=0)
    h2 = single.fit(data(), epochs=2, verbose=0)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-5, rtol=0)
    check_equal((parallel, parallel.optimizer), (single, single.optimizer))


def weighted_step(table, model, optimizer):
    """A custom loop whose loss weighs each example by its id's entry of a
    StaticHashTable (ids outside it: weight 0.5)."""
    @tf.function
    def step(ids, x, y):
        with tf.GradientTape() as tape:
            weights = table.lookup(ids)
            loss = tf.reduce_mean(weights * tf.square(model(x)[:, 0] - y))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def test_a_static_hash_table_in_a_custom_loop_equals_one_device():
    table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(
        tf.constant([10, 20, 30], tf.int64), tf.constant([1.0, 2.0, 3.0])), 0.5)
    keras.utils.set_random_seed(4)
    models = [keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]) for _ in range(2)]
    models[1].set_weights(models[0].get_weights())
    optimizers = [keras.optimizers.SGD(0.05, momentum=0.9) for _ in range(2)]
    step = pn.function(weighted_step(table, models[0], optimizers[0]), local(2))
    ref = weighted_step(table, models[1], optimizers[1])
    rng = np.random.default_rng(1)
    for _ in range(5):
        ids = rng.choice([10, 20, 30, 40], size=8).astype(np.int64)
        x = rng.normal(size=(8, 3)).astype(np.float32)
        y = rng.normal(size=8).astype(np.float32)
        # a scalar, as one device's (the lookup's shape, set in Python, is kept)
        loss = step(ids, x, y)
        assert np.shape(loss) == ()
        np.testing.assert_allclose(loss, ref(ids, x, y), atol=1e-5, rtol=0)
    step.sync()
    check_equal((models[0], optimizers[0]), (models[1], optimizers[1]))


def test_a_table_the_step_changes_is_refused_by_name():
    table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.0)
    w = tf.Variable(1.0)

    def step(ids):
        table.insert(ids, tf.ones_like(ids, tf.float32))
        w.assign_add(tf.reduce_sum(table.lookup(ids)))
        return w
    with pytest.raises(pn.GraphError, match=r"which is not a variable, and changes it "
                                            r"\(LookupTableInsertV2\).*rebuilt"):
        pn.function(step, local(2))(np.array([1, 2], np.int64))


def test_a_dataset_iterator_read_inside_the_step_is_refused_saying_to_pass_batches():
    """`next(iterator)` in the step: the error says to pass each batch as
    the step's arguments (before: "... a dataset iterator or another
    resource is not", with nothing on what to write instead)."""
    iterator = iter(tf.data.Dataset.from_tensor_slices(np.ones((8, 2), np.float32)).batch(4))
    w = tf.Variable(1.0)

    def step(scale):
        w.assign_add(scale * tf.reduce_mean(next(iterator)))
        return w
    with pytest.raises(pn.GraphError, match=r"reads a dataset iterator .*next\(iterator\).* "
                                            r"pass it as the step's arguments"):
        pn.function(step, local(2))(np.float32(1.0))


def test_summaries_written_inside_the_step_are_refused_saying_where_to_write_them(tmp_path):
    writer = tf.summary.create_file_writer(str(tmp_path))
    w = tf.Variable(1.0)

    def step(x):
        w.assign_add(tf.reduce_mean(x))
        with writer.as_default():
            tf.summary.write("w", w.read_value(), step=1)     # what tf.summary.scalar writes
        return w
    with pytest.raises(pn.GraphError, match=r"writes summaries through .*outside the step"):
        pn.function(step, local(2))(np.array([1.0, 2.0], np.float32))


def test_a_tables_users_are_found_through_identities():
    g = tf.Graph()
    with g.as_default():
        h = tf.compat.v1.placeholder(tf.resource, name="captured")
        same = tf.identity(h, name="same")
        find = tf.raw_ops.LookupTableFindV2(table_handle=same, keys=tf.constant([1], tf.int64),
                                            default_value=tf.constant(0.0), name="find")
        size = tf.raw_ops.LookupTableSizeV2(table_handle=h, name="size")
    assert {n.name for n in tables._users(g.as_graph_def(), "captured")} == {"find", "size"}
    del find, size
    made = tf.Graph()
    with made.as_default():
        handle, fill = tables.make(tables.Table(np.array([b"a", b"b"]), np.array([4, 5]),
                                                tf.string, tf.int64), "t")
        found = tf.raw_ops.LookupTableFindV2(table_handle=handle, keys=tf.constant(["b", "z"]),
                                             default_value=tf.constant(-1, tf.int64))
        with tf.compat.v1.Session() as sess:
            sess.run(fill)
            sess.run(fill)             # filling again is harmless (the initializer reruns)
            assert sess.run(found).tolist() == [5, -1]


def tf1_table_regression(batch, mutable=False):
    """A TF1 graph: ids mapped by a StaticHashTable (tables_initializer; or
    a MutableHashTable filled by the init op) to a weight each, then a
    dense layer; Adam."""
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        rng = np.random.RandomState(5)
        ids = rng.choice([10, 20, 30, 40], size=48).astype(np.int64)
        xs, ys = rng.randn(48, 3).astype(np.float32), rng.randn(48, 1).astype(np.float32)
        ds = pn.shard(tf.data.Dataset.from_tensor_slices((ids, xs, ys))).batch(batch).repeat()
        it = tf1.data.make_initializable_iterator(ds)
        i, x, y = it.get_next()
        keys, values = tf.constant([10, 20, 30], tf.int64), tf.constant([1.0, 2.0, 3.0])
        if mutable:
            table = tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, 0.5)
            fill = table.insert(keys, values)
        else:
            table = tf.lookup.StaticHashTable(tf.lookup.KeyValueTensorInitializer(keys, values),
                                              0.5)
            fill = tf1.tables_initializer()
        w = tf1.get_variable("w", initializer=rng.randn(3, 1).astype(np.float32))
        pred = tf.matmul(x, w) * table.lookup(i)[:, None]
        train = tf1.train.AdamOptimizer(0.05).minimize(tf.reduce_mean(tf.square(pred - y)))
        init = tf.group(tf1.global_variables_initializer(), fill)
    return g, {"init": init, "iterator_init": it.initializer, "train": train}


def test_a_tf1_table_is_filled_again_when_training_moves_to_a_new_graph():
    """`profile.replan: always` rebuilds the graph after the first step and
    moves every variable to a new session: the table is filled there again,
    and 6 steps equal one device (1e-5). A mutable table's entries cannot
    move: the graph stays, with a warning that says so, and still trains
    as one device."""
    from models import train_both
    config = {"run_option": "allreduce", "profile": {"replan": "always"}}
    for mutable in (False, True):
        seen = {}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            parallel, single, names = train_both(lambda b: tf1_table_regression(b, mutable), 2,
                                                 6, local(2), config, seen=seen)
        said = [str(w.message) for w in caught if "mutable tables" in str(w.message)]
        assert bool(said) == mutable, said
        for name in names:
            for got in parallel[name]:
                assert np.max(np.abs(got - single[name])) <= 1e-5, (mutable, name)
