"""Knowing before the launch (#46): what a job will hold where.

- `layout_planner`: `kd.layouts.plan_layout`, a `LayoutMap` planned from a
  model's variable shapes (built without values), with a report of each
  variable's layout, bytes per device and why.
- `layout_check`: `kd.layouts.check_layout`, a layout map checked against a
  model before the launch (keys that match nothing, indivisible shards,
  replicated giants, the global batch, memory per device), each finding
  with its fix.
- `memory_estimate`: `kd.layouts.estimate_memory`, the bytes a device holds
  at the peak of a train step (the backend's `step_memory`).
- `dry_run`: `kd.layouts.dry_run`, the whole job checked, one verdict;
  `command_line` (`python -m keras_distribute.planning`) runs it on a
  training script.

May import: `common`, `backend` (its contract: `build_without_values`,
`step_memory`) and the packages below the strategies. Imports no framework
at module level.
"""
