"""Knowing before the launch (#46): what a job will hold where.

- `layout_planner`: `kd.layouts.plan_layout`, a `LayoutMap` planned from a
  model's variable shapes (built without values), with a report of each
  variable's layout, bytes per device and why.
- `layout_check`: `kd.layouts.check_layout`, a layout map checked against a
  model before the launch (keys that match nothing, indivisible shards,
  replicated giants, the global batch, memory per device), each finding
  with its fix.

May import: `common`, `backend` (its contract: `build_without_values`) and
the packages below the strategies. Imports no framework at module level.
"""
