"""The pass library: one rewrite per module, composed by `default_pipeline`."""
from transforms.aggregate import AggregatePass
from transforms.init import InitPass
from transforms.place import PlacePass
from transforms.replicate import ReplicatePass
from transforms.shard_inputs import ShardInputsPass
from transforms.state_sync import StateSyncPass


def default_pipeline():
    """In-process data parallelism: replicate -> shard -> aggregate -> sync -> place -> init."""
    return [ReplicatePass(), ShardInputsPass(), AggregatePass(), StateSyncPass(),
            PlacePass(), InitPass()]


__all__ = ["AggregatePass", "InitPass", "PlacePass", "ReplicatePass",
           "ShardInputsPass", "StateSyncPass", "default_pipeline"]
