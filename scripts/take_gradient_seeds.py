"""Is the take (``TAKES_INPUT``: an identity BatchNorm keeping, as its x_hat, the codes a conv
made of the same input) worse for gradients than the BatchNorm compressing x_hat itself?

Per model (ghostnetv3_050, fastvit_t8), two sweeps of N seeds, before (takers unmarked) and after
paired on each seed: ``input``, a fresh x per seed with patch_model's rounding keys; ``rounding``,
scripts/identity_norm_bytes.py's x with every quantizer's key crc32(name + '#s') (s = 0 keeps
patch_model's keys; torch.manual_seed does not move Mesa's rounding). Fresh copies per seed (a
first step). Per parameter: cosine and relative error against a float64 stock copy, over the
parameters whose float32 stock gradient agrees with it (cosine > 0.999), as that script does.
One thread (fp32 summation order moves the worst cosine by ~0.02). About 6 minutes for N = 48:

    PYTHONPATH=. OMP_NUM_THREADS=1 python scripts/take_gradient_seeds.py 48 > /tmp/take.json
    python scripts/take_gradient_seeds.py --analyse /tmp/take.json

(session 86: results/timm/sweep.md; written by a review helper.)
"""
from __future__ import annotations

import collections
import copy
import json
import math
import statistics
import sys
import time

import timm
import torch
import torch.nn.functional as F

from mesa_train.nn.batchnorm import TAKES_INPUT
from mesa_train.nn.quantizer import ActivationQuantizer, rng_key
from mesa_train.patch import patch_model


def step(model, x):
    torch.manual_seed(1)  # (as the script: only dropout / drop path draw from it)
    model(x).square().sum().backward()
    return {n: p.grad.double().flatten() for n, p in model.named_parameters()}


def unmarked(model, flags=(TAKES_INPUT,)):
    model = copy.deepcopy(model)
    for m in model.modules():
        for flag in flags:
            m.__dict__.pop(flag, None)
    return model


def rekey(model, s):
    if s == 0:
        return model
    for name, m in model.named_modules():
        if isinstance(m, ActivationQuantizer):
            m._rng_key = rng_key(f"{name}#{s}")
            with torch.no_grad():
                m.rng[0] = m._rng_key
                m.rng[1] = 0
    return model


def cos(a, b):
    return F.cosine_similarity(a, b, 0).item()


def groups_of(model, name):
    mods = dict(model.named_modules())
    takers = [n for n, m in mods.items() if m.__dict__.get(TAKES_INPUT)]
    taker_p = [f"{t}.{w}" for t in takers for w in ("weight", "bias")]
    if name.startswith("ghostnet"):  # cheap_rpr_skip takes the codes its sibling cheap_rpr_scale's conv made
        partner_p = [t.rsplit(".", 1)[0] + ".cheap_rpr_scale.conv.weight" for t in takers]
        partner_bn = [t.rsplit(".", 1)[0] + f".cheap_rpr_scale.bn1.{w}" for t in takers for w in ("weight", "bias")]
    else:  # token_mixer.norm.identity takes the codes token_mixer.mixer.identity offered (also taken by mixer convs)
        mixers = [t.rsplit(".", 2)[0] + ".mixer" for t in takers]
        partner_p = [f"{mx}.identity.{w}" for mx in mixers for w in ("weight", "bias")]
        partner_bn = [n for n, _ in model.named_parameters()
                      if any(n.startswith(mx + ".conv_") for mx in mixers) and n.endswith("conv.weight")]
    names = set(n for n, _ in model.named_parameters())
    for g in (taker_p, partner_p, partner_bn):
        assert all(n in names for n in g), [n for n in g if n not in names]
    return takers, {"taker": taker_p, "partner": partner_p, "partner2": partner_bn}



def measure(n_seeds: int) -> dict:
    start = time.time()
    torch.set_num_threads(1)
    out = {}
    for name in ("ghostnetv3_050", "fastvit_t8"):
        torch.manual_seed(0)
        stock = timm.create_model(name, num_classes=10).train()
        after0 = patch_model(copy.deepcopy(stock)).train()
        before0 = unmarked(after0)
        x_script = torch.randn(2, 3, 64, 64)
        takers, groups = groups_of(after0, name)
        out[name] = {"takers": takers, "groups": groups, "runs": []}
        for sweep in ("input", "rounding"):
            for s in range(n_seeds):
                x = (torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1000 + s))
                     if sweep == "input" else x_script)
                key = s if sweep == "rounding" else 0
                exact = step(copy.deepcopy(stock).double(), x.double())
                fp32 = step(copy.deepcopy(stock), x)
                grads = {"before": step(rekey(copy.deepcopy(before0), key), x),
                         "after": step(rekey(copy.deepcopy(after0), key), x)}
                measured = [n for n in exact if exact[n].norm() > 0 and cos(fp32[n], exact[n]) > 0.999]
                rec = {"sweep": sweep, "seed": s, "measured": measured}
                every = torch.cat([fp32[n] for n in fp32])
                for label, g in grads.items():
                    per = {n: (cos(g[n], exact[n]), ((g[n] - exact[n]).norm() / exact[n].norm()).item())
                           for n in measured}
                    worst = min(per, key=lambda n: per[n][0])
                    rec[label] = {"all_cos": cos(torch.cat([g[n] for n in fp32]), every), "worst": per[worst][0],
                                  "worst_name": worst, "per": per}
                out[name]["runs"].append(rec)
                print(f"{time.time() - start:.0f}s", name, sweep, s,
                      f"{rec['before']['worst']:.4f} {rec['after']['worst']:.4f}", file=sys.stderr, flush=True)
    return out


def sign_p(k: int, n: int) -> float:
    """Two-sided sign test."""
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(0, min(k, n - k) + 1)) / 2 ** n)


def analyse(data: dict) -> None:
    med = statistics.median
    for name, d in data.items():
        groups = dict(d["groups"])
        groups["taker_w"] = [n for n in groups["taker"] if n.endswith(".weight")]
        groups["taker_b"] = [n for n in groups["taker"] if n.endswith(".bias")]
        for sweep in ("input", "rounding", "both"):
            runs = [r for r in d["runs"] if sweep == "both" or r["sweep"] == sweep]
            print(f"== {name} sweep={sweep} n={len(runs)}")
            for key, label in (("worst", "worst-tensor cos"), ("all_cos", "all-grad cos vs fp32")):
                b, a = [r["before"][key] for r in runs], [r["after"][key] for r in runs]
                diff = [y - x for x, y in zip(b, a)]
                worse, better = sum(v < 0 for v in diff), sum(v > 0 for v in diff)
                print(f"  {label}: before med {med(b):.4f} min {min(b):.4f} | after med {med(a):.4f} min {min(a):.4f}"
                      f" | after-before med {med(diff):+.5f} worse {worse}/{len(diff)}"
                      f" sign p {sign_p(worse, worse + better):.3f}")
            for g in ("taker_w", "taker_b", "partner", "partner2", "all"):
                bs, as_ = [], []
                for r in runs:
                    names = r["measured"] if g == "all" else [n for n in groups[g] if n in r["measured"]]
                    if names:
                        bs.append(med(r["before"]["per"][n][1] for n in names))
                        as_.append(med(r["after"]["per"][n][1] for n in names))
                diff = [y - x for x, y in zip(bs, as_)]
                worse, better = sum(v > 0 for v in diff), sum(v < 0 for v in diff)
                print(f"  relative error [{g}]: before {med(bs):.4f} after {med(as_):.4f} worse {worse}/{len(diff)} "
                      f"sign p {sign_p(worse, worse + better):.3f}")
            names = collections.Counter(r["before"]["worst_name"] for r in runs)
            same = sum(r["before"]["worst_name"] == r["after"]["worst_name"] for r in runs)
            print(f"  worst tensor (before): {names.most_common(3)}; the same before and after in {same}/{len(runs)}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--analyse"]:
        with open(sys.argv[2]) as f:
            analyse(json.load(f))
    else:
        json.dump(measure(int(sys.argv[1]) if len(sys.argv) > 1 else 32), sys.stdout)
