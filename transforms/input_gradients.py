"""Input gradients: a step's gradient of a mean over the batch with respect
to a tensor, not a variable (`tape.gradient(loss, x)` in a traced step,
`tf.gradients(loss, x)` in a TF1 graph: FGSM's perturbation, a penalty on
the inputs' gradient, a saliency term), is one device's on every replica.

One device divides the mean by the global batch's G rows, a replica by
its own G/N, so each row's gradient a replica takes is N times one
device's. A perturbation along the gradient's sign or its direction per
example does not see that; a penalty on the gradient's norm sees it N²
times. The replicas' gradients of variables are averaged for a mean loss,
which makes them one device's; a gradient with respect to the step's rows
is never aggregated, so this pass scales it.

Requires: replicas made by `replicate` of a graph whose gradient calls of
inputs are noted (graph/recorders.py for a traced step's tapes,
graph/input_calls.py for a TF1 graph's tf.gradients); the step's parts
equal (`pn.function` and Keras `fit` run a batch the replicas do not
divide on one device; a TF1 run that trains needs one that divides).
Guarantees: where the target is a scalar mean over the batch, every
replica's copy of the gradient's seed (the ones it starts from) is 1/N
(N the job's replicas), so the gradient, and the gradient of anything
computed from it, is one device's; a call of variables and inputs
together (`tape.gradient(loss, [w, x])`) has each variable's gradient
multiplied by N again (recorders.UNSCALED), which keeps it a replica's
own, averaged as the others. A tape's gradient of a tensor the batch
does not index (a weight's value: MAML's inner step) sums over every
example: it is summed over the replicas by one all-reduce, one device's;
where a loss differentiates it again, its own gradient stays each
replica's, and a warning says so. The scopes of a TF1 graph's such calls
of a mean or a sum are published (`ScaledInputs`): a fetch of their
tensors joins the replicas' rows as they are (each one device's). A sum over the batch (a critic's
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
from parallax_ng.graph.ir import TensorRef
from parallax_ng.graph.rows import batch_axis, reading
from parallax_ng.pipeline.results import ScaledInputs


@dataclass(frozen=True)
class InputGradientsPass:
    name: str = "input_gradients"
    requires: tuple = ("replicate",)
    after: tuple = ("counted_draws",)

    def run(self, ir, ctx):
        graph, n = ctx.tg.graph, ctx.plan.group_size
        kinds = seed_kinds(graph)
        changed, added, seeds = {}, [], [seed for seed, kind in kinds.items() if kind == "mean"]
        for seed in seeds:             # an Identity (a tape's) or a Fill (tf.gradients')
            dtype = graph.get_operation_by_name(seed).outputs[0].dtype
            for k in range(ctx.plan.num_replicas):
                node = ir.node(ctx.replica_name(k, seed))
                at = f"parallax/input_gradients/{node.name}"
                # the seed, renamed: on the replica's device, as `place` puts the seed
                ones = emit.like(node, f"{at}/ones", node.device or ctx.plan.devices[k])
                ones.input.extend(node.input)
                share, changed[node.name] = _times(node, ones.name, 1.0 / n, dtype, "share")
                added += [ones, share]
        for call_seeds, gradients in recorders.unscaled_gradients(graph):
            if not any(seed.split(":")[0] in seeds for seed in call_seeds):
                continue
            for name in gradients:      # a variable's, in a call also of inputs: times N
                op = name.split(":")[0]
                if op not in ir:        # not used: the step keeps only what it needs
                    continue
                dtype = tf.as_dtype(ir.node(op).attr["T"].type)
                for k in range(ctx.plan.num_replicas):
                    node = ir.node(ctx.replica_name(k, op))
                    factor, changed[node.name] = _times(node, node.input[0], float(n), dtype,
                                                        "replicas")
                    added.append(factor)
        ctx.publish(ScaledInputs(tuple(seed[:seed.rindex("/") + 1] for seed in kinds
                                       if graph.get_operation_by_name(seed).type == "Fill")))
        out, summed = _summed(ir.replace(changed, added), ctx, kinds)
        return out, {"scaled": len(seeds), "summed": summed}


def _times(node, source: str, factor: float, dtype, suffix: str):
    """(a constant `factor` on `node`'s device, a Mul of `source` by it
    that takes `node`'s name and place)."""
    const = emit.const(f"parallax/input_gradients/{node.name}/{suffix}", factor, dtype,
                       node.device)
    return const, emit.node_def(node.name, "Mul", [source, const.name], node.device, T=dtype)


def seed_kinds(graph: tf.Graph) -> dict[str, str]:
    """{seed: "mean" or "sum"}: the seeds (a tape's SEED Identity, a
    tf.gradients call's grad_ys Fill) of the input gradients of `graph`
    whose targets are scalar means over the batch, or sums (and a warning
    naming the targets the graph shows as neither)."""
    data, out, unsure = reading(forms.sources(graph), graph), {}, []
    for targets, seeds in recorders.input_gradients(graph):
        if not targets:         # a batch Jacobian's rows, noted for graph/rows.py
            continue
        try:
            tensors = [graph.get_tensor_by_name(name) for name in targets]
            ops = [graph.get_tensor_by_name(name).op for name in seeds]
        except (KeyError, ValueError):      # in a branch or a loop's body: not in the graph
            continue
        kinds = [_kind(t, data) for t in tensors]
        if set(kinds) in ({"mean"}, {"sum"}):
            out.update((op.name, kinds[0]) for op in ops)
        else:
            unsure.extend(t.name for t, kind in zip(tensors, kinds) if kind != "sum")
    if unsure:
        warnings.warn(
            f"the step takes the gradient of {sorted(set(unsure))} with respect to tensors "
            "(of its inputs, not of variables), and the graph does not show "
            "that value as a mean or a sum over the batch: each replica's gradient is of "
            "its own rows' value, which may differ from one device's. A mean "
            "(tf.reduce_mean) or a sum over the examples is exact", stacklevel=3)
    return out


def _kind(t: tf.Tensor, data) -> str | None:
    """"mean" or "sum" over the batch, as the target `t` is, else None."""
    if t.shape.rank != 0:      # a value per example: the gradient sums them
        return "sum" if batch_axis(t, data) is not None else None
    kind, guessed, form = forms.scalar_form(t, data)
    if guessed or form.by_count or form.mixed:
        return None
    return kind


def _summed(ir, ctx, kinds):
    """(`ir` with each gradient of a tensor the batch does not index (a
    weight's value: MAML's fast weights) summed over the replicas, how
    many). Such a gradient sums over the batch's examples, and each
    replica's sums its own (of a mean's 1/N seed): one all-reduce makes
    it one device's. A call the graph shows as neither a mean nor a sum is
    left (named in a warning)."""
    graph, rewires, made, count, again = ctx.tg.graph, {}, [], 0, []
    data = reading(forms.sources(graph), graph)
    losses = {t.op.name for t in forms.autodiff_losses(graph)}
    for seeds, pairs in recorders.gradients_of_inputs(graph):
        if not seeds or any(seed.split(":")[0] not in kinds for seed in seeds):
            continue
        for gradient, source in pairs:
            op = gradient.split(":")[0]
            try:
                x = graph.get_tensor_by_name(source)
            except (KeyError, ValueError):      # in a branch or a loop's body
                continue
            if op not in ir or not x.shape.is_fully_defined() or \
                    batch_axis(x, data) is not None:
                continue
            names = [ctx.replica_name(k, op) for k in range(ctx.plan.num_replicas)]
            dtype = tf.as_dtype(ir.node(op).attr["T"].type)
            nodes, outs = ctx.comm.all_reduce(f"parallax/input_gradients/{op}/sum",
                                              [f"{x}:0" for x in names], dtype, False)
            made += nodes
            for name, out in zip(names, outs):
                rewires.update({(user, pos): out for user, pos in ir.consumers.get(
                    TensorRef(name, 0), ())})
            count += 1
            if _differentiated(graph.get_operation_by_name(op), losses):
                again.append(source)
    if again:
        warnings.warn(
            f"the step takes the gradient of {sorted(set(again))} (not of the batch's rows: a "
            "weight's value, as MAML's fast weights) and differentiates it again: the gradient "
            "is summed over the replicas as one device's, but its own gradient is each "
            "replica's, of its own rows, not one device's; tf.stop_gradient on it (first "
            "order) is exact", stacklevel=3)
    return ir.rewire(rewires, made), count


def _differentiated(op, losses: set) -> bool:
    """Whether a loss reads `op`'s output other than through a StopGradient."""
    seen, stack = set(), [op]
    while stack:
        x = stack.pop()
        if x.name in losses:
            return True
        for c in (c for t in x.outputs for c in t.consumers()):
            if c.name not in seen and c.type not in ("StopGradient", "PreventGradient"):
                seen.add(c.name)
                stack.append(c)
    return False
