"""Generates realistic graph files for a fleet: MoE transformer layers and UNet-like blocks.

The distribution (docs/workload.md explains it): each model is either an MoE transformer (RMSNorm,
transposes, projections, softmax, blockwise_mm, residual adds) or a UNet-like image model (3x3 and 1x1
convolutions, a strided downsampling convolution, nearest resize back up, a transpose and ordinary ops).
A model repeats one layer configuration several times, so a pass hits its own in-memory cache; models draw
their configurations from small pools with Zipf-like weights (weight of rank r is 1 / r**ZIPF_S), so a few
shapes are shared by many models (cross-machine tier hits) and a long tail is rare (traces).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from bridge.errors import NkiCacheError
from bridge.ir import Tensor
from bridge.kernels import get_internal_kernel_registry

ZIPF_S = 1.2
MOE_FRACTION = 0.5

# (tokens T, hidden H, experts E, intermediate I, block B), most common first.
MOE_CONFIGS = [
    (256, 256, 4, 256, 128),
    (128, 256, 4, 128, 64),
    (256, 512, 8, 256, 128),
    (512, 256, 8, 256, 128),
    (128, 512, 4, 256, 128),
    (384, 256, 4, 128, 128),
]
# (channels C, out channels O, image size S), most common first.
UNET_CONFIGS = [
    (16, 32, 32),
    (32, 32, 32),
    (16, 16, 64),
    (32, 64, 16),
    (64, 64, 16),
    (8, 16, 64),
]
DTYPES = [("float32", 0.75), ("bfloat16", 0.25)]


def zipf_choice(rng: np.random.Generator, options: list) -> object:
    weights = 1.0 / np.arange(1, len(options) + 1) ** ZIPF_S
    return options[rng.choice(len(options), p=weights / weights.sum())]


class GraphBuilder:
    """One graph file's document, built a tensor and an op at a time."""

    def __init__(self, name: str, target: str = "Trn2") -> None:
        self.name, self.target = name, target
        self.tensors: dict[str, dict] = {}
        self.ops: list[dict] = []

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str) -> str:
        self.tensors[name] = {"shape": list(shape), "dtype": dtype}
        return name

    def kernel(self, func_name: str, operands: list[str], results: list[str], attrs: dict | None = None) -> None:
        attrs = attrs or {}
        self.ops.append(
            {
                "type": "InternalNkiKernel",
                "func_name": func_name,
                "kernel_name": self._kernel_name(func_name, operands, results, attrs),
                "operands": operands,
                "results": results,
                "attrs": attrs,
            }
        )

    def ordinary(self, kind: str, operands: list[str], results: list[str]) -> None:
        self.ops.append({"type": kind, "operands": operands, "results": results})

    def _kernel_name(self, func_name: str, operands: list[str], results: list[str], attrs: dict) -> str:
        """The name the registry selects for these shapes (conv2d_pbp_* is a family)."""

        def as_tensor(name: str) -> Tensor:
            spec = self.tensors[name]
            return Tensor(name, spec["shape"], spec["dtype"])

        config = get_internal_kernel_registry().resolve(func_name)
        return config.marshal([as_tensor(n) for n in operands], [as_tensor(n) for n in results], attrs).kernel_name

    def document(self) -> dict:
        return {"name": self.name, "target": self.target, "tensors": self.tensors, "ops": self.ops}


def moe_layer(g: GraphBuilder, layer: int, config: tuple, dtype: str) -> None:
    T, H, E, I, B = config
    blocks = 2 * -(-T // B)  # top-2 routing: every token lands in two blocks' worth of positions
    p = f"l{layer}_"
    x = g.tensor(p + "x", (T, H), dtype)
    gain = g.tensor(p + "gain", (H,), dtype)
    xn = g.tensor(p + "xn", (T, H), dtype)
    g.kernel("RMSNorm", [x, gain], [xn], {"eps": 1e-6})
    xn_t = g.tensor(p + "xn_t", (H, T), dtype)
    g.kernel("Transpose10", [xn], [xn_t])
    w_router = g.tensor(p + "w_router", (H, E), dtype)
    logits = g.tensor(p + "logits", (T, E), dtype)
    g.kernel("Matmul", [xn_t, w_router], [logits])
    probs = g.tensor(p + "probs", (T, E), dtype)
    g.kernel("Softmax", [logits], [probs])
    hidden = g.tensor(p + "hidden", (T + 1, H), dtype)
    affinities = g.tensor(p + "affinities", ((T + 1) * E, 1), dtype)
    gate_up = g.tensor(p + "gate_up", (E, H, 2, I), dtype)
    down = g.tensor(p + "down", (E, I, H), dtype)
    token_ids = g.tensor(p + "token_ids", (blocks * B,), "int32")
    block_expert = g.tensor(p + "block_expert", (blocks, 1), "int32")
    moe_out = g.tensor(p + "moe_out", (T + 1, H), dtype)
    g.kernel(
        "BlockwiseMatmul", [hidden, affinities, gate_up, down, token_ids, block_expert], [moe_out], {"block_size": B}
    )
    g.ordinary("Add", [hidden, moe_out], [p + "residual"])


def unet_block(g: GraphBuilder, layer: int, config: tuple, dtype: str) -> None:
    C, O, S = config
    p = f"l{layer}_"
    x = g.tensor(p + "x", (1, C, S, S), dtype)
    w3 = g.tensor(p + "w3", (O, C, 3, 3), dtype)
    y = g.tensor(p + "y", (1, O, S, S), dtype)
    g.kernel("Conv2d", [x, w3], [y], {"stride": [1, 1], "padding": [[1, 1], [1, 1]], "dilation": [1, 1]})
    y_relu = g.tensor(p + "y_relu", (1, O, S, S), dtype)
    g.ordinary("Relu", [y], [y_relu])
    w1 = g.tensor(p + "w1", (O, O, 1, 1), dtype)
    z = g.tensor(p + "z", (1, O, S, S), dtype)
    g.kernel("Conv2d", [y_relu, w1], [z], {"stride": [1, 1], "padding": [[0, 0], [0, 0]], "dilation": [1, 1]})
    wd = g.tensor(p + "wd", (O, O, 3, 3), dtype)
    down = g.tensor(p + "down", (1, O, S // 2, S // 2), dtype)
    g.kernel("Conv2d", [z, wd], [down], {"stride": [2, 2], "padding": [[0, 1], [0, 1]], "dilation": [1, 1]})
    nhwc = g.tensor(p + "nhwc", (1, S // 2, S // 2, O), dtype)
    up = g.tensor(p + "up", (1, S, S, O), dtype)
    g.kernel("ResizeNearest", [nhwc], [up], {"out_shape": [1, S, S, O]})
    features = g.tensor(p + "features", (S * S, O), dtype)
    features_t = g.tensor(p + "features_t", (O, S * S), dtype)
    g.kernel("Transpose10", [features], [features_t])
    g.ordinary("Multiply", [features_t, features_t], [p + "gated"])


def generate_model(index: int, rng: np.random.Generator) -> dict:
    is_moe = rng.random() < MOE_FRACTION
    dtype = DTYPES[rng.choice(len(DTYPES), p=[w for _, w in DTYPES])][0]
    layers = int(rng.integers(2, 6))
    g = GraphBuilder(f"{'moe' if is_moe else 'unet'}-{index:03d}")
    config = zipf_choice(rng, MOE_CONFIGS if is_moe else UNET_CONFIGS)
    for layer in range(layers):
        # Most layers repeat the model's configuration; now and then one differs (a head or a stem).
        layer_config = config if rng.random() < 0.8 else zipf_choice(rng, MOE_CONFIGS if is_moe else UNET_CONFIGS)
        (moe_layer if is_moe else unet_block)(g, layer, layer_config, dtype)
    return g.document()


def generate_workload(out_dir: str | Path, models: int, seed: int) -> list[Path]:
    """Write `models` graph files into `out_dir`; the same seed gives the same files."""
    out = Path(out_dir)
    rng = np.random.default_rng(seed)
    paths = []
    try:
        out.mkdir(parents=True, exist_ok=True)
        for index in range(models):
            document = generate_model(index, rng)
            path = out / f"{document['name']}.json"
            path.write_text(json.dumps(document, indent=1, sort_keys=True) + "\n")
            paths.append(path)
    except OSError as exc:  # a folder that cannot be made or written: one line naming it, not a traceback
        raise NkiCacheError(f"{out}: cannot write the workload's graphs: {exc.strerror or exc}") from None
    return paths
