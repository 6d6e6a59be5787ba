"""Layer-to-layer execution: models deeper than the device memory.

layers.py cuts the forward pass into layers; builder.py builds the graph
that runs them one at a time over micro-batches; eps.py is the eager
parameter server on the host; runner.py drives it.

May import: parallax_ng.runtime and every layer below it.
"""
