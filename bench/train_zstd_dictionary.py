"""Trains the zstd dictionary that entries of schema 4 are compressed with (cachestore/entry_dictionary.zstd).

Entries are small (a median binary of 1.3 KB): compressed alone, each pays for the structure every BIR binary
and entry body repeats (field names, op names, dtypes, key component names). A dictionary holds that once.

The training bodies are entries of graphs built here from layer configurations that no workload uses (neither
`workers.workload`'s pools nor their shapes), compiled into a throwaway local tier, so the bench figures that
measure compression (`storage_ratio`, `wire_bytes_ratio`) are on data the dictionary never saw.

    python bench/train_zstd_dictionary.py [--out cachestore/entry_dictionary.zstd] [--size 8192]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bridge.codegen import BirCodeGenLoop
from bridge.graph import load_graph
from bridge.targets import make_target
from cachestore import entry as entry_format
from cachestore.settings import load_settings
from cachestore.stores import open_tier
from workers import workload

# Held out from the workload's pools (workers.workload.MOE_CONFIGS / UNET_CONFIGS): no shape in common.
MOE_TRAINING = [(64, 128, 2, 128, 64), (192, 128, 2, 64, 64), (320, 384, 4, 128, 64), (96, 384, 8, 64, 32)]
UNET_TRAINING = [(8, 8, 48), (24, 48, 24), (48, 24, 8), (4, 8, 40), (40, 40, 12)]


def training_graphs(directory: Path) -> list[Path]:
    """One graph of one layer per held-out configuration and dtype."""
    layers = [("moe", config, workload.moe_layer) for config in MOE_TRAINING]
    layers += [("unet", config, workload.unet_block) for config in UNET_TRAINING]
    paths = []
    for dtype in ("float32", "bfloat16"):
        for i, (kind, config, build) in enumerate(layers):
            graph = workload.GraphBuilder(f"train-{kind}-{dtype}-{i}")
            build(graph, 0, config, dtype)
            path = directory / f"{graph.name}.json"
            path.write_text(json.dumps(graph.document()))
            paths.append(path)
    return paths


def training_bodies(directory: Path) -> list[bytes]:
    """The body of every entry the training graphs store, as the tier client builds it. The entries are
    compressed with a dictionary of a few zero bytes while training: the body, not the payload, is the sample,
    so the dictionary in use (if any) plays no part in the result."""
    entry_format._dictionary[:] = [zstandard.ZstdCompressionDict(b"\0" * 8, dict_type=zstandard.DICT_TYPE_RAWCONTENT)]
    tier = open_tier(load_settings({"tier": f"local:{directory / 'tier.sqlite'}", "single_flight": False}))
    try:
        for path in training_graphs(directory):
            graph = load_graph(path)
            BirCodeGenLoop(make_target(graph.target or "Trn2"), tier=tier).run(graph)
        tier.flush(60)
        return [entry_format.body_of(raw.data) for raw in tier._backend.scan_entries(with_ttl=False)]
    finally:
        tier.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=entry_format.ENTRY_DICTIONARY_PATH)
    parser.add_argument("--size", type=int, default=32768, help="bytes of the dictionary")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="nkidict-") as tmp:
        bodies = training_bodies(Path(tmp))
    # Fixed parameters (no search): the same bodies give the same dictionary.
    dictionary = zstandard.train_dictionary(args.size, bodies, k=64, d=8, dict_id=1)
    args.out.write_bytes(dictionary.as_bytes())
    print(f"{args.out}: {len(dictionary.as_bytes())} bytes from {len(bodies)} bodies "
          f"({sum(map(len, bodies))} bytes)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
