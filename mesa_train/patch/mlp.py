"""Mesa forwards for timm's gated MLPs (``SwiGLU``, ``GluMlp``), installed like the
attention ones (``attention.py``): the instance's class is swapped for a subclass whose
forward is the stock one line for line, except that ``act(gate) * x`` runs through a
``gated`` child (:class:`mesa_train.nn.GatedActivation`, 8-bit gate and value). The
Linear children (``fc1_g``/``fc1_x``/``fc1``, ``fc2``) and norms are converted by the
ordinary leaf conversion; the MLP's ``act`` is not (``gated`` runs it), so it stays stock.
"""
from __future__ import annotations

import torch
from timm.layers.mlp import GluMlp as _GluMlp, SwiGLU as _SwiGLU

__all__ = ["MesaSwiGLU", "MesaGluMlp", "MLP_CLASSES", "STOCK_MLP_CLASSES"]


class MesaSwiGLU(_SwiGLU):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_gate = self.fc1_g(x)
        x = self.fc1_x(x)
        x = self.gated(x_gate, x)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


class MesaGluMlp(_GluMlp):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)
        x1, x2 = x.chunk(2, dim=self.chunk_dim)
        x = self.gated(x2, x1) if self.gate_last else self.gated(x1, x2)
        x = self.drop1(x)
        x = self.norm(x)
        x = self.fc2(x)
        x = self.drop2(x)
        return x


MLP_CLASSES = {_SwiGLU: MesaSwiGLU, _GluMlp: MesaGluMlp}
STOCK_MLP_CLASSES = {v: k for k, v in MLP_CLASSES.items()}
