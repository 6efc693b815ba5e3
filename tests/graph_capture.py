"""A ``torch.compile`` backend that keeps AOTAutograd's forward and backward graphs and runs
them as traced (no code generation), for tests that read what a compiled step calls:

    backend, graphs = recording_backend()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    ...
    graphs["forward"][0].code, graphs["backward"][0].graph.nodes
"""
from __future__ import annotations

from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd


def recording_backend():
    """``(backend, {"forward": [GraphModule, ...], "backward": [...]})``."""
    graphs: dict[str, list] = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(gm, _example_inputs):
            graphs[kind].append(gm)
            return make_boxed_func(gm.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), graphs
