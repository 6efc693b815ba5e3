"""Memory-budget planner: the fastest compression plan that fits a memory budget.

```python
from mesa_train.plan import Budget, make_plan, make_batch, save_plan
plan, profile, rows = make_plan(model, make_batch(32, 64, 10, "cpu"), Budget(fraction=0.6))
save_plan(plan, "plan.yaml")
mesa_train.patch_model(model, plan="plan.yaml")
```

``python -m mesa_train.plan budget=0.6`` does the same from the training configs.
"""
from .allocate import Budget, allocate, budget_bytes, predict
from .apply import apply_plan, check_plan, describe_plan, plan_of
from .measure import make_batch
from .planfile import Plan, PlanError, load_plan, save_plan
from .planner import make_plan, measure_plans, plan_table, summary_table
from .profile import Profile, profile_model
from .units import OTHER, find_units

__all__ = ["Budget", "allocate", "budget_bytes", "predict", "apply_plan", "check_plan", "describe_plan", "plan_of",
           "make_batch", "Plan", "PlanError", "load_plan", "save_plan", "make_plan", "measure_plans", "plan_table",
           "summary_table", "Profile", "profile_model", "OTHER", "find_units"]
