"""The user's graph, read and written: the front end.

`frontend.load` turns a tf.Graph (or a MetaGraphDef) into a TrainingGraph:
a read-only GraphIR (ir.py) with its variables, gradients, readers and
writers; the op tables every layer consults (rules.py); which feeds are
batches (batch.py), which nodes differ between replicas (variance.py,
randomness.py) and how queue input is filled (queues.py); `emit` builds
new nodes. The user-facing graph helpers live here too: `shard` (data.py)
and `partitioner` (partition.py), and `capture`, which runs a script until
it calls get_runner.

May import: parallax_ng.errors, .compat, .config, .resources, .cluster.
"""
