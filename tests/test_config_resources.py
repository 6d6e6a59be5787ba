import pytest

from parallax_ng.config import Config, load_config
from parallax_ng.errors import ConfigError, ResourceError
from parallax_ng.resources import load_resources


def test_defaults_and_yaml(tmp_path):
    assert load_config(None) == Config()
    path = tmp_path / "c.yaml"
    path.write_text("run_option: ps\naverage_sparse: false\ncommunication:\n  timeout_seconds: 5\n")
    cfg = load_config(str(path))
    assert cfg.run_option == "ps" and cfg.average_sparse is False
    assert cfg.communication.timeout_seconds == 5
    assert load_config(cfg) is cfg
    assert Config.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("data,words", [
    ({"run_optoin": "ps"}, ["run_optoin", "run_option"]),
    ({"run_option": "mpi"}, ["run_option", "mpi", "hybrid, allreduce, ps"]),
    ({"average_dense": "yes"}, ["average_dense", "true, false or auto"]),
    ({"communication": {"timeout": 3}}, ["communication.timeout", "timeout_seconds"]),
    ({"communication": {"timeout_seconds": -1}}, ["timeout_seconds", "positive"]),
    ({"communication": {"backend": "nccl"}}, ["communication.backend", "tf, horovod"]),
    ({"variable_methods": {"emb": "rdma"}}, ["variable_methods.emb", "allgather"]),
    ({"fetch_reduction": {"loss:0": "median"}}, ["fetch_reduction.loss:0", "concat"]),
    ({"verify": "all"}, ["verify", "structure"]),
    ({"batch_norm": "sync"}, ["batch_norm", "per_replica, synchronized"]),
])
def test_bad_config_names_key_and_allowed(data, words):
    with pytest.raises(ConfigError) as err:
        load_config(data)
    for w in words:
        assert w in str(err.value)


def test_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(str(tmp_path / "none.yaml"))
    with pytest.raises(ConfigError, match="path, a dict"):
        load_config(3)


def test_resources_forms(tmp_path):
    r = load_resources({"hosts": [{"address": "127.0.0.1", "devices": ["cpu:0", "CPU:1"]}]})
    assert r.num_replicas == 2
    assert r.local_device_strings() == ["/job:localhost/replica:0/task:0/device:CPU:0",
                                        "/job:localhost/replica:0/task:0/device:CPU:1"]
    gpu = load_resources({"hosts": [{"devices": ["gpu:0", "/device:GPU:1"]}]})
    assert gpu.local_device_strings()[1].endswith("device:GPU:1")
    path = tmp_path / "r.yaml"
    path.write_text("hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n")
    assert load_resources(str(path)).num_replicas == 1
    assert load_resources(None).num_replicas >= 1
    per_host = load_resources({"hosts": [{"address": "10.0.0.1:2222", "devices": ["cpu:0"]},
                                         {"address": "10.0.0.2", "devices": ["cpu:0"]}],
                               "ps": "per_host"})
    assert per_host.ps == ("10.0.0.1:2223", "10.0.0.2")
    spared = load_resources({"hosts": [{"devices": ["cpu:0", "cpu:1"]}],
                             "spares": [{"address": "10.0.0.9", "devices": ["cpu:0", "cpu:1"]}]})
    assert [(h.address, h.devices) for h in spared.spares] == [
        ("10.0.0.9", (("CPU", 0), ("CPU", 1)))]
    assert spared.num_replicas == 2          # a spare trains only in a host's place


@pytest.mark.parametrize("data,words", [
    ({}, ["names no devices", "hosts"]),
    ({"hosts": []}, ["names no devices"]),
    ({"hosts": [{"address": "127.0.0.1"}]}, ["names no devices", "devices: [cpu:0"]),
    ({"hosts": [{"devices": ["tpu:0"]}]}, ["tpu:0", "cpu:N or gpu:N"]),
    ({"hosts": [{"devices": ["cpu:0", "cpu:0"]}]}, ["twice"]),
    ({"hosts": [{"devices": ["cpu:0"], "gpus": 2}]}, ["gpus", "address, devices"]),
    ({"machines": []}, ["machines", "hosts, ps, ssh, spares"]),
    ({"hosts": [{"devices": ["cpu:0"]}], "ps": "each"}, ["'ps' is 'each'", "per_host"]),
    ({"hosts": [{"devices": ["cpu:0"]}], "spares": [{"address": "10.0.0.9"}]},
     ["spares[0] (10.0.0.9) names no devices"]),
    ({"hosts": [{"devices": ["cpu:0"]}], "spares": [{"devices": ["cpu:0", "cpu:1"]}]},
     ["spares[0] (127.0.0.1) lists 2 devices", "as every host (1)"]),
    ({"hosts": [{"devices": ["cpu:0"]}], "spares": "10.0.0.9"}, ["'spares' must be a list"]),
])
def test_bad_resources_name_the_problem(data, words):
    with pytest.raises(ResourceError) as err:
        load_resources(data)
    for w in words:
        assert w in str(err.value)
