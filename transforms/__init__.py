"""The pass library: one rewrite per module, composed by `default_pipeline`."""
from transforms.aggregate import AggregatePass
from transforms.init import InitPass
from transforms.place import PlacePass
from transforms.replicate import ReplicatePass
from transforms.server_sync import ServerSyncPass
from transforms.shard_inputs import ShardInputsPass
from transforms.split_rows import SplitRowsPass
from transforms.stage import StagePass
from transforms.state_sync import StateSyncPass


def default_pipeline():
    """replicate -> shard -> aggregate -> sync -> place -> init, then, in
    multi-worker jobs with parameter servers, the cross-worker protocol,
    large variables cut into row ranges, and the stage split."""
    return [ReplicatePass(), ShardInputsPass(), AggregatePass(), StateSyncPass(),
            PlacePass(), InitPass(), ServerSyncPass(), SplitRowsPass(), StagePass()]


__all__ = ["AggregatePass", "InitPass", "PlacePass", "ReplicatePass",
           "ServerSyncPass", "ShardInputsPass", "SplitRowsPass", "StagePass", "StateSyncPass", "default_pipeline"]
