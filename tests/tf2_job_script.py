"""A Keras 3 custom training loop as one worker of a job (tests/test_tf2.py):
`pn.function` on a global batch; saves the model's starting weights (its
own, seeded apart: models.worker_seed) and the model's and optimizer's variables after training
(after `step.sync()`) to OUT.<worker>.npz.

    python tf2_job_script.py OUT STEPS [--fit | --example NAME | --bn] [--horovod]

Without flags, the loop also saves as a one-device script would, on every
worker: a CheckpointManager's checkpoint after each step (ckpts/ beside
OUT) and `model.save_weights` at the end (loop.weights.h5).

With --fit, `pn.parallelize(model)` and `model.fit` on the global batches
(STEPS batches of 8 rows, one epoch; a ModelCheckpoint and a
BackupAndRestore saving every 2 batches, `model.save` after: files
fit.weights.h5, backup/ and fit.keras beside OUT) instead of a custom
loop, then `evaluate` and `predict` (saved); with
--example NAME, the same with a model of tests/keras_examples.py (dropout
off), run option `hybrid` with sparse gradients pinned to the server
(hybrid weighs ps against allgather by the measured network, which differs
between machines; with --clipnorm, Adam with `global_clipnorm` and the
dense variables by all-reduce beside the server; with --network B, config
`network` of B bytes/s and no latency; with --dense-method M, config
`dense_method: M` (--sparse-method M: `sparse_method: M`); with --default-config, nothing
pinned; `communication.timeout_seconds` 150 in every case); with --horovod, a rank of horovodrun (the loop or --fit,
`communication.backend: horovod`); with --bn, test_keras_fit's BatchNormalization model by
`model.fit` on STEPS global batches of 16 (with --ps, run option `ps`: its
variables on the resource file's server); with --sparse, test_tf2's bags of
ids (a tf.SparseTensor argument; with --ragged too, the same rows as a
tf.RaggedTensor the step makes sparse) by a custom loop, Keras 3 Adagrad (the
table saved as `table`); with --selected, test_selected_means's loop (a
mean over the rows a mask picks, Adam(0.05)); with --dice, test_batch_sums's
loop (a Dice loss, SGD with momentum; with --ps, run option `ps`; with
--balanced, its mean per class instead).
"""
import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import parallax_ng as pn  # noqa: E402
from models import worker_seed  # noqa: E402
from test_tf2 import data, keras3_dense, step_of  # noqa: E402

keras.utils.set_random_seed(worker_seed(11))

out, steps = sys.argv[1], int(sys.argv[2])
model = keras3_dense()                      # worker 0's values are broadcast
optimizer = keras.optimizers.Adam(0.01)
x, y = data()
config = {"run_option": "allreduce"}
resources = None                            # the job's (parallax-ng run)
if "--horovod" in sys.argv:                 # a rank of horovodrun, one device each
    from models import local
    resources = local(1)
    config["communication"] = {"backend": "horovod", "timeout_seconds": 120}
extra = {}
if "--example" in sys.argv:
    import keras_examples as ex
    name = sys.argv[sys.argv.index("--example") + 1]
    model = ex.MODELS[name](dropout=0.0)
    args = ex.compile_args(name)
    # the default config with --default-config, else sparse pinned to the server
    config = {} if "--default-config" in sys.argv else {"sparse_method": "ps"}
    # a step that hangs ends the job with its error, and the launcher's line
    # on the task that held it, inside the test's 300 s
    config["communication"] = {"timeout_seconds": 150}
    if "--clipnorm" in sys.argv:            # Keras's global-norm clipping, dense by a ring
        args["optimizer"] = keras.optimizers.Adam(1e-3, global_clipnorm=1.0)
        config["dense_method"] = "allreduce"
    if "--dense-method" in sys.argv:        # pinned, not weighed by the measured network
        config["dense_method"] = sys.argv[sys.argv.index("--dense-method") + 1]
    if "--sparse-method" in sys.argv:
        config["sparse_method"] = sys.argv[sys.argv.index("--sparse-method") + 1]
    if "--network" in sys.argv:             # the links' bandwidth (bytes/s), no latency
        config["network"] = {"bandwidth": float(sys.argv[sys.argv.index("--network") + 1]),
                             "latency": 0.0}
    optimizer = args["optimizer"]
    model.compile(**args)
    x, y = ex.data(name, steps * 8)
if "--bn" in sys.argv:
    from test_keras_fit import BATCH, bn_data, bn_model
    model = bn_model(keras, False)
    optimizer, config = model.optimizer, {"run_option": "ps"} if "--ps" in sys.argv else None
    x, y = bn_data(False, steps * BATCH)
if "--sparse" in sys.argv:                  # a SparseTensor batch, its rows split
    from test_tf2 import bag_model, sparse_bags
    train_bags, table, model, optimizer = bag_model(40)
if "--dice" in sys.argv:
    import test_batch_sums as bs
    model, optimizer = bs.dice_model(), keras.optimizers.SGD(0.5, momentum=0.9)
    x, y = bs.arrays()
    if "--ps" in sys.argv:
        config = {"run_option": "ps"}
if "--selected" in sys.argv:
    import test_selected_means as sm
    optimizer = keras.optimizers.Adam(0.05)
    x, y = sm.arrays()
start = model.get_weights()
if "--bn" in sys.argv:
    pn.parallelize(model, None, config)
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    step = model._parallax_ng.step
elif "--example" in sys.argv:
    pn.parallelize(model, None, config)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    step = model._parallax_ng.step
    extra = {"evaluated": np.array(model.evaluate(x, y, batch_size=8, verbose=0)),
             "on_model": np.array(json.dumps(model._parallax_ng.on_model))}
elif "--fit" in sys.argv:
    from test_state_sync import r_squared      # centres the batch: on the job's mean
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae", r_squared])
    pn.parallelize(model, resources, config)
    # what a one-device script saves, unchanged: every worker writes the same
    # paths (test_tf2.py reads them)
    folder = os.path.dirname(os.path.abspath(out))
    model.fit(x[:steps].reshape(-1, 5), y[:steps].reshape(-1, 1), batch_size=8, epochs=1,
              shuffle=False, verbose=0, callbacks=[
                  keras.callbacks.ModelCheckpoint(os.path.join(folder, "fit.weights.h5"),
                                                  save_weights_only=True, save_freq=2),
                  keras.callbacks.BackupAndRestore(os.path.join(folder, "backup"), save_freq=2,
                                                   delete_checkpoint=False)])
    model.save(os.path.join(folder, "fit.keras"))
    step = model._parallax_ng.step
    # evaluate on the replicas (its last batch of 3 rows on the model), predict on the model
    evaluated = model.evaluate(x.reshape(-1, 5)[:43], y.reshape(-1, 1)[:43], batch_size=8,
                               verbose=0)
    predicted = model.predict(x.reshape(-1, 5)[:43], batch_size=8, verbose=0)
    extra = {"evaluated": np.array(evaluated), "predicted": predicted,
             "on_model": np.array(json.dumps(model._parallax_ng.on_model))}
    try:                # a second compile, once a job trains: refused by name
        model.compile(optimizer=optimizer, loss="mae")
    except pn.ConfigError as e:
        extra["recompiled"] = np.array(str(e))
elif "--dice" in sys.argv:
    step = pn.function(bs.step_of(model, optimizer, bs.class_balanced if "--balanced" in
                                  sys.argv else bs.dice), resources, config)
    for k in range(steps):
        step(x[k * bs.BATCH:(k + 1) * bs.BATCH], y[k * bs.BATCH:(k + 1) * bs.BATCH])
elif "--selected" in sys.argv:
    step = pn.function(sm.step_of(model, optimizer), resources, config)
    for k in range(steps):
        step(x[k * sm.BATCH:(k + 1) * sm.BATCH], y[k * sm.BATCH:(k + 1) * sm.BATCH])
elif "--sparse" in sys.argv:
    ragged = "--ragged" in sys.argv     # rows of several lengths, made sparse in the step
    step = pn.function((lambda ids, y: train_bags(ids.to_sparse(), y)) if ragged else
                       train_bags, resources, config)
    for k in range(steps):
        bags, y = sparse_bags(k, 40)
        step(tf.RaggedTensor.from_sparse(bags) if ragged else bags, y)
else:
    step = pn.function(step_of(model, optimizer), resources, config)
    # the loop as written for one device saves after every step, on every
    # worker to the same paths (test_tf2.py reads them)
    folder = os.path.dirname(os.path.abspath(out))
    manager = tf.train.CheckpointManager(tf.train.Checkpoint(model=model, optimizer=optimizer),
                                         os.path.join(folder, "ckpts"), max_to_keep=2)
    for k in range(steps):
        step(x[k], y[k])
        if len(sys.argv) == 3:
            step.sync()
            manager.save()
    if len(sys.argv) == 3:
        model.save_weights(os.path.join(folder, "loop.weights.h5"))
worker = step.runner.plan.worker
step.sync()
if "--sparse" in sys.argv:
    extra["table"] = table.numpy()
plan = {v: ("alike " if v in step.runner.ctx.tg.rows_alike else "") + vp.method
        for v, vp in step.runner.plan.variables.items()}
sources = {v: vp.info.alpha_source for v, vp in step.runner.program.plan.variables.items()
           if vp.info.sparse}          # the plan the graph was built with
np.savez(f"{out}.{worker}.npz", plan=np.array(json.dumps(plan)),
         sources=np.array(json.dumps(sources)),
         **{f"start{i}": w for i, w in enumerate(start)},
         **{f"w{i}": np.asarray(w) for i, w in enumerate(model.weights)},
         **{f"o{i}": np.asarray(v) for i, v in enumerate(optimizer.variables)}, **extra)
print(f"worker {worker} of {step.runner.plan.num_workers}: done", flush=True)
