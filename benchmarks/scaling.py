"""Predicted scaling from the shipped layer profiles (profiles/, written by
benchmarks/model_profiles.py), by the model `parallax-ng simulate` uses
(parallax_ng/planning/buckets.py).

- ResNet-50 (K80, batch 32) on 4 to 64 nodes of a 10 GbE-like network: the
  MG-WFBP paper's setting. alpha = 45.26 us (the paper's measured ring
  startup 2(N-1) alpha: 90.52 us at 2 nodes, 633.64 us at 8), beta = 0.8
  ns/byte (10 Gb/s). WFBP, single (SyncEASGD), MG-WFBP on the ring.
- BERT-large (V100, 64 x 128 tokens per GPU, fp16 gradients) on 64 to 2048
  GPUs, 8 per node (the node is the unit; reduction inside a node is not
  modelled), 100 Gb/s per node (beta = 0.08 ns/byte), alpha = 20 us:
  balanced fusion buffers with a server per node (`bfb:N`, Herring's
  setting) beside the ring all-reduce after the backward pass (`single`,
  what Herring's Table I finds fastest for NCCL), MG-WFBP's buckets on the
  ring, and whole layers on N servers (`ps:N`).

Scaling efficiency = compute time (forward + backward) / iteration time,
with 1.0 for a node that does not communicate.

    python benchmarks/scaling.py [--profiles DIR]
"""
import argparse
import json
import os

from parallax_ng.planning import buckets

HERE = os.path.dirname(os.path.abspath(__file__))


def load(directory, name):
    with open(os.path.join(directory, name)) as f:
        return buckets.load_profile(json.load(f))


def efficiency(forward, layers, result):
    compute = forward + sum(layer.backward_time for layer in layers)
    return {name: compute / r["iteration_time"] for name, r in result.items()}


def resnet50(directory):
    forward, layers = load(directory, "resnet50-k80.json")
    print("ResNet-50, K80, 10 GbE (alpha 45.26 us, beta 0.8 ns/B): iteration ms "
          "(scaling efficiency)")
    print(f"{'nodes':>6} {'wfbp':>16} {'single':>16} {'mgwfbp':>16} "
          f"{'mgwfbp/wfbp':>12} {'mgwfbp/single':>14}")
    for nodes in (4, 8, 16, 32, 64):
        net = buckets.Network(nodes, 45.26e-6, 8e-10)
        got = buckets.simulate(forward, layers, ["wfbp", "single", "mgwfbp"], network=net)
        eff = efficiency(forward, layers, got)
        t = {k: v["iteration_time"] for k, v in got.items()}
        cells = " ".join(f"{t[k] * 1e3:9.1f} ({eff[k]:.2f})" for k in ("wfbp", "single", "mgwfbp"))
        print(f"{nodes:6d} {cells} {t['wfbp'] / t['mgwfbp']:12.2f}x "
              f"{t['single'] / t['mgwfbp']:13.2f}x")


def bert_large(directory):
    forward, layers = load(directory, "bert-large-v100.json")
    print("\nBERT-large, V100, 8 GPUs and 100 Gb/s per node (alpha 20 us, beta 0.08 ns/B): "
          "scaling efficiency")
    print(f"{'GPUs':>6} {'nodes':>6} {'bfb:N':>8} {'single':>8} {'mgwfbp':>8} {'ps:N':>8} "
          f"{'bfb/single':>11}")
    for gpus in (64, 128, 256, 512, 1024, 2048):
        nodes = gpus // 8
        net = buckets.Network(nodes, 20e-6, 8e-11)
        names = [f"bfb:{nodes}", "single", "mgwfbp", f"ps:{nodes}"]
        got = buckets.simulate(forward, layers, names, network=net)
        eff = efficiency(forward, layers, got)
        cells = " ".join(f"{eff[k]:8.3f}" for k in names)
        print(f"{gpus:6d} {nodes:6d} {cells} {eff[names[0]] / eff['single']:10.2f}x")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--profiles", default=os.path.join(HERE, "..", "profiles"))
    opts = parser.parse_args()
    resnet50(opts.profiles)
    bert_large(opts.profiles)


if __name__ == "__main__":
    main()
