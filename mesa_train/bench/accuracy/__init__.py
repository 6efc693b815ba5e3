"""Accuracy tables (paper Tables 1-8 on real data): ``python -m mesa_train.bench.accuracy``.

Trains a small DeiT on scikit-learn's digits through the real training pipeline, every row
(stock, Mesa and each ablation) with the same seeds, and writes the mean and spread of the
final top-1 and loss per row beside the paper's numbers, the training curves, and the
paper's directions tested seed-by-seed. Pieces: `paper` (the paper's numbers), `spec`
(preset validation), `train` (one run), `stats` (spread, paired tests), `report`, `plot`,
`app.run_app(cfg)`. Configs: ``configs/bench/accuracy/``.
"""
from pathlib import Path

CONFIG_DIR = str(Path(__file__).resolve().parents[3] / "configs" / "bench" / "accuracy")

__all__ = ["CONFIG_DIR"]
