"""Flat buffers: dense gradients packed flat for one reduction each, as the
aggregate pass builds them for two methods.

- `fusion_buffers(ctx)` (bfb, Herring's balanced fusion buffers): on the
  host, each variable's replica sum flattened and packed into the plan's
  buffers; each buffer's shards summed over the workers on their servers
  (`server_sum`, parallax_ng/comm/collectives.py), scaled for a mean there,
  and unpacked per variable;
- `bucket(ctx, b, variables)` (allreduce buckets, MG-WFBP's merged
  gradients): on every replica's device the bucket's gradients flattened
  and packed, one all-reduce, split and reshaped back.
Both return (nodes, outputs): the new NodeDefs and, per gradient tensor,
its aggregate on every replica. `flat_slice`, `concat` and `elements` are
the packing helpers (a ConcatV2 of one input is an Identity).

Requires: a PassContext whose plan holds the buffers or buckets.
"""
from __future__ import annotations

import tensorflow as tf

from parallax_ng.graph import emit
from parallax_ng.graph.ir import format_input


def fusion_buffers(ctx):
    """Balanced fusion buffers: local sums packed, each buffer shard summed
    over the workers on its server, the sums unpacked per variable."""
    plan, tg = ctx.plan, ctx.tg
    n, host, scope = plan.num_replicas, plan.host, "parallax/bfb"
    fused = sorted({s.var for b in plan.buffers for s in b.segments})
    mean = plan.average_dense and plan.group_size > 1
    scale = 1.0 / plan.group_size if mean else 1.0
    nodes = [emit.const(f"{scope}/axis", 0, tf.int32, host),
             emit.const(f"{scope}/flat", [-1], tf.int32, host)]
    flat = {}
    for var in fused:
        grad, dtype = tg.gradients[var], tg.variables[var].dtype
        values = [ctx.replica_tensor(k, grad.values) for k in range(n)]
        local = f"{scope}/{var}/local"
        nodes += [emit.node_def(local, "AddN", values, host, T=dtype, N=n) if n > 1 else
                  emit.node_def(local, "Identity", values, host, T=dtype),
                  emit.node_def(f"{scope}/{var}/flat", "Reshape", [local, f"{scope}/flat"],
                                host, T=dtype, Tshape=tf.int32)]
        flat[var] = f"{scope}/{var}/flat"
    pieces: dict[str, list[tuple[int, str]]] = {v: [] for v in fused}
    for b, buf in enumerate(plan.buffers):
        at, dtype = f"{scope}/buffer_{b}", tg.variables[buf.segments[0].var].dtype
        parts = [flat_slice(nodes, f"{at}/in_{k}", flat[s.var], s.start, s.size, dtype, host,
                        whole=s.size == elements(tg, s.var))
                 for k, s in enumerate(buf.segments)]
        nodes.append(concat(f"{at}/packed", parts, f"{scope}/axis", dtype, host))
        sums = []
        for i, shard in enumerate(buf.placement.shards):
            piece = flat_slice(nodes, f"{at}/shard_{i}/piece", f"{at}/packed", shard.start,
                           shard.size, dtype, host, whole=shard.size == buf.placement.length)
            made, total = ctx.comm.server_sum(f"{at}/shard_{i}", piece, dtype, shard.device,
                                              scale, gradient=True)
            nodes += made
            sums.append(total)
        nodes.append(concat(f"{at}/sum", sums, f"{scope}/axis", dtype, host))
        for k, s in enumerate(buf.segments):
            pieces[s.var].append((s.start, flat_slice(
                nodes, f"{at}/out_{k}", f"{at}/sum", s.offset, s.size, dtype, host,
                whole=s.size == buf.placement.length)))
    outputs = {}
    for var in fused:
        dtype, shape = tg.variables[var].dtype, list(tg.variables[var].shape)
        parts = [t for _, t in sorted(pieces[var])]
        nodes += [concat(f"{scope}/{var}/joined", parts, f"{scope}/axis", dtype, host),
                  emit.const(f"{scope}/{var}/shape", shape, tf.int32, host),
                  emit.node_def(f"{scope}/{var}/sum", "Reshape",
                                [f"{scope}/{var}/joined", f"{scope}/{var}/shape"], host,
                                T=dtype, Tshape=tf.int32)]
        outputs[tg.gradients[var].values] = [f"{scope}/{var}/sum"] * n
    return nodes, outputs


def elements(tg, var: str) -> int:
    return tg.variables[var].nbytes // tg.variables[var].dtype.size


def flat_slice(nodes: list, name: str, tensor: str, start: int, size: int, dtype, device: str,
           whole: bool = False) -> str:
    """Elements [start, start + size) of a flat tensor (the tensor itself
    when that is all of it)."""
    if whole:
        return tensor
    nodes += [emit.const(f"{name}/begin", [start], tf.int32, device),
              emit.const(f"{name}/size", [size], tf.int32, device),
              emit.node_def(name, "Slice", [tensor, f"{name}/begin", f"{name}/size"], device,
                            T=dtype, Index=tf.int32)]
    return name


def concat(name, inputs, axis, dtype, device):
    if len(inputs) == 1:   # ConcatV2 needs two inputs or more
        return emit.node_def(name, "Identity", inputs, device, T=dtype)
    return emit.node_def(name, "ConcatV2", inputs + [axis], device,
                         T=dtype, N=len(inputs), Tidx=tf.int32)


def bucket(ctx, b: int, variables: tuple[str, ...]):
    """One all-reduce of the bucket's gradients: on every replica's device
    flattened and packed, reduced, split and reshaped back."""
    plan, tg = ctx.plan, ctx.tg
    scope = f"parallax/bucket_{b}"
    dtype = tg.variables[variables[0]].dtype.base_dtype
    sizes = [elements(tg, v) for v in variables]
    nodes, packed = [], []
    for k, device in enumerate(plan.devices):
        at = f"{scope}/replica_{k}"
        nodes += [emit.const(f"{at}/axis", 0, tf.int32, device),
                  emit.const(f"{at}/flat", [-1], tf.int32, device)]
        flats = []
        for i, var in enumerate(variables):
            flats.append(f"{at}/in_{i}")
            nodes.append(emit.node_def(flats[-1], "Reshape", [
                ctx.replica_tensor(k, tg.gradients[var].values), f"{at}/flat"], device,
                T=dtype, Tshape=tf.int32))
        nodes.append(concat(f"{at}/packed", flats, f"{at}/axis", dtype, device))
        packed.append(f"{at}/packed")
    made, reduced = ctx.comm.all_reduce(f"{scope}/reduce", packed, dtype, plan.average_dense,
                                        gradient=True)
    nodes += made
    outputs = {tg.gradients[v].values: [] for v in variables}
    for k, device in enumerate(plan.devices):
        at = f"{scope}/replica_{k}"
        nodes += [emit.const(f"{at}/sizes", sizes, tf.int32, device),
                  emit.node_def(f"{at}/split", "SplitV", [reduced[k], f"{at}/sizes",
                                                          f"{at}/axis"], device, T=dtype,
                                Tlen=tf.int32, num_split=len(variables))]
        for i, var in enumerate(variables):
            shape = list(tg.variables[var].shape)
            nodes += [emit.const(f"{at}/shape_{i}", shape, tf.int32, device),
                      emit.node_def(f"{at}/out_{i}", "Reshape", [
                          format_input(f"{at}/split", i), f"{at}/shape_{i}"], device,
                          T=dtype, Tshape=tf.int32)]
            outputs[tg.gradients[var].values].append(f"{at}/out_{i}")
    return nodes, outputs
