"""Files a program writes, in a job: every worker runs the script, so every
worker makes its saves, at the same paths, with the same values.

Requires: Keras 3 or tf_keras models (only what the program imported is
touched).
Guarantees: `whole_files(save)` is a model's `save` or `save_weights` that
writes a one-file format (`.keras`, `.weights.h5`, `.h5`) to a hidden file
beside the path and moves it onto the path once complete: workers sharing
a disk each replace the file whole (writing it in place, the second writer
met HDF5's file lock, "unable to lock file", and the job ended), every
host has its own copy to load, and a process killed while saving leaves
the last complete file; every other path is written as Keras writes it.
`whole_saves_in_jobs()` makes every model class's saves so in a worker of
a job (a custom loop saves its own model, which `pn.function` does not
see), and makes TensorFlow's eager checkpoint writes (`tf.train.Checkpoint`,
CheckpointManager, SavedModel) one worker at a time on a shared directory
(`one_writer`, which `runner.save` holds too: a TF1 Saver with `sharded=True`
writes its shards there the same way); `pn.parallelize` wraps its model's
saves in any process. `saved_by` is a TF1 Saver's `save` through a runner.
`synced_saves` and `synced_restores` run what a caller gives before every
eager save, and around every eager restore, of the process.
`backups_apart(callbacks)` gives each BackupAndRestore of a worker other
than 0 a directory of its own. A worker is a task of `parallax-ng run` or
of an orchestrator (TF_CONFIG), or a rank of horovodrun.
"""
from __future__ import annotations

import contextlib
import fcntl
import functools
import inspect
import os
import sys
import threading

# the endings of the paths Keras writes as one file (else a directory, or a
# TensorFlow checkpoint's files, each of which TensorFlow moves into place)
ONE_FILE = (".weights.h5", ".keras", ".hdf5", ".h5")

# the model classes whose save methods write those: Keras 3's, tf_keras's
MODEL_CLASSES = (("keras.src.models.model", "Model"),
                 ("tf_keras.src.engine.training", "Model"))
# a layer's (a model's) set_weights, which `synced_restores` treats as a restore
LAYER_SETS = (("keras.src.layers.layer", "Layer", "set_weights"),
              ("tf_keras.src.engine.base_layer", "Layer", "set_weights"))


def whole_files(save):
    """`save` (a model's bound `save` or `save_weights`, and so every
    callback that saves through them: ModelCheckpoint, BackupAndRestore)
    writing one-file formats whole (module docstring)."""
    if getattr(save, "_whole", False):
        return save
    signature = inspect.signature(save)

    @functools.wraps(save)
    def saved(filepath, *args, **kwargs):
        given = signature.bind(filepath, *args, **kwargs).arguments
        path = os.fspath(filepath) if isinstance(filepath, (str, os.PathLike)) else ""
        ending = next((e for e in ONE_FILE if path.endswith(e)), None)
        if ending is None or "://" in path or given.get("max_shard_size") or \
                given.get("zipped") is False or \
                given.get("save_format") not in (None, "h5", "keras") or \
                (not given.get("overwrite", True) and os.path.exists(path)):
            return save(filepath, *args, **kwargs)   # as Keras writes it (or asks)
        folder, name = os.path.split(os.path.abspath(path))
        temporary = os.path.join(folder, f".{name}.{os.getpid()}-{threading.get_ident()}"
                                         f"{ending}")
        try:
            out = save(temporary, *args, **kwargs)
            os.replace(temporary, path)
        except Exception as e:      # Keras's refusal names the path it was given: the user's
            if temporary not in str(e):
                raise
            try:
                told = type(e)(str(e).replace(temporary, path))
            except Exception:
                raise e from None
            raise told.with_traceback(e.__traceback__) from None
        finally:
            if os.path.exists(temporary):
                os.remove(temporary)
        return out
    saved._whole = True
    return saved


def worker() -> int | None:
    """This process's worker index in a job: `parallax-ng run`'s or an
    orchestrator's (TF_CONFIG), or a Horovod rank (horovodrun sets
    HOROVOD_RANK); None outside a job, or in a job's server."""
    from .cluster import from_env
    job = from_env()
    if job is not None:
        return job.task if job.task_type == "worker" else None
    rank = os.environ.get("HOROVOD_RANK", os.environ.get("OMPI_COMM_WORLD_RANK"))
    return int(rank) if rank is not None and rank.isdigit() else None


def whole_saves_in_jobs() -> None:
    """In a worker of a job: the `save` and `save_weights` of every model
    class the program has imported write one-file formats whole, and
    TensorFlow's checkpoint writes hold their directory (once per
    process)."""
    if worker() is None:
        return
    _one_writer_at_a_time()
    for module, name in MODEL_CLASSES:
        cls = getattr(sys.modules.get(module), name, None)
        for method in ("save", "save_weights"):
            original = None if cls is None else cls.__dict__.get(method)
            if original is None or getattr(original, "_whole", False):
                continue

            def whole(self, filepath, *args, _original=original, **kwargs):
                return whole_files(_original.__get__(self))(filepath, *args, **kwargs)
            whole = functools.wraps(original)(whole)
            whole._whole = True
            setattr(cls, method, whole)


_SYNCS: list = []       # what runs before every save (`synced_saves`)


def synced_saves(sync) -> None:
    """`sync()` first in every eager save of the process: TensorFlow's
    checkpoint writes and the model classes' `save` and `save_weights`
    (once per process), so a save between a step's calls writes what the
    replicas trained, not the program's older values (a pn.function step's
    large weights reach the program only at `step.sync()`)."""
    if sync in _SYNCS:
        return
    _SYNCS.append(sync)
    from tensorflow.python.checkpoint import functional_saver
    targets = [(functional_saver.MultiDeviceSaver, "save")] + [
        (cls, method) for module, name in MODEL_CLASSES
        if (cls := getattr(sys.modules.get(module), name, None)) is not None
        for method in ("save", "save_weights")]

    def synced(original):
        def wrapper(self, *args, **kwargs):
            if _eager():
                for each in list(_SYNCS):
                    each()
            return original(self, *args, **kwargs)
        return wrapper
    _wrap_methods(targets, "_synced", synced)


_AROUND_RESTORES: list = []     # (before, after) every restore (`synced_restores`)
_RESTORING = [0]                # restores under way (a model's load_weights reads a checkpoint)


def synced_restores(before, after) -> None:
    """`before()` and `after()` around every eager restore of the process:
    TensorFlow's checkpoint reads (`tf.train.Checkpoint.restore` and `read`,
    a CheckpointManager's), the model classes' `load_weights` and the layer
    classes' `set_weights` (once per process, the outermost restore only),
    so that a restore between a step's calls reaches the replicas (before:
    the next call went on from their values, silently)."""
    if (before, after) in _AROUND_RESTORES:
        return
    _AROUND_RESTORES.append((before, after))
    from tensorflow.python.checkpoint import functional_saver
    targets = [(functional_saver.MultiDeviceSaver, "restore")] + [
        (cls, method) for module, name, method in
        [(module, name, "load_weights") for module, name in MODEL_CLASSES] + list(LAYER_SETS)
        if (cls := getattr(sys.modules.get(module), name, None)) is not None]

    def restored(original):
        def wrapper(self, *args, **kwargs):
            outermost = _eager() and not _RESTORING[0]
            for first, _ in list(_AROUND_RESTORES) if outermost else ():
                first()
            _RESTORING[0] += 1
            try:
                out = original(self, *args, **kwargs)
            finally:
                _RESTORING[0] -= 1
            for _, then in list(_AROUND_RESTORES) if outermost else ():
                then()
            return out
        return wrapper
    _wrap_methods(targets, "_restores", restored)


def _wrap_methods(targets, flag: str, wrap) -> None:
    """Replace each (class, method name) of `targets` that the class itself
    defines by `wrap(method)`, once: the wrapper keeps the method's name,
    docs and flags (`_whole`) and is marked with `flag`."""
    for cls, method in targets:
        original = cls.__dict__.get(method)
        if original is None or getattr(original, flag, False):
            continue
        wrapped = functools.wraps(original)(wrap(original))
        setattr(wrapped, flag, True)
        setattr(cls, method, wrapped)


def _eager() -> bool:
    import tensorflow as tf
    return tf.executing_eagerly()


def backups_apart(callbacks) -> None:
    """On a job's workers but worker 0, each BackupAndRestore (Keras 3's,
    tf_keras's) made anew with `<backup_dir>.worker-<i>` for its directory:
    every worker writes and restores a backup of its own (one device's
    values on each, saved at the same batches), where sharing one they
    raced to make it (FileExistsError ended the job) and to delete it."""
    index = worker()
    if not index:
        return
    for callback in callbacks:
        folder = getattr(callback, "backup_dir", None)
        if type(callback).__name__ != "BackupAndRestore" or not isinstance(folder, str) \
                or folder.endswith(f".worker-{index}"):
            continue
        made = inspect.signature(type(callback).__init__).parameters
        kept = {name: getattr(callback, name) for name in made
                if name not in ("self", "backup_dir") and hasattr(callback, name)}
        callback.__init__(f"{folder.rstrip('/')}.worker-{index}", **kept)


def _one_writer_at_a_time() -> None:
    """TensorFlow's eager checkpoint writes (`tf.train.Checkpoint.save` and
    `write`, a CheckpointManager's saves, SavedModel's variables) hold an
    exclusive lock on the directory they write to: a write puts its shards
    in `<prefix>_temp/`, a name that two workers writing one prefix share,
    and the first to finish merged its shards and deleted that directory
    under the other (the job ended: "MergeV2Checkpoints ... did not
    exist"). One after the other, each write's files are moved into place
    whole, with the same values."""
    from tensorflow.python.checkpoint import functional_saver
    cls = functional_saver.MultiDeviceSaver
    original = cls.__dict__["save"]
    if getattr(original, "_whole", False):
        return

    @functools.wraps(original)
    def save(self, file_prefix, *args, **kwargs):
        # (a symbolic prefix, whose write runs later, elsewhere: not held)
        with one_writer(folder_of(file_prefix)):
            return original(self, file_prefix, *args, **kwargs)
    save._whole = True
    cls.save = save


@contextlib.contextmanager
def one_writer(folder: str | None):
    """An exclusive lock on directory `folder` (made if missing) while the
    block runs: checkpoint writes of the processes sharing it, one at a
    time. None (`folder_of` a remote or symbolic prefix): no lock."""
    if folder is None:
        yield
        return
    os.makedirs(folder, exist_ok=True)
    handle = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)          # (and the lock with it)


def saved_by(runner, graph, saver, path: str, **kwargs) -> str:
    """`saver.save(session, path, **kwargs)` (a tf.compat.v1.train.Saver of
    the user's `graph`) with the runner's runs for the session's: the
    prefix `path-<global_step>`, the state file `tf.train.latest_checkpoint`
    reads, `max_to_keep` and the meta graph of `graph`, as on one device. A
    job's workers all save one path (a sharded Saver's shards then share
    `<path>_temp/`): one at a time."""
    from tensorflow.python.client.session import SessionInterface

    class Session(SessionInterface):
        graph, sess_str = property(lambda self: graph), property(lambda self: "")

        def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
            return runner.run(fetches, feed_dict)

    with one_writer(folder_of(path)), graph.as_default():
        return saver.save(Session(), path, **kwargs)


def folder_of(prefix) -> str | None:
    """The local directory of a checkpoint prefix given as a string or an
    eager string tensor; None for a remote path ("gs://...") or a
    symbolic tensor."""
    if hasattr(prefix, "numpy"):
        try:
            prefix = prefix.numpy()
        except (AttributeError, NotImplementedError, ValueError):
            return None
    if isinstance(prefix, bytes):
        prefix = prefix.decode()
    if not isinstance(prefix, (str, os.PathLike)) or "://" in os.fspath(prefix):
        return None
    return os.path.dirname(os.path.abspath(os.fspath(prefix)))
