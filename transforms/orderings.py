"""Orderings that survive Grappler: every reader of one output of an IdentityN
of several tensors reads it through an Identity of its own.

A TF2 step orders a read of a variable before a later write of it by a
control edge. Grappler's dependency optimizer drops such an edge where it
finds another path from the read to the write, and it finds paths node by
node: a path through an IdentityN of several tensors (`tf.custom_gradient`'s
outputs and gradients, a Keras 3 optimizer's gradients) counts, though the
IdentityN's k-th output depends on its k-th input alone. In the same round
it removes the IdentityN, wiring each reader to the input it passes on, and
the path is gone with it: the read may then run after the write. So a
`tf.recompute_grad` block reads the second layer's weights again in the
backward pass, for the first layer's gradient, while the second layer's
update is ordered after that read only through the optimizer's IdentityN of
both gradients; where the update wins the race, the first layer's gradient
uses updated weights (one device's tf.function has the same race; measured:
0.067 apart after 4 steps, once in several runs of a busy host).

Requires: nothing (the graph every other pass made; it runs last).
Guarantees: each data reader of output k of an IdentityN of several data
inputs reads `<identity_n>/output_<k>`, an Identity of input k with the
IdentityN's control inputs, on its device; the IdentityN stays, for its
control readers and for fetches by name. Nothing else changes.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.graph import emit
from parallax_ng.graph.ir import TensorRef, format_input


@dataclass(frozen=True)
class OrderingsPass:
    name: str = "orderings"
    requires: tuple = ("replicate",)
    after: tuple = ("aggregate", "colocate_updates", "columns", "counted_draws", "horizontal",
                    "init", "input_gradients", "local_aggregation", "lookups_on_servers",
                    "distinct_lookups", "part_writes", "place", "prefetch",
                    "selected_means", "server_sync", "shard_inputs", "shard_variables",
                    "split_step", "state_sync")

    def run(self, ir, ctx):
        out, split = split_identity_n(ir)
        return out, {"split": split}


def split_identity_n(ir):
    """(`ir` with the readers of every IdentityN of several tensors reading
    Identities of their own, how many IdentityNs were split). An output
    that passes on another IdentityN's output is an Identity of that one's
    Identity (tf.custom_gradient's gradients passed on by an optimizer's)."""
    names = {}      # (IdentityN, output) -> its Identity, for outputs that have readers
    for node in ir.nodes:
        data = ir.data_inputs(node.name) if node.op == "IdentityN" else []
        for k in range(len(data) if len(data) > 1 else 0):
            if ir.consumers.get(TensorRef(node.name, k)):
                name = f"{node.name}/output_{k}"
                while name in ir:
                    name += "_"
                names[TensorRef(node.name, k)] = name
    rewires, added = {}, []
    for ref, name in names.items():
        node = ir.node(ref.node)
        source = ir.data_inputs(ref.node)[ref.index]
        controls = [f"^{src}" for src in ir.control_inputs(ref.node)]
        read = names.get(source) or format_input(source.node, source.index)
        added.append(emit.node_def(name, "Identity", [read] + controls, node.device,
                                   T=tf.dtypes.as_dtype(node.attr["T"].list.type[ref.index])))
        rewires.update({(user, pos): name for user, pos in ir.consumers[ref]})
    return ir.rewire(rewires, added), len({ref.node for ref in names})
