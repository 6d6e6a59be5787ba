"""Layer profiles of ResNet-50 and BERT from their definitions, for
`parallax-ng simulate` (the files in profiles/ are this script's output).

Bytes are the gradient bytes of each layer's trainable variables (the
layouts of tests/model_shapes.py: Keras' ResNet-50, BERT with a pooler and
no pre-training heads). Times come from a FLOP model of a named GPU, not
from a measurement: a layer's forward time is its multiply-add FLOPs
(2 per multiply-add) at a stated fraction of the GPU's peak, or, for
element-wise layers (batch norm, layer norm), the bytes of activations they
read and write at the GPU's memory bandwidth, plus a launch overhead per
layer; its backward time is twice the forward FLOPs (gradients of the
weights and of the input; the first layer only the weights) or twice the
element-wise traffic.

- ResNet-50 on one NVIDIA Tesla K80 GPU (one GK210: 4.37 TFLOPS fp32 peak
  at boost clock, 240 GB/s), batch 32 of 224x224 images (the MG-WFBP
  paper's setting), 30% of peak, fp32 gradients; a layer is a convolution
  (kernel, bias) or a batch norm (scale, offset) or the classifier.
- BERT on one NVIDIA V100 (125 TFLOPS fp16 tensor-core peak, 900 GB/s),
  batch 64 sequences of 128 tokens (Herring's setting), 35% of peak, fp16
  gradients (Herring communicates fp16); a layer is a dense projection
  (kernel, bias), a layer norm, or the embeddings; the attention's own
  matrix products count in the value projection's backward time (the last
  of query, key, value before the backward pass reaches them).

    python benchmarks/model_profiles.py [--out profiles]   # writes the JSON files
"""
import argparse
import json
import os

OVERHEAD = 10e-6          # seconds per layer launch


class Gpu:
    def __init__(self, name, peak_flops, efficiency, memory_bandwidth):
        self.name, self.flops = name, peak_flops * efficiency
        self.efficiency, self.bandwidth = efficiency, memory_bandwidth

    def compute(self, flops):
        return flops / self.flops + OVERHEAD

    def memory(self, nbytes):
        return nbytes / self.bandwidth + OVERHEAD


K80 = Gpu("NVIDIA Tesla K80 (one GK210)", 4.37e12, 0.30, 240e9)
V100 = Gpu("NVIDIA V100 (fp16 tensor cores)", 125e12, 0.35, 900e9)


def resnet50(gpu=K80, batch=32, grad_bytes=4):
    """(forward time, layers input to output) of Keras' ResNet-50."""
    layers, forward = [], 0.0

    def conv(name, k, c_in, c_out, size, first=False):
        nonlocal forward
        flops = 2 * k * k * c_in * c_out * size * size * batch
        forward += gpu.compute(flops)
        layers.append({"name": f"{name}_conv", "bytes": (k * k * c_in + 1) * c_out * grad_bytes,
                       "backward_time": gpu.compute(flops * (1 if first else 2))})
        activations = c_out * size * size * batch * 4       # fp32 activations
        forward += gpu.memory(2 * activations)               # read x, write y
        layers.append({"name": f"{name}_bn", "bytes": 2 * c_out * grad_bytes,
                       "backward_time": gpu.memory(4 * activations)})   # x, dy in; dx out; relu

    conv("conv1", 7, 3, 64, 112, first=True)
    width_in = 64
    for stage, (blocks, width, size) in enumerate([(3, 64, 56), (4, 128, 28), (6, 256, 14),
                                                   (3, 512, 7)], 2):
        for block in range(1, blocks + 1):
            name = f"conv{stage}_block{block}"
            if block == 1:
                conv(f"{name}_0", 1, width_in, 4 * width, size)
            conv(f"{name}_1", 1, width_in if block == 1 else 4 * width, width, size)
            conv(f"{name}_2", 3, width, width, size)
            conv(f"{name}_3", 1, width, 4 * width, size)
        width_in = 4 * width
    flops = 2 * 2048 * 1000 * batch
    forward += gpu.compute(flops)
    layers.append({"name": "predictions", "bytes": (2048 + 1) * 1000 * grad_bytes,
                   "backward_time": gpu.compute(2 * flops)})
    return forward, layers


def bert(gpu=V100, layers_count=12, hidden=768, ffn=3072, batch=64, seq=128,
         vocab=30522, grad_bytes=2):
    """(forward time, layers input to output) of BERT (base by default)."""
    tokens = batch * seq
    layers, forward = [], 0.0

    def dense(name, d_in, d_out, rows=tokens, extra=0.0):
        nonlocal forward
        flops = 2 * rows * d_in * d_out
        forward += gpu.compute(flops) + extra
        layers.append({"name": name, "bytes": (d_in + 1) * d_out * grad_bytes,
                       "backward_time": gpu.compute(2 * flops) + 2 * extra})

    def norm(name):
        nonlocal forward
        traffic = 2 * tokens * hidden * 2                     # fp16 activations
        forward += gpu.memory(traffic)
        layers.append({"name": name, "bytes": 2 * hidden * grad_bytes,
                       "backward_time": gpu.memory(2 * traffic)})

    forward += gpu.memory(tokens * hidden * 2 * 3)           # three lookups, summed
    layers.append({"name": "embeddings", "bytes": (vocab + 512 + 2) * hidden * grad_bytes,
                   "backward_time": gpu.memory(tokens * hidden * 2 * 3)})
    norm("embeddings/ln")
    attention = gpu.compute(2 * 2 * tokens * seq * hidden)     # scores and context
    for k in range(layers_count):
        at = f"encoder/layer_{k}"
        dense(f"{at}/attention/query", hidden, hidden)
        dense(f"{at}/attention/key", hidden, hidden)
        dense(f"{at}/attention/value", hidden, hidden, extra=attention)
        dense(f"{at}/attention/output", hidden, hidden)
        norm(f"{at}/attention/ln")
        dense(f"{at}/intermediate", hidden, ffn)
        dense(f"{at}/output", ffn, hidden)
        norm(f"{at}/output/ln")
    dense("pooler", hidden, hidden, rows=batch)
    return forward, layers


def bert_large(gpu=V100, **kw):
    """BERT-large: BERT-base's definition at 24 layers, hidden 1024, feed-forward 4096."""
    return bert(gpu, layers_count=24, hidden=1024, ffn=4096, **kw)


PROFILES = {
    "resnet50-k80.json": (resnet50, "ResNet-50, batch 32, NVIDIA Tesla K80, fp32 gradients"),
    "bert-base-v100.json": (bert, "BERT-base, 64 x 128 tokens, NVIDIA V100, fp16 gradients"),
    "bert-large-v100.json": (bert_large,
                             "BERT-large, 64 x 128 tokens, NVIDIA V100, fp16 gradients"),
}


def profile(name: str) -> dict:
    build, about = PROFILES[name]
    forward, layers = build()
    return {"about": about + " (FLOP model: benchmarks/model_profiles.py)",
            "forward_time": forward, "layers": layers}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..",
                                                       "profiles"))
    opts = parser.parse_args()
    os.makedirs(opts.out, exist_ok=True)
    for name in PROFILES:
        data = profile(name)
        with open(os.path.join(opts.out, name), "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        total = sum(layer["bytes"] for layer in data["layers"])
        backward = sum(layer["backward_time"] for layer in data["layers"])
        print(f"{name:22} {len(data['layers']):4d} layers {total / 1e6:8.1f} MB  "
              f"forward {data['forward_time'] * 1e3:7.1f} ms  backward {backward * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
