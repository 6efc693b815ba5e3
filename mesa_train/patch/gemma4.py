"""Mesa forwards for timm's Gemma 4 vision encoder (``gemma4_vit.py``), installed by class swap
(the forwards are timm's line for line but for the marked calls; ``tests/test_gemma4.py``
pins them to timm's source):

* ``Gemma4ClippableLinear`` (op ``linear``): its input and output clamps (``use_clipped``, the
  E4B checkpoints' finite bounds) keep 1-bit masks (a ``mesa_clamp`` child,
  :class:`mesa_train.nn.clamp_activations.Clamp`) where stock keeps the full input and the
  full output of every projection; the inner ``nn.Linear`` is converted by the leaf pass.
* ``Gemma4PatchEmbed`` (op ``linear``): the position embedding, ``one_hot(positions) @ table``,
  keeps the positions, ``(B, N, 2)`` integers (a ``mesa_table`` child,
  :class:`mesa_train.nn.one_hot_table.OneHotTable`), instead of the float one-hot matrix
  ``(B, 2, N, position_embedding_size)``: 10240 wide, the largest tensor a stock step keeps.
  The forward is the same matmul; the table's gradient is an ``index_add`` of the rows, the
  same sums in another order.
* ``Gemma4GatedMlp`` (op ``glu``, ``patch/mlp.py``): ``act(gate_proj(x)) * up_proj(x)`` through
  a ``GatedActivation`` child.
"""
from __future__ import annotations

from typing import Optional

import torch

from mesa_train.nn.clamp_activations import Clamp
from mesa_train.nn.one_hot_table import OneHotTable

try:  # timm releases before Gemma 4 (1.0.26): nothing to swap
    from timm.models.gemma4_vit import Gemma4ClippableLinear as _ClippableLinear
    from timm.models.gemma4_vit import Gemma4GatedMlp as _GatedMlp, Gemma4PatchEmbed as _PatchEmbed
except ImportError:  # pragma: no cover - depends on the installed timm
    _ClippableLinear = _GatedMlp = _PatchEmbed = None

__all__ = ["GEMMA4_CLASSES", "STOCK_GEMMA4_CLASSES", "GATED_MLP_CLASSES"]


if _ClippableLinear is not None:
    class MesaGemma4ClippableLinear(_ClippableLinear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.use_clipped:
                x = self.mesa_clamp(x, self.input_min, self.input_max)  # stock: torch.clamp
            x = self.linear(x)
            if self.use_clipped:
                x = self.mesa_clamp(x, self.output_min, self.output_max)  # stock: torch.clamp
            return x

    class MesaGemma4PatchEmbed(_PatchEmbed):
        def _position_embeddings(
                self,
                position_ids: torch.Tensor,
                padding_positions: Optional[torch.Tensor],
        ) -> torch.Tensor:
            clamped_positions = position_ids.clamp(min=0)
            # stock: the one-hot matrix built here and kept by the matmul for the table's gradient
            position_embeddings = self.mesa_table(clamped_positions, self.position_embedding_table)
            position_embeddings = position_embeddings.sum(dim=1)  # (B, N, embed_dim)
            if padding_positions is not None:
                position_embeddings = torch.where(
                    padding_positions.unsqueeze(-1), 0.0, position_embeddings,
                )
            return position_embeddings

    class MesaGemma4GatedMlp(_GatedMlp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x))))

    # stock class -> (op, Mesa class, (child name, Mesa layer class)): swapped, the child added
    GEMMA4_CLASSES = {_ClippableLinear: ("linear", MesaGemma4ClippableLinear, ("mesa_clamp", Clamp)),
                      _PatchEmbed: ("linear", MesaGemma4PatchEmbed, ("mesa_table", OneHotTable))}
    GATED_MLP_CLASSES = {_GatedMlp: MesaGemma4GatedMlp}
else:  # pragma: no cover
    GEMMA4_CLASSES, GATED_MLP_CLASSES = {}, {}

STOCK_GEMMA4_CLASSES = {mesa: stock for stock, (_, mesa, _) in GEMMA4_CLASSES.items()}
