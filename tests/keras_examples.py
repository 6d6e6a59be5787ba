"""Keras 3 models with the structure of Keras's own examples, small enough
for a test (tests/test_keras_examples.py, tests/tf2_job_script.py):

- `transformer_classifier`: text classification with a Transformer block
  (token and position embeddings, MultiHeadAttention, a feed-forward
  Sequential, two LayerNormalizations, global average pooling, softmax);
- `RecommenderNet`: collaborative filtering as a Model subclass (user and
  movie embeddings and biases, L2-regularized, a dot product, sigmoid);
- `mnist_convnet`: two Conv2D + MaxPooling2D blocks, Flatten, Dropout,
  softmax;
- `structured`: structured-data classification with the lookups in the
  model (an IntegerLookup of a categorical column's codes, its embedding,
  numeric columns), concatenated, Dense, Dropout, sigmoid;
- `bidirectional_lstm`: IMDB's bidirectional LSTM (an embedding, two
  Bidirectional LSTMs, the first returning sequences, sigmoid);
- `captcha_ocr`: the captcha reader (two Conv2D + MaxPooling2D blocks, a
  Reshape to a sequence, Dense, two Bidirectional LSTMs, softmax over the
  characters and a blank) whose `CTCLayer` adds the CTC loss per example
  (`add_loss` of tf.compat.v1.nn.ctc_loss over labels made sparse by a
  tf.compat.v1.scan); compiled with no loss, fed a dict of images and labels.

Each takes `dropout` (the examples' rates by default; 0 for a run that must
equal one device number for number) and `data(name, rows, seed)` gives
inputs and labels for it with the loss and metrics the example compiles
with (`compile_args(name)`).
"""
import keras
import numpy as np
import tensorflow as tf
from keras import layers, ops

VOCAB, MAXLEN, USERS, MOVIES, SIDE = 200, 12, 40, 60, 12


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim, **kwargs):
        super().__init__(**kwargs)
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        positions = ops.arange(start=0, stop=ops.shape(x)[-1], step=1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.1, **kwargs):
        super().__init__(**kwargs)
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                     layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


def transformer_classifier(dropout=0.1, embed_dim=16, num_heads=2, ff_dim=16):
    inputs = layers.Input(shape=(MAXLEN,), dtype="int32")
    x = TokenAndPositionEmbedding(MAXLEN, VOCAB, embed_dim)(inputs)
    x = TransformerBlock(embed_dim, num_heads, ff_dim, dropout)(x)
    x = layers.GlobalAveragePooling1D()(x)
    x = layers.Dropout(dropout)(x)
    x = layers.Dense(20, activation="relu")(x)
    x = layers.Dropout(dropout)(x)
    outputs = layers.Dense(2, activation="softmax")(x)
    return keras.Model(inputs=inputs, outputs=outputs)


class RecommenderNet(keras.Model):
    def __init__(self, num_users, num_movies, embedding_size, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = layers.Embedding(
            num_users, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.user_bias = layers.Embedding(num_users, 1)
        self.movie_embedding = layers.Embedding(
            num_movies, embedding_size, embeddings_initializer="he_normal",
            embeddings_regularizer=keras.regularizers.l2(1e-6))
        self.movie_bias = layers.Embedding(num_movies, 1)

    def call(self, inputs):
        user_vector = self.user_embedding(inputs[:, 0])
        user_bias = self.user_bias(inputs[:, 0])
        movie_vector = self.movie_embedding(inputs[:, 1])
        movie_bias = self.movie_bias(inputs[:, 1])
        dot_user_movie = ops.sum(user_vector * movie_vector, axis=1, keepdims=True)
        x = dot_user_movie + user_bias + movie_bias
        return ops.nn.sigmoid(x)


def recommender(dropout=None, embedding_size=8):
    model = RecommenderNet(USERS, MOVIES, embedding_size)
    model(np.zeros((1, 2), np.int32))           # built: its weights exist
    return model


def mnist_convnet(dropout=0.5):
    return keras.Sequential([
        keras.Input(shape=(SIDE, SIDE, 1)),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(8, kernel_size=(3, 3), activation="relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Flatten(),
        layers.Dropout(dropout),
        layers.Dense(10, activation="softmax"),
    ])


def convnet_sync_bn(dropout=0.5):
    """The MNIST convnet with a synchronized BatchNormalization after each
    convolution, as one adds it for small batches per replica (the
    convolutions without a bias, which the normalization would subtract:
    its gradient is float noise about 0, which Adam scales up to steps of
    its learning rate)."""
    return keras.Sequential([
        keras.Input(shape=(SIDE, SIDE, 1)),
        layers.Conv2D(8, kernel_size=(3, 3), use_bias=False),
        layers.BatchNormalization(synchronized=True),
        layers.Activation("relu"),
        layers.MaxPooling2D(pool_size=(2, 2)),
        layers.Conv2D(8, kernel_size=(3, 3), use_bias=False),
        layers.BatchNormalization(synchronized=True),
        layers.Activation("relu"),
        layers.Flatten(),
        layers.Dropout(dropout),
        layers.Dense(10, activation="softmax"),
    ])


CODES = [3, 7, 12, 19, 25, 31, 40]        # a categorical column's values (a vocabulary)


def structured(dropout=0.3):
    codes = keras.Input(shape=(1,), dtype="int64", name="code")
    numeric = keras.Input(shape=(3,), name="numeric")
    index = layers.IntegerLookup(vocabulary=CODES)(codes)   # unknown codes: index 0
    embedded = layers.Flatten()(layers.Embedding(len(CODES) + 1, 4)(index))
    h = layers.Dense(8, activation="relu")(layers.concatenate([embedded, numeric]))
    outputs = layers.Dense(1, activation="sigmoid")(layers.Dropout(dropout)(h))
    return keras.Model([codes, numeric], outputs)


def bidirectional_lstm(dropout=None, units=4):
    inputs = keras.Input(shape=(MAXLEN,), dtype="int32")
    h = layers.Embedding(VOCAB, 8)(inputs)
    h = layers.Bidirectional(layers.LSTM(units, return_sequences=True))(h)
    h = layers.Bidirectional(layers.LSTM(units))(h)
    return keras.Model(inputs, layers.Dense(1, activation="sigmoid")(h))


def ctc_label_dense_to_sparse(labels, label_lengths):
    """The example's labels as a SparseTensor: the first `label_lengths`
    of each row (a mask grown by tf.compat.v1.scan)."""
    label_shape = ops.shape(labels)
    num_batches_tns, max_num_labels_tns = ops.stack([label_shape[0]]), ops.stack([label_shape[1]])

    def range_less_than(old_input, current_input):
        return ops.expand_dims(ops.arange(ops.shape(old_input)[1]), 0) < tf.fill(
            max_num_labels_tns, current_input)
    init = ops.cast(tf.fill([1, label_shape[1]], 0), dtype="bool")
    dense_mask = tf.compat.v1.scan(range_less_than, label_lengths, initializer=init,
                                   parallel_iterations=1)[:, 0, :]
    label_array = tf.reshape(tf.tile(ops.arange(0, label_shape[1]), num_batches_tns),
                             label_shape)
    label_ind = tf.compat.v1.boolean_mask(label_array, dense_mask)
    batch_array = ops.transpose(tf.reshape(tf.tile(ops.arange(0, label_shape[0]),
                                                   max_num_labels_tns),
                                           tf.reverse(label_shape, [0])), (1, 0))
    batch_ind = tf.compat.v1.boolean_mask(batch_array, dense_mask)
    indices = ops.transpose(ops.reshape(ops.concatenate([batch_ind, label_ind], axis=0),
                                        [2, -1]), (1, 0))
    vals_sparse = tf.compat.v1.gather_nd(labels, indices)
    return tf.SparseTensor(ops.cast(indices, dtype="int64"), vals_sparse,
                           ops.cast(label_shape, dtype="int64"))


def ctc_batch_cost(y_true, y_pred, input_length, label_length):
    label_length = ops.cast(ops.squeeze(label_length, axis=-1), dtype="int32")
    input_length = ops.cast(ops.squeeze(input_length, axis=-1), dtype="int32")
    sparse_labels = ops.cast(ctc_label_dense_to_sparse(y_true, label_length), dtype="int32")
    y_pred = ops.log(ops.transpose(y_pred, axes=[1, 0, 2]) + keras.backend.epsilon())
    return ops.expand_dims(tf.compat.v1.nn.ctc_loss(inputs=y_pred, labels=sparse_labels,
                                                    sequence_length=input_length), 1)


class CTCLayer(layers.Layer):
    def call(self, y_true, y_pred):
        batch_len = ops.cast(ops.shape(y_true)[0], dtype="int64")
        input_length = ops.cast(ops.shape(y_pred)[1], dtype="int64")
        label_length = ops.cast(ops.shape(y_true)[1], dtype="int64")
        input_length = input_length * ops.ones(shape=(batch_len, 1), dtype="int64")
        label_length = label_length * ops.ones(shape=(batch_len, 1), dtype="int64")
        self.add_loss(ctc_batch_cost(y_true, y_pred, input_length, label_length))
        return y_pred

    def compute_output_shape(self, y_true_shape, y_pred_shape):
        return y_pred_shape


def captcha_ocr(dropout=0.2, width=16, height=8, characters=5):
    image = layers.Input(shape=(width, height, 1), name="image", dtype="float32")
    labels = layers.Input(name="label", shape=(None,), dtype="float32")
    h = layers.Conv2D(4, (3, 3), activation="relu", kernel_initializer="he_normal",
                      padding="same")(image)
    h = layers.MaxPooling2D((2, 2))(h)
    h = layers.Conv2D(4, (3, 3), activation="relu", kernel_initializer="he_normal",
                      padding="same")(h)
    h = layers.MaxPooling2D((2, 2))(h)
    h = layers.Reshape(target_shape=(width // 4, (height // 4) * 4))(h)
    h = layers.Dropout(dropout)(layers.Dense(8, activation="relu")(h))
    h = layers.Bidirectional(layers.LSTM(6, return_sequences=True))(h)
    h = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(h)
    h = layers.Dense(characters + 1, activation="softmax", name="dense2")(h)
    return keras.Model([image, labels], CTCLayer(name="ctc_loss")(labels, h))


MODELS = {"transformer": transformer_classifier, "recommender": recommender,
          "convnet": mnist_convnet, "convnet_sync_bn": convnet_sync_bn, "structured": structured,
          "bidirectional_lstm": bidirectional_lstm, "captcha_ocr": captcha_ocr}


def compile_args(name):
    if name == "transformer":         # Keras's example: "adam", its default rate
        return dict(optimizer=keras.optimizers.Adam(1e-3),
                    loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    if name == "recommender":
        return dict(optimizer=keras.optimizers.Adam(learning_rate=0.01),
                    loss=keras.losses.BinaryCrossentropy())
    if name == "captcha_ocr":          # the CTC layer adds the loss
        return dict(optimizer=keras.optimizers.Adam(0.01))
    if name in ("structured", "bidirectional_lstm"):
        return dict(optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy",
                    metrics=["accuracy"])
    return dict(optimizer=keras.optimizers.Adam(0.01), loss="categorical_crossentropy",
                metrics=["accuracy"])


def data(name, rows, seed=0):
    rng = np.random.default_rng(seed)
    if name in ("transformer", "bidirectional_lstm"):
        x = rng.integers(0, VOCAB, size=(rows, MAXLEN)).astype(np.int32)
        return x, (x[:, 0] % 2).astype(np.int32 if name == "transformer" else np.float32)
    if name == "recommender":
        x = np.stack([rng.integers(0, USERS, rows), rng.integers(0, MOVIES, rows)], 1)
        return x.astype(np.int32), ((x[:, 0] + x[:, 1]) % 5 / 4.0).astype(np.float32)
    if name == "structured":         # a code outside the vocabulary now and then
        codes = rng.choice(CODES + [5], size=(rows, 1)).astype(np.int64)
        numeric = rng.normal(size=(rows, 3)).astype(np.float32)
        y = ((codes[:, 0] % 3 == 1) ^ (numeric[:, 0] > 0)).astype(np.float32)
        return [codes, numeric], y
    if name == "captcha_ocr":          # labels in the inputs, none beside them
        return {"image": rng.random((rows, 16, 8, 1)).astype(np.float32),
                "label": rng.integers(0, 5, size=(rows, 2)).astype(np.float32)}, None
    x = rng.random(size=(rows, SIDE, SIDE, 1)).astype(np.float32)
    return x, np.eye(10, dtype=np.float32)[rng.integers(0, 10, rows)]
