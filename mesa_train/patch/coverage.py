"""What Mesa compresses in *your* model, measured: ``coverage(model, example_input)``.

One training forward of the (patched) model on ``example_input`` under a
:class:`mesa_train.memory.SavedTensorMeter`; every byte autograd keeps for backward is
attributed to the innermost module running when it was saved, and grouped by op type:

* **compressed**: bytes kept by a Mesa layer (``linear``, ``layernorm``, ``matmul``, ...);
* **left as is**: bytes kept by anything else, by module class (``Dropout``,
  ``EvaAttention``, ``BatchNormAct2d``, ``<outside>`` for bytes saved outside every module,
  e.g. ``x + pos_embed`` in a model's own forward). These are what Mesa does not cover.

* **duplicated** (``Coverage.duplicated``): Mesa layers whose compressed tensor another
  module keeps in full anyway (a conv after a stock ReLU, which keeps its output; the convs
  of a RepVGG block beside its stock identity BatchNorm), so their copies add bytes instead
  of saving them: ``ops=["conv"]`` alone keeps 1.026x of stock's bytes on resnet18 (batch 2,
  64 px; 0.773x with ``relu`` too). The report names the modules that keep the tensors and their ops.

The stock figure is the same forward with every Mesa layer switched to its stock
computation (``enabled=False``: bitwise the stock forward and stock saved tensors), and each
patched attention on the path it was built with (``attention_as_built``: a fused timm attention
that ``ops=["softmax"]`` put on the explicit path is measured fused, as the stock model runs it;
until session 85 it was measured explicit, keeping an N x N map stock does not). The model's
buffers (running estimates, BatchNorm statistics), its Mesa options and the global RNG are
restored afterwards: measuring changes nothing.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch
from torch import nn

from mesa_train.memory import INPUT_AGNOSTIC_HOOK, SavedTensorMeter, format_bytes
from mesa_train.models import unwrap_module
from mesa_train.nn import MesaLayer
from mesa_train.nn.matmul import OPERANDS, MatMul

from .attention import ATTENTION_CLASSES, MesaViTAttention, attention_as_built
from .block import norm_fed_ids
from .core import PATCH_INFO_ATTR, _leaf_rules, mesa_layer_op
from .mlp import NORM_MLP_CLASSES
from .recompute import set_recompute
from .table import format_table

__all__ = ["Coverage", "coverage", "format_coverage", "stock_forwards"]


@dataclass
class Coverage:
    """``rows``: ``(kind, op, modules, bytes)`` with kind ``compressed`` / ``left as is``,
    largest first; ``total`` and ``stock_total`` are activation bytes."""

    rows: List[tuple] = field(default_factory=list)
    total: int = 0
    stock_total: int = 0
    # (op, Mesa layers, their bytes, {type of the module keeping the tensor in full: layers},
    # the ops not asked yet that would compress those modules)
    duplicated: List[tuple] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.total / max(self.stock_total, 1)

    @property
    def compressed_bytes(self) -> int:
        return sum(r[3] for r in self.rows if r[0] == "compressed")

    @property
    def uncovered_bytes(self) -> int:
        return sum(r[3] for r in self.rows if r[0] != "compressed")


@contextlib.contextmanager
def _untouched(model: nn.Module):
    """Restore buffers, Mesa options and the RNG after the measuring forwards."""
    saved = {k: b.detach().clone() for k, b in model.named_buffers()}
    options = {id(m): m.quant_options for m in model.modules() if isinstance(m, MesaLayer)}
    training = {id(m): m.training for m in model.modules()}
    recompute = {id(m): m.__dict__["mesa_recompute"] for m in model.modules() if "mesa_recompute" in m.__dict__}
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for k, b in model.named_buffers():
                    if k in saved and b.shape == saved[k].shape:
                        b.copy_(saved[k])
            for m in model.modules():
                if isinstance(m, MesaLayer) and id(m) in options:
                    m.set_quant_options(enabled=options[id(m)].enabled)
                if "mesa_recompute" in m.__dict__ and id(m) in recompute:
                    m.mesa_recompute = recompute[id(m)]
                m.training = training.get(id(m), m.training)


def _set_enabled(model: nn.Module, enabled: bool) -> None:
    set_recompute(model, enabled)
    for m in model.modules():
        if isinstance(m, MesaLayer):
            m.set_quant_options(enabled=enabled)


@contextlib.contextmanager
def stock_forwards(model: nn.Module):
    """Inside, ``model`` runs as the stock model it was patched from: every Mesa layer on its
    stock computation, recomputation off, each patched attention on the path it was built with
    (``attention_as_built``); after, its buffers, Mesa options, train flags and the RNG are as
    before. The stock figures of ``coverage`` and of training (``runner._stock_saved_bytes``)."""
    with _untouched(model):
        _set_enabled(model, False)
        with attention_as_built(model):
            yield


class _CompressedTensors:
    """While open, the tensors each Mesa layer is called with (a Softmax: its output, the
    tensor stock's keeps), as ``(weak reference to the storage, data pointer, bytes of the view,
    _version)``: a storage alive at the end has the address it had (one that died was kept by
    nobody), and the version tells values changed in place since (a stock layer keeping the new
    ones keeps no duplicate). Weak, so measuring pins no activation."""

    def __init__(self, root: nn.Module):
        self.held: Dict[str, List[tuple]] = {}
        self._handles = [m.register_forward_hook(self._hook(name)) for name, m in root.named_modules()
                         if isinstance(m, MesaLayer)]

    def _hook(self, name: str):
        def hold(module, args, output):
            if not module.quant_options.enabled:  # (stock: it copies nothing; skip_duplicated's switches)
                return
            if mesa_layer_op(module) == "softmax":
                kept = [(output, None)] if isinstance(output, torch.Tensor) else []
            elif isinstance(module, MatMul):  # (a, b by name, for a per-operand switch; not baddbmm's addend)
                kept = list(zip(args[:2], OPERANDS))
            else:
                kept = [(a, None) for a in args if isinstance(a, torch.Tensor)]
            self.held.setdefault(name, []).extend(
                (weakref.ref(t.untyped_storage()), t.untyped_storage().data_ptr(), t.numel() * t.element_size(),
                 t._version, label) for t, label in kept if isinstance(t, torch.Tensor) and t.numel())
        # it reads the arguments only to hold them, changes nothing and need not be called: the
        # fused paths (a block's norm + qkv in one call, patch/block.py) stay on
        setattr(hold, INPUT_AGNOSTIC_HOOK, True)
        return hold

    def close(self) -> None:
        for h in self._handles:
            h.remove()


def duplicated_layers(meter: SavedTensorMeter, held: Dict[str, List[tuple]]) -> Dict[str, tuple]:
    """Per Mesa layer that copied a tensor: ``(its own bytes, the bytes of the tensors it copied,
    of those the bytes another module keeps in full, those modules' names, the copied storages'
    data pointers, the MatMul operands every copy of which is such a duplicate)``. A layer's held
    tensors that it saved itself (kept in full: shared, no bytes added) are not its copies; layers
    that copied the same storages made one copy between them, and the ones that took it
    (``nn/input_copy.py``) have no bytes of their own. ``skip_duplicated`` leaves stock the layers
    whose copies are all duplicates, and a MatMul's duplicated operands where only some are."""
    out: Dict[str, tuple] = {}
    for name, tensors in held.items():
        own = meter.per_module.get(name, 0)
        copied = {}  # data pointer -> (elements' bytes, the other modules keeping it in full)
        labels: Dict[str, bool] = {}  # MatMul operand -> every copy of it duplicated
        for storage, ptr, size, version, label in tensors:
            savers = meter.savers(ptr, version) if storage() is not None else frozenset()
            if not any(k == name or k.startswith(f"{name}.") for k in savers):
                copied[ptr] = (size, sorted(savers))
                if label is not None:
                    labels[label] = labels.get(label, True) and bool(savers)
        if copied:
            out[name] = (own, sum(size for size, _ in copied.values()),
                         sum(size for size, keepers in copied.values() if keepers),
                         sorted({k for _, keepers in copied.values() for k in keepers}), frozenset(copied),
                         frozenset(label for label, all_kept in labels.items() if all_kept))
    return out


def _duplicated(modules: Dict[str, nn.Module], layers: Dict[str, tuple]):
    """``Coverage.duplicated``: per op, the Mesa layers whose copy of a tensor duplicates another
    module's full one (``duplicated_layers``), what those modules are, and the ops that would
    compress them which the patch did not ask for. A layer's bytes are shared among its copies by
    their sizes, and the duplicated ones' share is reported."""
    rules = _leaf_rules()
    asked = set((getattr(modules[""], PATCH_INFO_ATTR, None) or {}).get("ops", ()))
    out: Dict[str, list] = {}
    for name, (own, copied, duplicated, keepers, *_) in layers.items():
        if not own or not duplicated:
            continue
        entry = out.setdefault(mesa_layer_op(modules[name]), [0, 0, {}, set()])
        entry[0] += 1
        entry[1] += own * duplicated // copied
        for k in keepers:
            keeper = modules.get(k)
            kind = type(keeper).__name__ if keeper is not None else k
            entry[2][kind] = entry[2].get(kind, 0) + 1
            # (a stock timm attention on its fused path keeps the sdpa output: attn.proj's input)
            rule = rules.get(type(keeper)) or (("sdpa",) if type(keeper) in ATTENTION_CLASSES else None)
            if rule is not None and rule[0] not in asked:
                entry[3].add(rule[0])
    return sorted(((op, n, b, kinds, tuple(sorted(ops))) for op, (n, b, kinds, ops) in out.items()),
                  key=lambda r: -r[2])


def _measure(model: nn.Module, example_input, run: Optional[Callable], copies: bool = False):
    """The meter of one training forward, and with ``copies`` its ``duplicated_layers`` (else {}),
    read while the graph still holds the saved tensors."""
    model.train()
    held = _CompressedTensors(model) if copies else None
    try:
        meter, out = _metered_forward(model, example_input, run)
        layers = duplicated_layers(meter, held.held) if held is not None else {}
        del out
    finally:
        if held is not None:
            held.close()
    return meter, layers


class Measured(NamedTuple):
    total: int  # bytes one training forward keeps
    layers: Dict[str, tuple]  # duplicated_layers (empty without copies=True)
    per_module: Dict[str, int]  # SavedTensorMeter.per_module: each storage counted for its first saver


def measured_copies(model: nn.Module, example_input, run: Optional[Callable] = None,
                    copies: bool = True) -> Measured:
    """The bytes one training forward of ``model`` (the root, not a wrapper) keeps, with
    ``copies`` its ``duplicated_layers``, and the bytes per module; the model left as it was
    (``_untouched``)."""
    with _untouched(model):
        meter, layers = _measure(model, example_input, run, copies)
    return Measured(meter.activation_bytes, layers, dict(meter.per_module))


def _metered_forward(model: nn.Module, example_input, run: Optional[Callable]):
    with SavedTensorMeter(model) as meter:
        try:
            out = run(model, example_input) if run is not None else model(example_input)
        except (RuntimeError, ValueError, TypeError, AssertionError) as err:
            # the model's own error, e.g. timm's size check, said as what it is about
            shape = (tuple(example_input.shape) if isinstance(example_input, torch.Tensor)
                     else type(example_input).__name__)
            how = "run(model, example_input)" if run is not None else f"{type(model).__name__}(example_input)"
            message = f"describe / coverage: {how} failed for example_input {shape}: {err}"
            try:
                wrapped = type(err)(message)
            except Exception:  # (an exception type whose constructor takes other arguments)
                wrapped = RuntimeError(message)
            raise wrapped from err
    return meter, out


def coverage(model: nn.Module, example_input, *, run: Optional[Callable] = None) -> Coverage:
    """Saved bytes per op type of one training forward, compressed vs left as is, and the
    ratio to stock. ``run(model, example_input)`` replaces ``model(example_input)`` for
    models that take more than one tensor."""
    root = unwrap_module(model, "coverage")
    modules: Dict[str, nn.Module] = dict(root.named_modules())
    norm_fed = norm_fed_ids(root)
    with _untouched(root):
        meter, layers = _measure(root, example_input, run, copies=True)  # as the user set it up
    with stock_forwards(root):
        stock, _ = _measure(root, example_input, run)
    groups: Dict[tuple, list] = {}
    for name, nbytes in meter.per_module.items():
        mod = modules.get(name)
        op = mesa_layer_op(mod) if mod is not None else None
        # a shared-copy MLP: its fc2(gelu(h)) ran as one Function, one copy for both (patch/mlp.py),
        # and so did fc1(norm2(x)) (a SwiGLU's fc1_g and fc1_x) in a patched block (patch/block.py)
        if type(mod) in NORM_MLP_CLASSES:
            op = "shared copies (mlp)"
        # a ViT block's qkv(norm1(x)): one Function called by the attention itself (the only
        # bytes the attention module saves directly where its qkv takes the norm's copy)
        elif type(mod) is MesaViTAttention and id(mod.qkv) in norm_fed:
            op = "layernorm+linear (qkv)"
        key = ("compressed", op) if op is not None else ("left as is", type(mod).__name__ if mod is not None else name)
        entry = groups.setdefault(key, [0, 0])
        entry[0] += nbytes
        entry[1] += 1
    rows = sorted(((k[0], k[1], n, b) for k, (b, n) in groups.items()), key=lambda r: -r[3])
    return Coverage(rows=rows, total=meter.activation_bytes, stock_total=stock.activation_bytes,
                    duplicated=_duplicated(modules, layers))


def format_coverage(cov: Coverage) -> str:
    total = max(cov.total, 1)
    body = [[kind, op, str(n), format_bytes(b), f"{100 * b / total:.1f}%"] for kind, op, n, b in cov.rows]
    table = format_table(["saved as", "op / module type", "modules", "bytes", "share"], body, "llrrr")
    text = (f"saved for backward in one training forward: {format_bytes(cov.total)} "
            f"= {cov.ratio:.3f}x stock ({format_bytes(cov.stock_total)}); compressed "
            f"{format_bytes(cov.compressed_bytes)}, left as is {format_bytes(cov.uncovered_bytes)}\n{table}")
    return text + "".join("\n" + _duplicated_line(*row) for row in cov.duplicated)


def _duplicated_line(op: str, layers: int, nbytes: int, kinds: Dict[str, int], ops: Tuple[str, ...]) -> str:
    """One ``Coverage.duplicated`` row as advice: what keeps the tensors, and the ops to ask."""
    keepers = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    advice = f"ask for {', '.join(ops)} too, or leave them stock" if ops else "leave them stock"
    return (f"duplicated: {layers} {op} layers keep {format_bytes(nbytes)} of copies of tensors other modules "
            f"keep in full ({keepers}): {advice}")
