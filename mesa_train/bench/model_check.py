"""A row's model checked before anything is measured (`mesa_train.bench.runner`, `search`):
built and patched on the meta device, no memory and no weights, so that a row its model
cannot take fails in one line naming the row before other rows have run for minutes."""
from __future__ import annotations

import torch

from mesa_train.bench.measure import MesaUnavailable, build_for_row
from mesa_train.bench.presets import BenchConfigError, RowConfig

__all__ = ["check_model"]


def _shape_key(row: RowConfig) -> tuple:
    # (the row's own model_kwargs too: an img_size named there is required, the row's is optional)
    return (row.model, repr(sorted(row.model_overrides().items())), "img_size" in row.model_kwargs,
            row.attention, row.grad_checkpointing, row.micro_batch)


_CHECKED: set[tuple] = set()


def check_model(row: RowConfig) -> None:
    """Build the model on the meta device and run one forward with the row's input shape,
    so a value the architecture cannot take fails here with a clear message, before any
    measurement starts. Also checks that checkpointing / fused attention are available.
    Rows that differ only in Mesa options, AMP or step counts share one check."""
    where = f"row {row.label!r} ({row.describe()})"
    _check_stock(row, where)
    if row.mesa:
        _check_patch(row, where)


def _check_stock(row: RowConfig, where: str) -> None:
    key = _shape_key(row)
    if key in _CHECKED:
        return
    try:
        with torch.device("meta"):
            model = build_for_row(row, device="meta", patch=False)
            x = torch.empty(row.micro_batch, 3, row.img_size, row.img_size)
            out = model(x)
    except BenchConfigError as err:
        raise BenchConfigError(f"{where}: {err}") from None
    except Exception as err:  # timm asserts, shape errors, bad kwargs
        raise BenchConfigError(f"{where}: the model cannot take this configuration: "
                               f"{type(err).__name__}: {err}") from None
    if tuple(out.shape) != (row.micro_batch, row.num_classes):
        raise BenchConfigError(f"{where}: unexpected output shape {tuple(out.shape)}")
    _CHECKED.add(key)


def _check_patch(row: RowConfig, where: str) -> None:
    """Patch the meta model (no forward: the quantizers need real tensors) to check the
    ops/modules for this model and that the attention kind stays the row's."""
    key = _shape_key(row) + (tuple(row.ops), tuple(row.modules), repr(sorted(row.quant.items())))
    if key in _CHECKED:
        return
    try:
        with torch.device("meta"):
            build_for_row(row, device="meta", patch=True)
    except MesaUnavailable:
        return  # reported (or skipped) by the runner
    except BenchConfigError as err:
        raise BenchConfigError(f"{where}: {err}") from None
    except Exception:  # noqa: BLE001 - patching on meta unsupported here; the real run reports
        return
    _CHECKED.add(key)
