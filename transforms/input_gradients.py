"""Input gradients: a traced step's gradient of a mean over the batch with
respect to a tensor, not a variable (`tape.gradient(loss, x)`: FGSM's
perturbation, a penalty on the inputs' gradient, a saliency term), is one
device's on every replica.

One device divides the mean by the global batch's G rows, a replica by
its own G/N, so each row's gradient a replica takes is N times one
device's. A perturbation along the gradient's sign or its direction per
example does not see that; a penalty on the gradient's norm sees it N²
times. The replicas' gradients of variables are averaged for a mean loss,
which makes them one device's; a gradient with respect to the step's rows
is never aggregated, so this pass scales it.

Requires: replicas made by `replicate` of a step traced with its tapes
(graph/recorders.py notes each gradient call whose sources are all
tensors); the step's parts equal (`pn.function` and Keras `fit` run a
batch the replicas do not divide on one device).
Guarantees: where the target is a scalar mean over the batch, every
replica's copy of the gradient's seed (the ones it starts from) is 1/N
(N the job's replicas), so the gradient, and the gradient of anything
computed from it, is one device's. A sum over the batch (a critic's
outputs in WGAN-GP's penalty, a Jacobian's per-example rows) is left as
it is: one device's already. A target the graph does not show as either
(a mean over a count the data sets, a value that mixes the batch) is
named in a warning, and left.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import tensorflow as tf

from parallax_ng.graph import emit, forms, recorders
from parallax_ng.graph.rows import batch_axis, reading


@dataclass(frozen=True)
class InputGradientsPass:
    name: str = "input_gradients"
    requires: tuple = ("replicate",)
    after: tuple = ("counted_draws",)

    def run(self, ir, ctx):
        graph, n = ctx.tg.graph, ctx.plan.group_size
        changed, added, seeds = {}, [], scaled(graph)
        for seed in seeds:
            dtype = graph.get_operation_by_name(seed).outputs[0].dtype
            for k in range(ctx.plan.num_replicas):
                node = ir.node(ctx.replica_name(k, seed))
                share = f"parallax/input_gradients/{node.name}/share"
                added.append(emit.const(share, 1.0 / n, dtype, node.device))
                changed[node.name] = emit.node_def(
                    node.name, "Mul", [node.input[0], share, *node.input[1:]], node.device,
                    T=dtype)
        return ir.replace(changed, added), {"scaled": len(seeds)}


def scaled(graph: tf.Graph) -> list[str]:
    """The seeds (graph/recorders.py SEED ops) of the input gradients of
    `graph` whose targets are scalar means over the batch (and a warning
    naming the targets the graph shows as neither such a mean nor a sum
    over the batch)."""
    data, out, unsure = reading(forms.sources(graph), graph), [], []
    for targets, seeds in recorders.input_gradients(graph):
        try:
            tensors = [graph.get_tensor_by_name(name) for name in targets]
            ops = [graph.get_tensor_by_name(name).op for name in seeds]
        except (KeyError, ValueError):      # in a branch or a loop's body: not in the graph
            continue
        kinds = [_kind(t, data) for t in tensors]
        if set(kinds) == {"mean"}:
            out.extend(op.name for op in ops)
        elif set(kinds) != {"sum"}:
            unsure.extend(t.name for t, kind in zip(tensors, kinds) if kind != "sum")
    if unsure:
        warnings.warn(
            f"the step takes the gradient of {sorted(set(unsure))} with respect to tensors "
            "(tape.gradient of its inputs, not of variables), and the graph does not show "
            "that value as a mean or a sum over the batch: each replica's gradient is of "
            "its own rows' value, which may differ from one device's. A mean "
            "(tf.reduce_mean) or a sum over the examples is exact", stacklevel=3)
    return list(dict.fromkeys(out))


def _kind(t: tf.Tensor, data) -> str | None:
    """"mean" or "sum" over the batch, as the target `t` is, else None."""
    if t.shape.rank != 0:      # a value per example: the gradient sums them
        return "sum" if batch_axis(t, data) is not None else None
    kind, guessed, form = forms.scalar_form(t, data)
    if guessed or form.by_count or form.mixed:
        return None
    return kind
