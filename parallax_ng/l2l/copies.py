"""Copies: the user's nodes imported into the layer-by-layer graph, whole
(variables, data, the update path, on the host) or as one layer's copy for
one replica's micro-batch.

Requires: the user's NodeDefs by name (with its function library and
versions), the graph being built, the host device. Guarantees: `copy`
imports the nodes it is given with their inputs mapped as asked (see its
docstring); a ValueError from TensorFlow when a copy does not fit (the
builder names the cause).
"""
from __future__ import annotations

import tensorflow as tf

from .. import compat
from ..errors import GraphError
from ..graph.ir import parse_input
from .draws import halve, stateless


class Copies:
    def __init__(self, nodes: dict, library, versions, graph, user_graph, host: str,
                 scope: str):
        self.nodes, self.library, self.versions = nodes, library, versions
        self.graph, self.user, self.host, self.scope = graph, user_graph, host, scope

    def copy(self, names, prefix: str, input_map: dict, device: str, keep_controls=(),
             drop=frozenset(), on_host=frozenset(), half=False, seeds=None,
             rewire=None) -> dict[str, tf.Operation]:
        """Import the user's nodes `names` (devices and colocation dropped);
        inputs from nodes outside come from `input_map` (tensor name ->
        tensor), or from the node of the same name in the graph; control
        inputs from outside are kept when they name nodes in
        `keep_controls`, else dropped; so are the control inputs from nodes
        in `drop` of nodes outside it. Nodes in `on_host` go on the host
        (resource ops on the host's variables). With `half`, the other nodes
        compute in float16 (cross mixed precision): their float32 types and
        constants become float16, and a host node's float32 output is cast
        on its way to them. A random op in `seeds` (name -> int64 [2]
        tensor) becomes its stateless kind drawing with that seed; `rewire`
        (name -> {input index: tensor}) replaces nodes' inputs."""
        names = set(names)
        gd = tf.compat.v1.GraphDef()
        gd.versions.CopyFrom(self.versions)
        gd.library.CopyFrom(self.library)
        imap, controls = {}, {}
        for name in names:
            node = gd.node.add()
            node.CopyFrom(self.nodes[name])
            for index, value in (rewire or {}).get(name, {}).items():
                key = f"{self.scope}/micro_batch_constant/{name}/{index}:0"
                input_map = {**input_map, key: value}
                node.input[index] = key
            if seeds and name in seeds:
                key = f"{self.scope}/seed_of/{name}:0"
                input_map = {**input_map, key: seeds[name]}
                stateless(node, key)
            node.device = self.host if name in on_host else ""
            if "_class" in node.attr:
                del node.attr["_class"]
            inputs = list(node.input)
            del node.input[:]
            for ref in inputs:
                src, index, _ = parse_input(ref)
                key = f"{src}:{index}"
                if not ref.startswith("^") and key in input_map:
                    imap[key] = input_map[key]
                    node.input.append(key)
                elif src in names:
                    if not (ref.startswith("^") and src in drop and name not in drop):
                        node.input.append(ref)
                elif ref.startswith("^"):
                    if src in keep_controls:
                        controls.setdefault(name, []).append(src)
                else:
                    if prefix:
                        raise GraphError(f"layer-by-layer execution: {name!r} reads {key!r}, "
                                         "which is in no earlier layer")
                    else:
                        imap[key] = self.graph.get_tensor_by_name(key)
                    node.input.append(key)
        if half:        # random draws stay float32 (the same numbers as fp32), then cast
            halve(gd, set(on_host) | set(seeds or ()), self.user)
        with tf.device(device):
            ops = tf.graph_util.import_graph_def(
                gd, input_map=imap, name=prefix, return_elements=sorted(names))
        made = {name: op for name, op in zip(sorted(names), ops)}
        for name, srcs in controls.items():
            compat.add_control_inputs(made[name], [self.graph.get_operation_by_name(s)
                                                   for s in srcs])
        return made
