"""The processes of a job: how they start, watch each other and end.

- `exit_codes`: the exit codes a process and its launcher agree on
  (`PREEMPTION_EXIT_CODE`: saved on a preemption signal, restart me).
- `peer_board`: heartbeats on the job's key-value store; which peer a
  process waited for when a collective fails or hangs.
- `process_notes`: what a process tells its launcher when it ends.
- `addresses`: which of a job's addresses belong to this machine (where
  its servers bind, how a process is named).
- `cluster_agreement`: every process of a job was told the same cluster
  and its own process index (checked on the job's store as it forms).

May import: `common`. Imports no framework at module level.
"""
