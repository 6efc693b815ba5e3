"""Two sets of Inductor options on one compiled model, steps interleaved in one process: what a
compile option does to a step's host time, too little for a bench preset's rows to resolve.

    PYTHONPATH=. python scripts/compile_ab.py                          # Mesa: torch's asserts vs compile_model's
    PYTHONPATH=. python scripts/compile_ab.py --stock --steps 300
    PYTHONPATH=. python scripts/compile_ab.py --a '{"size_asserts": true}' --b '{}' --reverse
    PYTHONPATH=. python scripts/compile_ab.py --skip-guards [--stock]   # what Dynamo's guards cost a step

The model is the cpu-host preset's (configs/bench/preset/cpu-host.yaml, built as the bench builds
its rows: a 12-block ViT of width 48, 3 heads, on 5 tokens, fp32, explicit attention; AdamW, one
thread), its "Mesa compiled" row (every op) or with --stock its "stock compiled" row, compiled
twice through `compile_scope.compile_model` (scope "model"), once with each
option set. Each copy gets a forward with a code object of its own: Dynamo caches compiled code
per code object and tries the most recently used entry first, so two copies of one class would
each first evaluate the other's guards at every call (measured here: about 0.2-0.5 ms a step of
10-16, the same for stock and Mesa). The first variant compiled tends to time slower (0.3-0.6 ms
in the runs of docs/DESIGN.md): run both orders (--reverse).

--skip-guards compiles once (with --b's options) and interleaves steps of that one compiled
model with Dynamo's guards evaluated (the default) and skipped
(`torch.compiler.set_stance(skip_guard_eval_unsafe=True)`, which runs only the guards that tell
its cache entries apart): what the cache lookup costs a step, measured in place. (Timing the
guard check in a loop, as scripts/guard_census.py does, finds its objects in the CPU's caches;
inside a training step they are not.) A measurement, not a setting to train with: skipping the
guards is unsafe when an input or the model changes after warm-up.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types

import torch

from mesa_train.bench.preset_model import preset_model
from mesa_train.compile_scope import compile_model, unknown_option_message

# torch.compile's defaults for the two checks compile_model turns off (WRAPPER_INDUCTOR_OPTIONS)
TORCH_ASSERTS = {"size_asserts": True, "alignment_asserts": True}


def build(mesa: bool, tag: str, depth: int = 12) -> torch.nn.Module:
    """The cpu-host preset's model (its "Mesa compiled" or "stock compiled" row, ``depth``
    blocks), its class's forward given a code object of its own named by ``tag``."""
    torch.manual_seed(0)
    model = preset_model("cpu-host", "Mesa compiled" if mesa else "stock compiled", depth=depth)
    base = type(model)
    forward = types.FunctionType(base.forward.__code__.replace(co_name=f"forward_{tag}"), base.forward.__globals__,
                                 None, base.forward.__defaults__)
    forward.__kwdefaults__ = base.forward.__kwdefaults__
    model.__class__ = type(f"{base.__name__}_{tag}", (base,), {"forward": forward})
    return model.train()


def options(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise SystemExit(f"compile_ab.py: options must be a JSON object, got {text!r} ({err.msg})") from None
    if not isinstance(value, dict):
        raise SystemExit(f"compile_ab.py: options must be a JSON object, got {text!r}")
    for name in value:
        message = unknown_option_message(name)
        if message is not None:
            raise SystemExit(f"compile_ab.py: {message}")
    return value


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=options, default=TORCH_ASSERTS, help="options of variant A (JSON; default: "
                    "torch.compile's asserts on)")
    ap.add_argument("--b", type=options, default={}, help="options of variant B (JSON; default: none, i.e. "
                    "compile_model's own)")
    ap.add_argument("--stock", action="store_true", help="the stock model instead of the patched one")
    ap.add_argument("--steps", type=int, default=200, help="timed steps of each variant (interleaved)")
    ap.add_argument("--reverse", action="store_true", help="compile (and step) B before A")
    ap.add_argument("--depth", type=int, default=12, help="blocks (the cpu-host model's 12; fewer compile faster)")
    ap.add_argument("--skip-guards", action="store_true", help="one compile (--b's options), steps with Dynamo's "
                    "guards evaluated against skipped (skip_guard_eval_unsafe), interleaved")
    args = ap.parse_args(argv)
    for flag in ("steps", "depth"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"compile_ab.py: --{flag} must be at least 1, got {getattr(args, flag)}")
    if args.skip_guards and args.reverse:
        raise SystemExit("compile_ab.py: --skip-guards times one compiled model (--b's options); --reverse has no "
                         "second compile to order")
    torch.set_num_threads(1)
    variants = [("A", args.a), ("B", args.b)]
    if args.reverse:
        variants.reverse()
    x, y = torch.randn(2, 3, 32, 32), torch.randint(0, 10, (2,))

    def step(model, opt):
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    if args.skip_guards:
        return _skip_guards(args, step)
    runs = {name: _compiled_and_warm(args, name, opts, step) for name, opts in variants}
    times = {name: [] for name in runs}
    for _ in range(args.steps):
        for name, (compiled, opt) in runs.items():
            times[name].append(_seconds(step, compiled, opt))
    med = _median_ms(times)
    model = "stock" if args.stock else "Mesa (all ops)"
    print(f"{model}, cpu-host model ({args.depth} blocks), {args.steps} interleaved steps, "
          f"compiled in the order {' '.join(runs)}:")
    for name, opts in sorted(variants):
        print(f"  {name} {json.dumps(opts)}: {med[name]:.2f} ms a step (median)")
    print(f"  B - A: {med['B'] - med['A']:+.2f} ms a step; B / A: {med['B'] / med['A']:.3f}")
    return 0


def _seconds(step, compiled, opt) -> float:
    start = time.perf_counter()
    step(compiled, opt)
    return time.perf_counter() - start


def _median_ms(times: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def _compiled_and_warm(args, tag: str, options: dict, step):
    """(compiled model, its optimizer) after two steps: the model built for ``tag`` (a forward
    code object of its own), compiled by compile_model with ``options``, then compiled and warm."""
    model = build(not args.stock, tag, args.depth)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    compiled = compile_model(model, "model", options=dict(options))
    for _ in range(2):
        step(compiled, opt)
    return compiled, opt


def _skip_guards(args, step) -> int:
    """One compiled model, steps alternating between guards evaluated and skipped (which goes
    first alternates too), medians of each."""
    compiled, opt = _compiled_and_warm(args, "G", args.b, step)
    times = {"evaluated": [], "skipped": []}
    for i in range(args.steps):
        for name in ("evaluated", "skipped") if i % 2 else ("skipped", "evaluated"):
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=name == "skipped"):
                times[name].append(_seconds(step, compiled, opt))
    med = _median_ms(times)
    what = "stock" if args.stock else "Mesa (all ops)"
    print(f"{what}, cpu-host model ({args.depth} blocks), one compile {json.dumps(args.b)}, {args.steps} steps "
          "each, interleaved:")
    print(f"  guards evaluated: {med['evaluated']:.2f} ms a step (median)")
    print(f"  guards skipped (skip_guard_eval_unsafe): {med['skipped']:.2f} ms a step (median)")
    print(f"  the guards: {med['evaluated'] - med['skipped']:+.2f} ms a step")
    return 0


if __name__ == "__main__":
    sys.exit(main())
