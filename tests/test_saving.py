"""parallax_ng/saving.py: a model's saves to one-file formats are written
whole (a hidden file moved onto the path), other paths as Keras writes
them; in a job's task every model class saves so, and BackupAndRestore
keeps a directory per worker. (Two workers saving one path in a job:
tests/test_tf2.py's job tests.)"""
import json
import os

import keras  # Keras 3 by name, whatever TF_USE_LEGACY_KERAS says
import numpy as np
import pytest

from parallax_ng import saving


def model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def hidden(folder):
    return [p for p in os.listdir(folder) if p.startswith(".")]


@pytest.mark.parametrize("name", ["m.weights.h5", "m.keras"])
def test_a_save_replaces_the_file_whole_and_leaves_nothing_beside_it(tmp_path, name):
    m = model()
    path = tmp_path / name
    save = saving.whole_files(m.save_weights if name.endswith(".weights.h5") else m.save)
    save(path)
    first = os.stat(path).st_ino
    m.layers[0].kernel.assign(np.ones([3, 2], np.float32))
    save(str(path))
    assert os.stat(path).st_ino != first        # a new file moved onto the path
    assert hidden(tmp_path) == []
    loaded = model()
    if name.endswith(".weights.h5"):
        loaded.load_weights(path)
    else:
        loaded = keras.models.load_model(path)
    np.testing.assert_array_equal(loaded.layers[0].kernel.numpy(), np.ones([3, 2]))


class Failing(keras.layers.Dense):
    """A layer whose variables cannot be written (a save that fails midway)."""
    def save_own_variables(self, store):
        raise OSError("disk full")


def test_a_save_that_fails_leaves_the_last_complete_file(tmp_path):
    path = tmp_path / "m.weights.h5"
    m = model()
    saving.whole_files(m.save_weights)(path)
    before = path.read_bytes()
    broken = keras.Sequential([keras.Input((3,)), Failing(2)])
    with pytest.raises(OSError, match="disk full"):
        saving.whole_files(broken.save_weights)(path)
    assert path.read_bytes() == before and hidden(tmp_path) == []


def test_other_paths_and_arguments_go_to_keras_as_given(tmp_path):
    """A path of no one-file format (tf_keras's TensorFlow checkpoint, its
    SavedModel directory) is Keras's to write; `overwrite=False` on an
    existing file is Keras's to ask about."""
    import tf_keras
    m = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    saving.whole_files(m.save_weights)(str(tmp_path / "ckpt"))
    saving.whole_files(m.save)(str(tmp_path / "saved"))
    assert {"ckpt.index", "checkpoint"} <= set(os.listdir(tmp_path))
    assert "saved_model.pb" in os.listdir(tmp_path / "saved")
    calls = []

    def save(filepath, overwrite=True):        # Keras's signature; it writes the path
        calls.append(filepath)
        with open(filepath, "w") as f:
            f.write(str(overwrite))
    saving.whole_files(save)(str(tmp_path / "new.h5"), overwrite=False)
    assert calls[0] != str(tmp_path / "new.h5")           # through a hidden file
    saving.whole_files(save)(str(tmp_path / "new.h5"), overwrite=False)
    assert calls[1] == str(tmp_path / "new.h5")           # Keras asks, as it would


def job(monkeypatch, task):
    monkeypatch.setenv("PARALLAX_NG_CLUSTER", json.dumps(
        {"worker": ["127.0.0.1:1", "127.0.0.1:2"], "ps": [], "task_type": "worker",
         "task": task, "devices": [["CPU", 0]]}))


@pytest.fixture
def patched():
    """The methods `whole_saves_in_jobs` replaces, (class, name, original);
    put back after the test."""
    import tf_keras
    from tensorflow.python.checkpoint import functional_saver
    kept = [(c, name, c.__dict__[name]) for c in (keras.src.models.model.Model,
                                                  tf_keras.src.engine.training.Model)
            for name in ("save", "save_weights")]
    kept.append((functional_saver.MultiDeviceSaver, "save",
                 functional_saver.MultiDeviceSaver.__dict__["save"]))
    yield kept
    for c, name, f in kept:
        setattr(c, name, f)


def test_in_a_job_every_model_class_saves_whole(monkeypatch, tmp_path, patched):
    import tf_keras
    saving.whole_saves_in_jobs()                  # in no job: untouched
    assert all(c.__dict__[name] is f for c, name, f in patched)
    job(monkeypatch, 1)
    saving.whole_saves_in_jobs()
    saving.whole_saves_in_jobs()                  # once
    assert all(c.__dict__[name]._whole and c.__dict__[name].__wrapped__ is f
               for c, name, f in patched)
    m = tf_keras.Sequential([tf_keras.Input((3,)), tf_keras.layers.Dense(2)])
    m.save(tmp_path / "t.h5")
    model().save_weights(tmp_path / "k.weights.h5")
    assert sorted(os.listdir(tmp_path)) == ["k.weights.h5", "t.h5"]
    assert saving.whole_files(m.save) == m.save    # not wrapped twice


def test_a_backup_of_a_worker_but_the_first_goes_to_a_directory_of_its_own(
        monkeypatch, tmp_path):
    import tf_keras
    backups = [keras.callbacks.BackupAndRestore(str(tmp_path / "b"), save_freq=3,
                                                delete_checkpoint=False),
               tf_keras.callbacks.BackupAndRestore(str(tmp_path / "t") + "/", save_freq=2)]
    job(monkeypatch, 0)
    saving.backups_apart(backups)
    assert [b.backup_dir for b in backups] == [str(tmp_path / "b"), str(tmp_path / "t") + "/"]
    job(monkeypatch, 1)
    saving.backups_apart(backups)
    saving.backups_apart(backups)                 # once
    assert [b.backup_dir for b in backups] == [str(tmp_path / "b.worker-1"),
                                               str(tmp_path / "t.worker-1")]
    assert (backups[0].save_freq, backups[0].delete_checkpoint, backups[1].save_freq) == \
        (3, False, 2)
    assert backups[0]._weights_path == str(tmp_path / "b.worker-1" / "latest.weights.h5")


def test_a_horovod_rank_is_a_worker(monkeypatch):
    monkeypatch.delenv("PARALLAX_NG_CLUSTER", raising=False)
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.delenv("OMPI_COMM_WORLD_RANK", raising=False)
    monkeypatch.delenv("HOROVOD_RANK", raising=False)
    assert saving.worker() is None
    monkeypatch.setenv("HOROVOD_RANK", "1")
    assert saving.worker() == 1
    job(monkeypatch, 0)                     # parallax-ng run's word first
    assert saving.worker() == 0


def test_in_a_job_a_checkpoint_write_waits_for_the_directory(monkeypatch, tmp_path, patched):
    """A `tf.train.Checkpoint` write holds its directory's lock: one worker
    writing while another does (their shards share `<prefix>_temp/`) waits
    for it, then writes whole; a symbolic prefix (a write run later) is
    left as it is."""
    import fcntl
    import threading

    import tensorflow as tf
    from tensorflow.python.checkpoint import functional_saver
    job(monkeypatch, 1)
    v = tf.Variable([1.0, 2.0])
    folder = tmp_path / "ckpts"
    folder.mkdir()
    saving.whole_saves_in_jobs()
    assert functional_saver.MultiDeviceSaver.save.__wrapped__ is patched[-1][2]
    held = os.open(folder, os.O_RDONLY)
    fcntl.flock(held, fcntl.LOCK_EX)          # another worker's write
    done = []
    writer = threading.Thread(target=lambda: done.append(
        tf.train.Checkpoint(v=v).write(str(folder / "c"))), daemon=True)
    writer.start()
    writer.join(1.0)
    assert writer.is_alive() and not done and os.listdir(folder) == []
    os.close(held)
    writer.join(60)
    assert done and {"c.index", "c.data-00000-of-00001"} <= set(os.listdir(folder))
    assert saving.folder_of(b"x/y") == os.path.abspath("x") and \
        saving.folder_of(tf.constant("z/c")) == os.path.abspath("z")
    with tf.Graph().as_default():
        assert saving.folder_of(tf.constant("z/c")) is None
    assert saving.folder_of("gs://bucket/c") is None


def test_a_runner_saves_with_the_directory_held(tmp_path):
    """`runner.save` with a sharded TF1 Saver (its shards in
    `<path>_temp/`, which a job's workers saving one path would share)
    waits for the directory, then writes a checkpoint that loads."""
    import fcntl
    import threading

    import tensorflow as tf

    import parallax_ng as pn
    from models import local
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2])
        w = tf1.get_variable("w", initializer=tf.ones([2, 1]))
        tf1.train.GradientDescentOptimizer(0.1).minimize(
            tf.reduce_mean(tf.matmul(x, w)), name="train")
        saver = tf1.train.Saver(sharded=True)
        init = tf1.global_variables_initializer()
    folder = tmp_path / "ckpts"
    folder.mkdir()
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        runner.run(init)
        runner.run("train", {x: np.ones([4, 2], np.float32)})
        held = os.open(folder, os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)
        done = []
        writer = threading.Thread(target=lambda: done.append(
            runner.save(saver, str(folder / "m"))), daemon=True)
        writer.start()
        writer.join(1.0)
        assert writer.is_alive() and not done and os.listdir(folder) == []
        os.close(held)
        writer.join(60)
        assert done and not writer.is_alive()
    np.testing.assert_allclose(tf.train.load_checkpoint(done[0]).get_tensor("w"),
                               [[0.9], [0.9]], rtol=1e-6)


def test_keras_refusing_a_path_names_the_path_given(tmp_path):
    """Keras 3's `save_weights` takes `.weights.h5` only; its error names
    the path the program gave, not the hidden file's."""
    path = str(tmp_path / "w.h5")
    with pytest.raises(ValueError) as refused:
        saving.whole_files(model().save_weights)(path)
    assert path in str(refused.value) and ".w.h5." not in str(refused.value)
    assert hidden(tmp_path) == []
