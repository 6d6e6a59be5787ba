"""The pass library: one rewrite per module (and `flat_buffers`, the packing
the aggregate pass builds fusion buffers and buckets with; `counts`, the
counts state sync shares; `step_barrier`, server sync's barrier);
`pipeline_for(plan)` picks the passes a plan needs, in order.

Each pass declares `requires` (passes that must run before it) and `after`
(passes that must run before it when they run at all); the PassManager
checks both before it runs anything.
"""
from transforms.aggregate import AggregatePass
from transforms.colocate import ColocateUpdatesPass
from transforms.columns import ColumnsPass
from transforms.counted_draws import CountedDrawsPass
from transforms.horizontal import HorizontalPass
from transforms.initial_values import InitPass
from transforms.input_gradients import InputGradientsPass
from transforms.local_aggregation import LocalAggregationPass
from transforms.lookups import DistinctLookupsPass, LookupsOnServersPass
from transforms.loss_scales import LossScalesPass
from transforms.orderings import OrderingsPass
from transforms.part_writes import PartWritesPass
from transforms.place import PlacePass
from transforms.prefetch import PrefetchPass
from transforms.replicate import ReplicatePass
from transforms.scaled_sums import ScaledSumsPass
from transforms.selected_means import SelectedMeansPass
from transforms.server_sync import ServerSyncPass
from transforms.shard_inputs import ShardInputsPass
from transforms.shard_variables import ShardVariablesPass
from transforms.split_step import SplitStepPass
from transforms.state_sync import StateSyncPass


def pipeline_for(plan) -> list:
    """replicate -> (counted_draws) -> shard_inputs -> aggregate -> state_sync ->
    selected_means -> (scaled_sums) -> input_gradients -> place -> loss_scales -> init,
    with the placement rewrites the plan turns on (local_aggregation after
    aggregate; lookups_on_servers, colocate_updates after place, before
    loss_scales), then, as
    the plan needs them, the cross-worker server protocol,
    distinct lookups of rows on servers, sharded variables and the step's
    split into a collective run and a server run; a table cut by columns over the replicas gets its parts after
    init, then its update split over steps where the plan prefetches it, and
    dense updates a step later by block where it schedules them so; in a
    job, a write of such a table's parts ends its run on every worker;
    last, `orderings` keeps the graph's read-before-write orderings from
    Grappler's dependency optimizer.
    Passes with nothing to do for this plan are left out (one replica
    needs no input sharding, state sync, selected means, loss scales, input
    gradients' scales or initial-value copies)."""
    several, servers, rewrites = plan.group_size > 1, bool(plan.servers), plan.rewrites
    shared = bool(plan.shared_state())
    wanted = [(ReplicatePass(), True), (CountedDrawsPass(), bool(plan.counted)),
              (ShardInputsPass(), several), (AggregatePass(), True),
              (LocalAggregationPass(), servers and rewrites.local_aggregation),
              (StateSyncPass(), several), (SelectedMeansPass(), several),
              (ScaledSumsPass(), several and bool(plan.scaled_sums)),
              (InputGradientsPass(), several), (PlacePass(), True),
              (LookupsOnServersPass(), shared and rewrites.lookups_on_servers),
              (ColocateUpdatesPass(), shared and rewrites.colocate_updates),
              (LossScalesPass(), several), (InitPass(), several),
              (ColumnsPass(), bool(plan.columns())),
              (PrefetchPass(), any(vp.prefetch for vp in plan.variables.values())),
              (HorizontalPass(), bool(plan.blocks)),
              (PartWritesPass(), bool(plan.columns()) and plan.num_workers > 1),
              (ServerSyncPass(), plan.cross_worker_servers),
              (DistinctLookupsPass(), plan.distinct_lookups and bool(plan.servers)),
              (ShardVariablesPass(), bool(plan.sharded())),
              (SplitStepPass(), plan.schedule.split), (OrderingsPass(), True)]
    return [p for p, needed in wanted if needed]


__all__ = ["AggregatePass", "ColocateUpdatesPass", "ColumnsPass", "CountedDrawsPass",
           "DistinctLookupsPass",
           "HorizontalPass",
           "InitPass", "InputGradientsPass", "LocalAggregationPass", "LookupsOnServersPass",
           "LossScalesPass",
           "OrderingsPass", "PartWritesPass", "PlacePass",
           "PrefetchPass",
           "ReplicatePass", "ScaledSumsPass", "SelectedMeansPass",
           "ServerSyncPass", "ShardInputsPass", "ShardVariablesPass", "SplitStepPass",
           "StateSyncPass", "pipeline_for"]
