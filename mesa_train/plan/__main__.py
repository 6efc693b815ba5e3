"""``python -m mesa_train.plan budget=0.6``: plan, print, write (see configs/plan.yaml).

Exit codes: 0 ok, 2 bad configuration or budget (one line ``error: ...``)."""
from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from mesa_train.hydra_cli import exit_on_bad_overrides

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")

_AMP = {"none": None, "fp32": None, "bf16": "bfloat16", "fp16": "float16"}
# train.py's groups this command reads (configs/plan.yaml's defaults), and its own settings
TRAIN_GROUPS = ("model", "data", "mesa", "trainer")
OWN_KEYS = ("budget", "budget_gb", "out", "rounds", "measure", "threads", "seed")


def refuses_new_key(key: str) -> bool:
    """Whether '+key' would be refused or do nothing here (hydra_cli advises '+' only where it
    does something): a top-level key other than this command's own and the groups it reads
    (train.py's optim or name pass ``_check_settings``, as an experiment= preset brings them, but
    are not read), or a key of those groups that no option file has."""
    from mesa_train.train.config import refuses_new_key as train_refuses

    group = key.partition(".")[0]
    if group not in (*OWN_KEYS, *TRAIN_GROUPS):
        return True
    return group in TRAIN_GROUPS and train_refuses(key)


def _device(name: str):
    import torch

    if name in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if str(name).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"trainer.device={name} but no CUDA device is visible; use trainer.device=cpu")
    return torch.device(name)


def _amp(mode: str, device):
    import torch

    if mode == "auto":
        mode = "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "none"
    if mode not in _AMP:
        raise ValueError(f"trainer.amp={mode!r}; valid: auto, {', '.join(_AMP)}")
    return None if _AMP[mode] is None else getattr(torch, _AMP[mode])


def _quant_options(cfg: DictConfig) -> dict:
    from .train_hook import quant_options  # (the same options as train.py's mesa.plan)

    return quant_options(cfg.mesa)


def _check_settings(cfg: DictConfig) -> None:
    """A key of train.py's groups that no option file has (``+mesa.bitz=4``) was ignored without a
    word: refused, naming the close ones, as train.py refuses it."""
    from mesa_train.train.config import TOP_LEVEL, group_errors

    errors = [f"{key} is not a setting; top-level keys: {', '.join(OWN_KEYS)}, {', '.join(TRAIN_GROUPS)}"
              for key in cfg if key not in (*OWN_KEYS, *TOP_LEVEL)]
    errors += [e for group in TRAIN_GROUPS if group in cfg
               for e in group_errors(group, OmegaConf.to_container(cfg[group], resolve=False))]
    if errors:
        raise ValueError("invalid config: " + "; ".join(errors))


def run(cfg: DictConfig) -> str:
    import torch

    from mesa_train.train.model import build

    from . import Budget, make_batch, make_plan, plan_table, save_plan, summary_table
    from .measure import clock_description

    _check_settings(cfg)
    if cfg.threads:
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(int(cfg.seed))
    budget = Budget(fraction=cfg.budget, gb=cfg.budget_gb).check()  # (before minutes of profiling)
    device = _device(cfg.trainer.device)
    stock_cfg = OmegaConf.merge(cfg, {"mesa": {"enabled": False}})
    model = build(stock_cfg, num_classes=int(cfg.data.num_classes)).to(device)
    batch = make_batch(int(cfg.trainer.batch_size), int(cfg.model.img_size), int(cfg.data.num_classes), device,
                       _amp(str(cfg.trainer.amp), device), seed=int(cfg.seed))
    plan, profile, rows = make_plan(model, batch, budget, rounds=int(cfg.rounds), quant_options=_quant_options(cfg),
                                    measure=bool(cfg.measure))
    clock = clock_description(device)
    print(f"\nplan for {budget.describe()} = {plan.budget['read_as']}: {profile.architecture}, batch "
          f"{profile.batch_size} x {profile.img_size}px on {profile.device}")
    print(plan_table(plan, profile))
    print(f"\npredicted vs measured (activations kept for backward; {clock}, forward+backward; stock step "
          f"noise IQR/median {profile.step_noise:.1%})")
    print(summary_table(rows, profile))
    path = save_plan(plan, cfg.out)
    print(f"\nwrote {path}  (use: mesa_train.patch_model(model, plan={path!r}))")
    return path


@hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="plan")
def main(cfg: DictConfig) -> None:
    from .planfile import PlanError

    try:
        run(cfg)
    except (PlanError, ValueError) as err:
        print(f"mesa_train.plan: error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)


if __name__ == "__main__":
    exit_on_bad_overrides(CONFIG_DIR, "plan", prefix="mesa_train.plan: error: ")
    main()
