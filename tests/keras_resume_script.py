"""`model.fit` under `pn.parallelize` with `checkpoint.dir`, as one run of a
program that is stopped and started again (tests/test_keras_fit.py):

    python keras_resume_script.py OUT CHECKPOINT_DIR EPOCHS INITIAL_EPOCH

Builds test_keras_fit's model and optimizer (the same names in every run),
fits the test's data to EPOCHS from INITIAL_EPOCH on 2 local replicas,
checkpointing every epoch (5 steps), and saves the starting weights, the
trained weights and the optimizer's variables to OUT.npz.
"""
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras  # noqa: E402
import numpy as np  # noqa: E402

import parallax_ng as pn  # noqa: E402
from models import local  # noqa: E402
from test_keras_fit import BATCH, data, make  # noqa: E402

out, directory, epochs, initial = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
model = make()
start = model.get_weights()
model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])
pn.parallelize(model, local(2), {"checkpoint": {"dir": directory, "every_steps": 5}})
x, y = data()
history = model.fit(x, y, batch_size=BATCH, epochs=epochs, initial_epoch=initial,
                    shuffle=False, verbose=0)
np.savez(out, loss=np.array(history.history["loss"]),
         **{f"start{i}": w for i, w in enumerate(start)},
         **{f"w{i}": np.asarray(w) for i, w in enumerate(model.weights)},
         **{f"o{i}": np.asarray(v) for i, v in enumerate(model.optimizer.variables)})
