"""The processes of a job: how they start, watch each other and end.

- `processes`: a launched process' environment, signals, ports, limits, and
  how a failed or frozen one is found and named.
- `peer_board`: heartbeats on the job's key-value store; which peer a
  process waited for when a collective fails or hangs.
- `process_notes`: what a process tells its launcher when it ends.

May import: `common`. Imports no framework at module level.
"""
