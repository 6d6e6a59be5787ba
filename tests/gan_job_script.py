"""Keras's GAN example (tests/test_keras_train_steps.py `GAN`, latents
from the batch; with --wgan its `WGAN`, the gradient penalty's WGAN-GP
with the critic once a step) as one worker of a job: `pn.parallelize` and
`model.fit` on STEPS global batches of 8; saves the starting weights
(seeded apart on each worker: models.worker_seed; worker 0's are
broadcast), the weights, both optimizers' variables and the history to
OUT.<worker>.npz.

    python gan_job_script.py OUT STEPS CONFIG_JSON [--wgan]
"""
import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "0"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import keras  # noqa: E402
import numpy as np  # noqa: E402

import parallax_ng as pn  # noqa: E402
from models import worker_seed  # noqa: E402
from test_keras_train_steps import (GAN, WGAN, compile_gan, compile_wgan,  # noqa: E402
                                    gan_data, wgan_data)

out, steps, config = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
keras.utils.set_random_seed(worker_seed(5))
wgan = "--wgan" in sys.argv
model = WGAN() if wgan else GAN()
(compile_wgan if wgan else compile_gan)(model)
start = model.get_weights()
pn.parallelize(model, None, config)
real, noise = wgan_data() if wgan else gan_data()
history = model.fit(real[:8 * steps], noise[:8 * steps], batch_size=8, epochs=1,
                    shuffle=False, verbose=0)
runner = model._parallax_ng.step.runner
optimizers = model.d_optimizer.variables + model.g_optimizer.variables
np.savez(f"{out}.{runner.plan.worker}.npz",
         methods=np.array(json.dumps({v: vp.method for v, vp in runner.plan.variables.items()})),
         history=np.array(json.dumps(history.history)),
         **{f"start{i}": w for i, w in enumerate(start)},
         **{f"w{i}": np.asarray(w) for i, w in enumerate(model.weights)},
         **{f"o{i}": np.asarray(v) for i, v in enumerate(optimizers)})
print(f"worker {runner.plan.worker}: done", flush=True)
