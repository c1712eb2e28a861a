"""A driver of neuronx-cc's loop (the stand-in at its import path): one pass over the internal kernel ops of
the graph file argv[1], then the specification's state as JSON on stdout (tests/test_exec.py)."""

import hashlib
import json
import sys

from neuronxcc.starfish.penguin.targets.codegen.BirCodeGenLoop import BirCodeGenLoop

from bridge.graph import load_graph
from bridge.ir import BasicBlock, InternalNkiKernel
from bridge.targets import make_target

graph = load_graph(sys.argv[1])
loop = BirCodeGenLoop(make_target("Trn2"))
bb = BasicBlock(graph.name)
for op in graph.ops:
    if isinstance(op, InternalNkiKernel):
        loop.codegenInternalNativeNkiKernel(op, bb)
if "--no-teardown" not in sys.argv:
    loop.afterStmtTransform()
state = {
    "cache_hits": loop.cache_hits,
    "cache_misses": loop.cache_misses,
    "maps": sorted(loop._new_nki_frontend_kernel_cache),
    "components": {key: repr(parts) for key, parts in loop._cache_key_components.items()},
    "usage": loop._cache_usage_counts,
    "block": [
        [k.name, hashlib.sha256(k.klir_binary).hexdigest(), k.kernel_format, k.func_args, k.func_outs]
        for k in bb.instructions
    ],
}
print(json.dumps(state, sort_keys=True))
