"""Graph capture of Mesa layers: torch.fx and TorchScript get a clear answer, never a
silently stock-equivalent graph.

* **torch.fx** (``symbolic_trace``, timm's / torchvision's feature extractors): a tracer that
  steps *into* a Mesa layer only sees its stock branch (the compressed branch is an
  ``autograd.Function`` that a proxy cannot enter), so the traced graph would run the stock
  ops and keep stock activations. Mesa layers are therefore registered as timm *no-trace*
  (leaf) modules: timm's FX feature extraction (``create_feature_extractor``,
  ``features_only`` with ``feature_cls="fx"``) keeps them as ``call_module`` nodes, which run
  the Mesa layer itself (compression kept). Any other tracer that steps into one gets
  :class:`MesaTracingError` naming the layer and the fix (treat ``mesa_train.nn.MesaLayer``
  as a leaf: ``is_leaf_module`` / ``leaf_modules=[MesaLayer]``).
* **TorchScript** cannot compile a custom ``autograd.Function`` with Python-side state
  (the quantizers' running estimates): ``torch.jit.script`` on a patched model raises
  :class:`MesaTracingError` up front (via ``__prepare_scriptable__``) instead of a compiler
  traceback. Script the stock model (``mesa_train.patch.load_patched_checkpoint`` loads a
  patched checkpoint into it) or use ``torch.compile``.
"""
from __future__ import annotations

import torch

__all__ = ["MesaTracingError", "refuse_fx_proxy", "refuse_script", "register_fx_leaf"]


class MesaTracingError(RuntimeError):
    """A Mesa layer was asked to be captured in a way that would lose its compression."""


def refuse_fx_proxy(layer, tensors) -> None:
    """Raise when a torch.fx tracer stepped into ``layer`` (an input is an fx ``Proxy``)."""
    for t in tensors:
        if isinstance(t, torch.fx.Proxy):
            raise MesaTracingError(
                f"torch.fx traced into the Mesa layer {type(layer).__name__}: the graph would run the stock op "
                "and keep stock activations. Treat Mesa layers as leaves (timm's create_feature_extractor does; "
                "for your own Tracer: is_leaf_module -> isinstance(m, mesa_train.nn.MesaLayer), or "
                "leaf_modules=[mesa_train.nn.MesaLayer])")


def refuse_script(layer):
    raise MesaTracingError(
        f"torch.jit.script cannot compile the Mesa layer {type(layer).__name__} (a custom autograd.Function "
        "with running estimates). Use torch.compile, or script the stock model "
        "(mesa_train.patch.load_patched_checkpoint loads a patched checkpoint into it)")


def register_fx_leaf(cls):
    """Make timm's FX feature extraction keep ``cls`` (and its subclasses) as one node."""
    try:
        from timm.layers import register_notrace_module
    except ImportError:  # timm is optional for the nn layers
        return cls
    return register_notrace_module(cls)
