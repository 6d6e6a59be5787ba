"""A Keras 3 model's `fit`, data-parallel by one added line: a bag-of-words
classifier (an embedding and dense layers) on synthetic data, with
validation and a checkpoint callback.

    python examples/keras_fit.py [--epochs 3] [--resources configs/resources_2cpu.yaml]
"""
import argparse
import os
import tempfile

os.environ.setdefault("TF_USE_LEGACY_KERAS", "0")   # TensorFlow's default Keras: Keras 3

import keras  # noqa: E402
import numpy as np  # noqa: E402

import parallax_ng as pn  # noqa: E402

VOCAB, LENGTH = 2000, 12


def dataset(n: int, seed: int):
    """Sequences of word ids; a positive one has 'good' words (ids below
    100) among its random words, a negative one 'bad' words (100-199)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 2, size=n)
    x = rng.integers(200, VOCAB, size=(n, LENGTH))
    marked = rng.random((n, LENGTH)) < 0.3
    words = rng.integers(0, 100, size=(n, LENGTH)) + 100 * (1 - y)[:, None]
    x[marked] = words[marked]
    return x.astype(np.int32), y.astype(np.float32)[:, None]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--resources", help="resource YAML (default: this machine)")
    parser.add_argument("--config", help="config YAML (default: hybrid)")
    args = parser.parse_args()

    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((LENGTH,), dtype="int32"),
        keras.layers.Embedding(VOCAB, 16),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(16, activation="relu"),
        keras.layers.Dense(1, activation="sigmoid"),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                  metrics=["accuracy"])
    pn.parallelize(model, args.resources, args.config)      # the added line

    x, y = dataset(2048, 0)
    vx, vy = dataset(512, 1)
    with tempfile.TemporaryDirectory() as tmp:
        saved = os.path.join(tmp, "model.weights.h5")
        history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=2,
                            validation_data=(vx, vy),
                            callbacks=[keras.callbacks.ModelCheckpoint(
                                saved, save_weights_only=True)])
        assert os.path.exists(saved)
    runner = model._parallax_ng.step.runner
    print(f"val_accuracy {history.history['val_accuracy'][-1]:.3f} "
          f"({runner.plan.num_replicas} replicas; embedding by "
          f"{runner.plan.variables[[v for v in runner.plan.variables if 'embedding' in v][0]].method})")


if __name__ == "__main__":
    main()
