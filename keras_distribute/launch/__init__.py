"""Starting a job's processes on this host.

- `launcher`: `kd.launch` and `kd.notebook_launcher` run a function in N
  local processes that form a group, and return what each returned.
- `starting`: how those processes start (forked from a server that imported
  Keras once, with the launcher's environment and output of the moment).
- `script`: `python -m keras_distribute.launch --nproc N script.py args`
  runs a script in N processes, forwards signals, restarts a preempted job.
- `processes`: the launched processes' environment, signals, ports,
  limits, and how a failed or frozen one is found and named.

May import: `common`, `job`, `cluster_resolver` (nothing that imports a
framework at module level).
"""

from keras_distribute.launch.launcher import LaunchError  # noqa: F401
from keras_distribute.launch.launcher import launch  # noqa: F401
from keras_distribute.launch.launcher import notebook_launcher  # noqa: F401
