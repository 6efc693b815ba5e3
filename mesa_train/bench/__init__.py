"""Benchmark: ``python -m mesa_train.bench preset=NAME`` (Hydra app, configs in
``configs/bench/``). Measures peak memory and throughput of training steps, stock vs
Mesa, and writes Markdown/CSV tables with the paper's numbers beside ours plus a
memory-vs-throughput plot to ``results/<preset>/``.

The pieces are importable without Hydra: `presets` (row configs, validation), `measure`
(one training configuration), `search` (Table 9), `report` (tables), `plot`,
`paper_numbers`, and `runner.run_app(cfg)`.
"""
from pathlib import Path

# configs/bench, found relative to this file (editable install or a repo checkout)
CONFIG_DIR = str(Path(__file__).resolve().parents[2] / "configs" / "bench")

__all__ = ["CONFIG_DIR"]
