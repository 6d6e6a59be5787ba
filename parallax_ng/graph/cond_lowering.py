"""Lowering: a tf.cond of TF2 behavior whose branch writes a variable, as
Switch/Merge ops the passes can see into.

A graph built with tf.compat.v1 ops but TF2 behavior (control flow v2)
makes tf.cond a functional `If`: its branches are functions of the graph's
library, and a write inside one (tf.compat.v1.layers.batch_normalization's
moving statistics under a `training` tensor; an optimizer applied under a
condition) is out of every pass's reach. TensorFlow's runtime lowers such
an If to Switch/Merge before it runs the graph (LowerFunctionalOpsPass);
`lowered` does the same before the analysis, for the Ifs whose branches
write a variable handle they take, so their writes are synced like those
of v1 control flow.

The lowered If keeps its name (an IdentityN of its outputs, in order, or a
NoOp where it has none), so every tensor a user fetches or feeds keeps
its name; the branches' ops are named under `<If>/lowered/then|else/`.
Each branch runs all of its ops (the function's semantics): the If's
outputs wait on every op its taken branch has.

Requires: a tf.Graph. Guarantees: the graph itself when it has no such If;
otherwise a new graph (the user's is not modified) imported from the
user's meta graph (collections, savers, queue runners as
`import_meta_graph` restores them, with no Saver of its own added:
`imported`) with each such If lowered, nested ones included.
"""
from __future__ import annotations

import tensorflow as tf
from tensorflow.python.framework import function_def_to_graph, meta_graph

from . import branches

LOWERED = ("If", "StatelessIf")
_MOST_ROUNDS = 32           # nested conds, lowered one level per round


def lowered(graph: tf.Graph, *more, also=()) -> tf.Graph:
    """`graph`, or a copy of it with every If that writes a variable (or
    that a function of `also`, graph_def -> If names, names) lowered and
    then the edits `more` names (None: no edit) made, in one copy."""
    def targets(graph_def) -> list[str]:
        return sorted({name for find in (_writing_ifs, *also) for name in find(graph_def)})

    def lower(meta):
        for _ in range(_MOST_ROUNDS):
            if not (found := targets(meta.graph_def)):
                break
            _lower(meta.graph_def, found)
    writes = any(op.type in LOWERED for op in graph.get_operations()) and \
        bool(targets(graph.as_graph_def()))
    edits = [lower] * writes + [e for e in more if e is not None]
    if not edits:
        return graph
    return copied(graph, lambda meta: [e(meta) for e in edits])


def copied(graph: tf.Graph, edit=None) -> tf.Graph:
    """`graph` again, under the same names and seed, from its meta graph
    (`edit`ed first, where given); the user's graph is left as it is."""
    with graph.as_default():
        meta = tf.compat.v1.train.export_meta_graph(clear_devices=False)
    if edit is not None:
        edit(meta)
    _top_level_collections(meta)
    out = tf.Graph()
    out.seed = graph.seed
    with out.as_default():
        imported(meta)
    for key in graph.get_all_collection_keys():       # names the export made bytes
        if (names := graph.get_collection(key)) and all(isinstance(n, str) for n in names):
            out.get_collection_ref(key)[:] = names
    return out


def imported(meta) -> None:
    """Import MetaGraphDef `meta` (its ops, collections and queue runners)
    into the default graph, as `tf.compat.v1.train.import_meta_graph` does,
    but for the Saver that one builds where `meta` names none: its restore
    ops would write every variable (a gradient accumulator would have a
    writer that neither zeroes nor adds to it, and be no accumulator), and
    the program never made them."""
    meta_graph.import_scoped_meta_graph(meta, clear_devices=False)


def _top_level_collections(meta) -> None:
    """Collections keep only the graph's own ops: an op a branch's function
    made (an optimizer applied under the cond) can be listed in the graph's
    collections by its name in the function, which the import cannot find."""
    names = {n.name for n in meta.graph_def.node}
    for collection in meta.collection_def.values():
        if collection.HasField("node_list"):
            kept = [v for v in collection.node_list.value
                    if v.lstrip("^").split(":")[0] in names]
            del collection.node_list.value[:]
            collection.node_list.value.extend(kept)


def _writing_ifs(graph_def) -> list[str]:
    """The If ops whose branches write a variable handle they take."""
    library = {f.signature.name: f for f in graph_def.library.function}
    out = []
    for node in graph_def.node:
        if node.op not in LOWERED:
            continue
        args = sum(1 for i in node.input if not i.startswith("^")) - 1
        if any(branches.writes(library, f, k) for f in branches.functions(node.attr)
               for k in range(args)):
            out.append(node.name)
    return out


def _lower(graph_def, targets: list[str]) -> None:
    library = {f.signature.name: f for f in graph_def.library.function}
    taken = {n.name for n in graph_def.node}
    kept, added = [], []
    for node in graph_def.node:
        if node.name not in targets:
            kept.append(node)
            continue
        added += _Lowering(node, library, taken).nodes
    del graph_def.node[:]
    graph_def.node.extend(kept + added)


class _Lowering:
    """The Switch, branch, Merge and IdentityN ops that replace one If."""

    def __init__(self, node, library: dict, taken: set):
        self.node, self.taken, self.nodes = node, taken, []
        data = [i for i in node.input if not i.startswith("^")]
        controls = [i for i in node.input if i.startswith("^")]
        pred, args = data[0], data[1:]
        self.base = self._name(f"{node.name}/lowered", scope=True)
        types = list(node.attr["Tin"].list.type)
        tout = list(node.attr["Tout"].list.type)
        switch = self._add("Switch", "pred", [pred, pred] + controls, T=tf.bool.as_datatype_enum)
        switched = [self._add("Switch", f"input_{k}", [a, pred] + controls, T=types[k])
                    for k, a in enumerate(args)]
        outputs, done = {}, {}
        for key, port in (("else_branch", 0), ("then_branch", 1)):
            side = key.split("_")[0]
            pivot = self._add("Identity", f"{side}/pivot", [f"{switch}:{port}"],
                              T=tf.bool.as_datatype_enum)
            fdef = library[node.attr[key].func.name]
            outputs[port], sinks = self._inline(fdef, f"{self.base}/{side}/",
                                                [f"{s}:{port}" for s in switched], pivot)
            done[port] = self._add("Identity", f"{side}/done",
                                   [pivot] + [f"^{s}" for s in sinks], T=tf.bool.as_datatype_enum)
        merges = [self._add("Merge", f"output_{j}", [outputs[0][j], outputs[1][j]], T=t, N=2)
                  for j, t in enumerate(tout)]
        executed = self._add("Merge", "executed", [done[0], done[1]],
                             T=tf.bool.as_datatype_enum, N=2)
        last = tf.compat.v1.NodeDef(name=node.name, device=node.device,
                                    op="IdentityN" if tout else "NoOp")
        last.input.extend([f"{m}:0" for m in merges] + [f"^{executed}"])
        if tout:
            last.attr["T"].list.type.extend(tout)
        self.nodes.append(last)

    def _inline(self, fdef, prefix: str, args: list[str], pivot: str):
        """The branch's ops under `prefix`, its arguments read from `args`:
        (its outputs, its ops nothing else in it reads)."""
        body, flat = function_def_to_graph.function_def_to_graph_def(fdef)
        params = {a.name: args[k] for k, a in enumerate(fdef.signature.input_arg)}
        read = set()
        for nd in body.node:
            read.update(i.lstrip("^").split(":")[0] for i in nd.input)
        sinks = []
        for nd in body.node:
            if nd.name in params:          # the argument's placeholder: its switched input
                self._add("Identity", None, [params[nd.name]], name=prefix + nd.name,
                          T=nd.attr["dtype"].type)
                continue
            copy = tf.compat.v1.NodeDef()
            copy.CopyFrom(nd)
            copy.name = prefix + nd.name
            self.taken.add(copy.name)
            del copy.input[:]
            copy.input.extend(_renamed(i, prefix) for i in nd.input)
            if not nd.input:
                copy.input.append(f"^{pivot}")
            if "_class" in copy.attr:       # colocation with the function's own names
                del copy.attr["_class"]
            copy.device = copy.device or self.node.device
            self.nodes.append(copy)
            if nd.name not in read:
                sinks.append(copy.name)
        outputs = [_renamed(flat[fdef.ret[a.name]], prefix) for a in fdef.signature.output_arg]
        return outputs, sinks

    def _add(self, op: str, what: str | None, inputs: list[str], name: str | None = None,
             **attrs) -> str:
        nd = tf.compat.v1.NodeDef(name=name or self._name(f"{self.base}/{what}"), op=op,
                                  device=self.node.device)
        self.taken.add(nd.name)
        nd.input.extend(inputs)
        for key, value in attrs.items():
            if key == "N":
                nd.attr[key].i = value
            else:
                nd.attr[key].type = value
        self.nodes.append(nd)
        return nd.name

    def _name(self, want: str, scope: bool = False) -> str:
        """`want`, or `want_K`: a name no op has (`scope`: nor starts with)."""
        name, k = want, 1
        while name in self.taken or scope and any(t.startswith(name + "/") for t in self.taken):
            name, k = f"{want}_{k}", k + 1
        self.taken.add(name)
        return name


def _renamed(ref: str, prefix: str) -> str:
    return "^" + prefix + ref[1:] if ref.startswith("^") else prefix + ref
