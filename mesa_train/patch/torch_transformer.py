"""torch's ``nn.TransformerEncoderLayer`` / ``nn.TransformerDecoderLayer`` built with a string
activation (``activation="gelu"``, the form most code uses; ``"relu"`` is the default) keep the
function itself, ``self.activation = F.gelu``, and call ``self.activation(x)``: no module for the
leaf conversion to reach, and a call the source scan reads as a method. Left alone, the MLP's
widest activation stayed uncompressed and unreported (a small encoder stack kept 0.391 of
stock's bytes; 0.301 built with ``activation=nn.GELU()``, as now with ``"gelu"``).

``activations_as_modules`` swaps that function for the stock module that computes the same
(``nn.GELU()`` calls ``F.gelu(x)``, ``nn.ReLU()`` ``F.relu(x)``: the same bits), which the
leaf conversion then makes a Mesa layer with the layer's module set and options. The
inference fast path (``activation_relu_or_gelu``) reads a flag set at construction, which the
swap keeps; stock's own ``isinstance(activation, nn.GELU)`` sets the same flag.
"""
from __future__ import annotations

from typing import Iterable

import torch.nn.functional as F
from torch import nn

__all__ = ["activations_as_modules"]

# the functions the torch layers store, the stock module computing the same, and its op
_AS_MODULE = {F.gelu: (nn.GELU, "gelu"), F.relu: (nn.ReLU, "relu")}
_LAYERS = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def activations_as_modules(root: nn.Module, op_names: Iterable[str]) -> None:
    """Give each torch transformer layer under ``root`` whose ``activation`` is ``F.gelu`` or
    ``F.relu`` the stock module instead, where that op is among ``op_names``."""
    ops = set(op_names)
    for m in root.modules():
        fn = vars(m).get("activation") if isinstance(m, _LAYERS) else None
        made = _AS_MODULE.get(fn) if fn is not None and not isinstance(fn, nn.Module) else None
        if made is not None and made[1] in ops:
            m.activation = made[0]()  # (nn.Module's __setattr__ drops the plain attribute)
