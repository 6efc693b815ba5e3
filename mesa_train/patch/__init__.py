"""Patch unmodified timm models with Mesa compression, in place.

```python
import timm, mesa_train
model = timm.create_model("deit_tiny_patch16_224")
mesa_train.patch_model(model)                       # all ops, all modules (paper setting)
print(mesa_train.describe(model))
```

Supported with attention-core rules: timm ``vision_transformer`` (ViT/DeiT), ``swin_transformer``
(Swin-T/S/B/L) and ``pvt_v2`` (b0-b5; timm has no PVT v1, so the paper's PVT-Ti is
approximated by ``pvt_v2_b1``, which has the same size). Other models get the generic
leaf conversion (Linear/GELU/LayerNorm/Conv2d/ReLU/Softmax modules) and a report of the
functional ops it could not reach. Module map and contracts: ``docs/DESIGN.md``.
"""
from .core import ATTENTION_OPS, MODULE_SETS, OPS, patch_model
from .describe import describe
from .duplicates import skip_duplicated
from .checkpoint import (
    load_patched_checkpoint,
    load_stock_checkpoint,
    mesa_state_keys,
    patched_to_stock_state_dict,
    stock_to_patched_state_dict,
)

__all__ = [
    "patch_model",
    "describe",
    "skip_duplicated",
    "stock_to_patched_state_dict",
    "patched_to_stock_state_dict",
    "load_stock_checkpoint",
    "load_patched_checkpoint",
    "mesa_state_keys",
    "OPS",
    "MODULE_SETS",
    "ATTENTION_OPS",
]
