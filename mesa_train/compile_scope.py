"""What ``torch.compile`` compiles: the whole model, or each of its repeated blocks.

``scope="model"`` compiles the model as one graph (``torch.compile(model)``). ``scope="blocks"``
compiles every block of the model's ``blocks`` containers in place (``block.compile()``, timm's
convention: ``VisionTransformer.blocks``, each Swin / PVT-v2 / ConvNeXt stage's ``blocks``) and
leaves the rest (patch embedding, final norm, head) eager: regional compilation, as torchtitan
compiles each transformer block.

Why: identical blocks share one compiled graph (Dynamo guards on the code and the shapes, not
on the module instance), so the compile time is that of one block, not of the whole depth.
With Mesa's compression traced for Inductor (``compile_kernels=traceable``) Inductor's code
generation grows with the graph: on this project's 2-core CPU a 4-block tiny DeiT compiled in
406 s as one graph and in 102 s per block (Scheduler.codegen 289 s against 70 s), and the
12-block DeiT-S did not compile in 6 minutes on an H100 as one graph. Within a block the
graph is still whole (``fullgraph=True`` by default: a graph break is an error).
This holds for attention reached generically too (EVA, BEiT, CaiT...:
``patch/generic_attention.py``): its capture runs inside the module's forward through one
shared function, so EVA-02's blocks share one graph (per-module capture hooks with
``always_call=True`` had given one graph per block: Dynamo guarded on each hook's id).

The state-dict keys do not change (``Module.compile`` keeps the module, unlike the
``_orig_mod.`` wrapper), so checkpoints load into either scope.

Inductor options for the traced compression (:data:`TRACED_INDUCTOR_OPTIONS`): Inductor
writes to memory, and reads back, any pointwise value whose expression has grown past
``realize_opcount_threshold`` operations (30 for GPU code). The traced stochastic rounding (the
rescale, a counter hash of about 20 integer operations, the clamp) crosses it mid-hash: the
traced quantize wrote and read a numel-sized int32 buffer beside its 1-byte codes, 8 bytes an
element (seen in Inductor's code on CPU, ``tests/test_compile_scope.py``), and on an H100 the
traced quantize of a DeiT-S attention map ran at a third of clone's bandwidth. A model with
Mesa layers compiled by Inductor with the traced compression gets a higher threshold; a stock
model, or Mesa's opaque ops, the defaults. And a joint-graph pass,
:class:`mesa_train.quant.save_codes.SaveCodes`, that keeps the codes for backward where the
partitioner would otherwise save a dequantized bf16 copy (its module doc). And
``coordinate_descent_tuning``: the traced compression makes the kernel that produces an
activation compute its row segments' min/max, so a pointwise producer (GELU) becomes a
persistent row reduction, and the softmax carries a hash and a quantize per element. Inductor
launches a persistent row reduction as one warp with 32 elements a thread (its heuristic for a
LayerNorm); with Mesa's work per element those kernels hold 128 and 166 registers a thread on
sm_90 (stock's softmax 72), 16 and 12 resident warps an SM, too few to hide latency, while one
row a program keeps 34-64 registers and twice or more the warps for about the same
instructions an element (``scripts/triton_sass.py``, DeiT-S block: its machine code read
without a GPU). Which is faster is for the GPU to time: coordinate descent times each kernel's
neighbouring XBLOCK and warp counts at its first run and keeps the fastest (compile time not yet
measured on a GPU; a caller's ``options={"coordinate_descent_tuning": False}`` turns it off).

On a torch before 2.14, :func:`compile_model` first applies :mod:`mesa_train.inductor_backports`
(Inductor's persistent-reduction decision with the tiling scores), for stock and Mesa models
alike: without it torch 2.11 writes a DeiT-S softmax, and the traced coding kernels, as loops.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from mesa_train import inductor_backports
from mesa_train.models import unwrap_model
from mesa_train.nn._common import MesaLayer
from mesa_train.nn.sdpa import ScaledDotProductAttention
from mesa_train.nn.sdpa_backward import DROPOUT_WHY
from mesa_train.quant.compile_kernels import traced_when_compiled
from mesa_train.quant.save_codes import SaveCodes

__all__ = ["SCOPES", "TRACED_INDUCTOR_OPTIONS", "WRAPPER_INDUCTOR_OPTIONS", "attention_dropout_modules",
           "close_inductor_options", "compile_model", "inductor_kwargs", "repeated_blocks", "unknown_option_message"]

SCOPES = ("model", "blocks")

# the container attribute name timm gives a model's (or a stage's) sequence of repeated blocks
_BLOCK_CONTAINER = "blocks"

# Inductor options for every model compiled here, stock or Mesa, so that the bench compares
# the two compiled alike: no runtime asserts in the generated Python wrapper. Inductor checks
# each output of an extern op against its fake kernel's size, stride and dtype at every call
# (`assert_tensor_metadata`, a Python function), and each graph input's and a Mesa op's
# state buffers' layout (`assert_size_stride_grouped`). A patched ViT calls about 240
# mesa:: ops a step with 1 to 4 outputs each. On the cpu-host model (scripts/compile_ab.py)
# the checks cost compiled Mesa 0.4-0.8 ms of its 17-19 ms step and stock 0-0.3 ms of 11-12:
# host time that a compiled GPU step with default launches waits on (docs/DESIGN.md, "Under
# torch.compile"). What they check, the mesa:: fakes against the kernels, the tests check
# with opcheck; Dynamo's guards still check the forward's inputs. A caller's options win, and
# so does the environment variable that sets one in torch._inductor.config (to debug a fake
# kernel: TORCHINDUCTOR_SIZE_ASSERTS=1).
WRAPPER_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}

# Inductor options when Mesa's compression is traced (module doc): the traced quantize's
# expression (about 60 operations with the rescale and the clamp) stays one fused expression;
# the dequantize chains run in backward from the saved codes; the GPU times each fused kernel's
# launch shape instead of taking the heuristic's one warp a row block
TRACED_INDUCTOR_OPTIONS = {"realize_opcount_threshold": 128, "joint_custom_post_pass": SaveCodes(),
                           "coordinate_descent_tuning": True}


def close_inductor_options(name: str) -> list[str] | None:
    """``None`` where ``name`` is an Inductor option (``torch._inductor.config``, what
    ``torch.compile(options=...)`` takes), else the options whose names are close to it (for
    the one-line error of a bench row's ``compile_options`` or a script's flag)."""
    import difflib

    import torch._inductor.config as inductor_config

    known = inductor_config.get_config_copy()
    return None if name in known else difflib.get_close_matches(str(name), list(known), n=3)


# options torch.compile takes out of `options` itself before handing the rest to Inductor
# (torch/__init__.py, compile: a guard filter, AOTInductor); not in torch._inductor.config
TORCH_COMPILE_OWN_OPTIONS = ("guard_filter_fn", "use_aoti")


def unknown_option_message(name: str) -> str | None:
    """``None`` where ``name`` is an Inductor option, else one line naming the close ones
    (torch.compile's own error lists all ~600 of them): what compile_model and the scripts that
    take Inductor options say."""
    close = close_inductor_options(name)
    if close is None:
        return None
    hint = f"; close: {', '.join(close)}" if close else ""
    return f"{name!r} is not an Inductor option (torch._inductor.config){hint}"


def _check_option_names(options: dict) -> None:
    for name in options:
        message = None if name in TORCH_COMPILE_OWN_OPTIONS else unknown_option_message(name)
        if message is not None:
            raise ValueError(f"compile option {message}")


def inductor_kwargs(model: nn.Module, compile_kwargs: dict) -> dict:
    """``compile_kwargs`` with Inductor's options added where Inductor (the default backend)
    compiles: :data:`WRAPPER_INDUCTOR_OPTIONS` for any model, and :data:`TRACED_INDUCTOR_OPTIONS`
    for a model with Mesa layers whose compression is traced. A ``mode`` becomes its options
    (``torch.compile`` takes one or the other), which options given by the caller override."""
    if compile_kwargs.get("backend", "inductor") != "inductor":
        return compile_kwargs
    kwargs = dict(compile_kwargs)
    mode = kwargs.pop("mode", None)
    # (as torch.compile turns a mode into options: list_mode_options(mode, dynamic))
    options = dict(torch._inductor.list_mode_options(mode, kwargs.get("dynamic"))) if mode not in (None, "default") \
        else {}
    # (torch._inductor.config reads each of them from TORCHINDUCTOR_<NAME>; one the user set is theirs)
    options.update({name: value for name, value in WRAPPER_INDUCTOR_OPTIONS.items()
                    if f"TORCHINDUCTOR_{name.upper()}" not in os.environ})
    if traced_when_compiled() and any(isinstance(m, MesaLayer) for m in unwrap_model(model).modules()):
        options.update(TRACED_INDUCTOR_OPTIONS)
    given = kwargs.pop("options", None) or {}
    _check_option_names(given)
    options.update(given)
    kwargs["options"] = options
    return kwargs


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(qualified name, block) of every child of a ``blocks`` container (``nn.Sequential`` or
    ``nn.ModuleList``) in ``model``, outermost containers first; a container inside a found
    block is part of that block's region, not a region of its own. A child that is itself an
    ``nn.ModuleList`` (Twins: one list of blocks per stage) is iterated by its model, never
    called, so its children are the blocks (compiled or sharded as a list, nothing would run
    compiled, and FSDP's hooks on it would never fire)."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in unwrap_model(model).named_modules():
        if name.rsplit(".", 1)[-1] != _BLOCK_CONTAINER or not isinstance(module, (nn.Sequential, nn.ModuleList)):
            continue
        if any(name.startswith(block_name + ".") for block_name, _ in found):
            continue
        for i, block in module.named_children():
            found += _called_modules(f"{name}.{i}", block)
    return found


def _called_modules(name: str, module: nn.Module) -> list[tuple[str, nn.Module]]:
    """``module`` itself, or the modules of an ``nn.ModuleList`` (which is never called), recursively."""
    if not isinstance(module, nn.ModuleList):
        return [(name, module)]
    return [found for i, child in module.named_children() for found in _called_modules(f"{name}.{i}", child)]


def _attention_dropout(module: nn.Module) -> float:
    """The dropout probability ``module`` hands its attention call in training: timm's
    ``attn_drop`` (an ``nn.Dropout``, or a float in some models). Not ``nn.MultiheadAttention``'s
    ``dropout``: its default call (``need_weights=True``) runs the explicit core, which traces,
    and only a ``need_weights=False`` call reaches the sdpa (Dynamo's message then says why)."""
    drop = getattr(module, "attn_drop", None)
    return float(drop.p if isinstance(drop, nn.Dropout) else drop if isinstance(drop, (int, float)) else 0.0)


def attention_dropout_modules(model: nn.Module) -> list[str]:
    """The modules in training mode whose Mesa fused attention gets a dropout > 0 (timm's
    ``attn_drop``): under ``torch.compile`` each of their calls runs eagerly
    (``DROPOUT_UNTRACEABLE``), a graph break."""
    return [name for name, m in unwrap_model(model).named_modules()
            if m.training and _attention_dropout(m) > 0
            and any(isinstance(c, ScaledDotProductAttention) for c in m.children())]


def _refuse_checkpointed_mesa_blocks(model: nn.Module) -> None:
    """A block compiled on its own inside timm's (eager) activation checkpointing runs its whole
    compiled graph again in the recomputation, and that graph writes the Mesa quantizers' state:
    every step would update the estimates and rounding counters twice (``nn/checkpoint_phase.py``
    tells an eager recomputation apart; a compiled graph cannot ask). Compiled as one model, the
    graph recomputes what it saves and updates the state once."""
    modules = list(unwrap_model(model).modules())
    if any(getattr(m, "grad_checkpointing", False) is True for m in modules) and any(
            isinstance(m, MesaLayer) for m in modules):
        raise ValueError("compile scope 'blocks' with activation checkpointing (set_grad_checkpointing) on a Mesa "
                         "model: each block's compiled graph would run again in the recomputation and update the "
                         "Mesa estimates twice a step; valid choices: compile scope 'model', or no checkpointing")


def compile_model(model: nn.Module, scope: str = "model", *, fullgraph: bool = True, **compile_kwargs) -> nn.Module:
    """Compile ``model`` as ``scope`` says and return what to call in its place.

    ``"model"``: ``torch.compile(model, fullgraph=..., **compile_kwargs)`` (a new wrapper).
    ``"blocks"``: each block from :func:`repeated_blocks` compiled in place with static shapes
    (``dynamic=False`` unless given: blocks of different widths, as in Swin's stages, each get
    their own graph instead of one with symbolic shapes), and ``model`` itself returned. Dynamo's
    recompile limit is raised to twice the number of blocks where it is lower: every distinct
    block (Swin's shifted and unshifted windows, each stage's width) and mode (train, eval) is
    a graph of the one block forward, and past the limit Dynamo would run the rest eager.
    """
    if scope not in SCOPES:
        raise ValueError(f"compile scope must be one of {', '.join(SCOPES)}, got {scope!r}")
    dropping = attention_dropout_modules(model) if fullgraph else []
    if dropping:  # (refused here, naming the modules, not by Dynamo's error at the first step)
        raise ValueError(f"fullgraph compile of a model whose Mesa attention has dropout > 0 ({len(dropping)} "
                         f"modules: {', '.join(dropping[:2])}{', ...' if len(dropping) > 2 else ''}): "
                         f"{DROPOUT_WHY}")
    inductor_backports.install()  # (stock or Mesa: the same Inductor for both)
    compile_kwargs = inductor_kwargs(model, compile_kwargs)
    if scope == "model":
        return torch.compile(model, fullgraph=fullgraph, **compile_kwargs)
    _refuse_checkpointed_mesa_blocks(model)
    blocks = repeated_blocks(model)
    if not blocks:
        raise ValueError(f"compile scope 'blocks': {type(unwrap_model(model)).__name__} has no '{_BLOCK_CONTAINER}' "
                         "container (nn.Sequential / nn.ModuleList) of blocks; valid choices for it: model")
    compile_kwargs.setdefault("dynamic", False)
    if torch._dynamo.config.recompile_limit < 2 * len(blocks):
        torch._dynamo.config.recompile_limit = 2 * len(blocks)
    for _, block in blocks:
        block.compile(fullgraph=fullgraph, **compile_kwargs)
    return model
