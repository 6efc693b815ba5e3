"""mesa-train: 8-bit activation-compressed training (Mesa) for timm vision transformers.

The compression core (``mesa_train.quant``, ``mesa_train.nn``, ``mesa_train.patch``,
``mesa_train.memory``) imports no Hydra and no training code::

    import timm, mesa_train
    model = timm.create_model("deit_tiny_patch16_224")
    mesa_train.patch_model(model, ops=("all",))
    print(mesa_train.describe(model, example_input))   # + measured coverage of one training forward
"""
from importlib import import_module

__version__ = "0.1.0"

# Public names resolved lazily so `import mesa_train` stays cheap and never imports
# the training side (Hydra, data) by accident.
_LAZY = {
    "patch_model": "mesa_train.patch",
    "describe": "mesa_train.patch",
    "coverage": "mesa_train.patch.coverage",
    "stock_to_patched_state_dict": "mesa_train.patch",
    "patched_to_stock_state_dict": "mesa_train.patch",
    "SavedTensorMeter": "mesa_train.memory",
    "nn": "mesa_train.nn",
    "quant": "mesa_train.quant",
}

__all__ = sorted(_LAZY)


def __getattr__(name):
    if name in _LAZY:
        module = import_module(_LAZY[name])
        return module if module.__name__ == f"mesa_train.{name}" else getattr(module, name)
    raise AttributeError(f"module 'mesa_train' has no attribute {name!r}")
