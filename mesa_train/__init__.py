"""mesa-train: 8-bit activation-compressed training (Mesa) for timm vision transformers.

The compression core (``mesa_train.quant``, ``mesa_train.nn``, ``mesa_train.patch``,
``mesa_train.memory``) imports no Hydra and no training code::

    import timm, mesa_train
    model = timm.create_model("deit_tiny_patch16_224")
    mesa_train.patch_model(model, ops=("all",))
    print(mesa_train.describe(model, example_input))   # + measured coverage of one training forward
    mesa_train.skip_duplicated(model, example_input)   # layers whose copies other modules keep anyway: stock
"""
__version__ = "0.1.0"

# Explicit imports: the compression core only (quantizer ops, Mesa layers, model patching,
# the saved-bytes meter). None of them imports Hydra or the training side (mesa_train.train,
# mesa_train.bench), so `import mesa_train` stays usable on any timm model without them.
from mesa_train import nn, quant
from mesa_train.memory import SavedTensorMeter
from mesa_train.patch import (describe, patch_model, patched_to_stock_state_dict, skip_duplicated,
                              stock_to_patched_state_dict)
from mesa_train.patch.coverage import coverage
from mesa_train.quant.compile_kernels import set_compile_kernels

__all__ = [
    "SavedTensorMeter",
    "coverage",
    "describe",
    "nn",
    "patch_model",
    "patched_to_stock_state_dict",
    "quant",
    "set_compile_kernels",
    "skip_duplicated",
    "stock_to_patched_state_dict",
]
