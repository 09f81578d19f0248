"""`python -m keras_distribute.launch script.py`: a training script in N
local processes (the script launcher; `kd.launch` runs a function).

Every process gets the torchrun variables and `KERAS_DISTRIBUTION_*`
(`launch.process_env`); SIGTERM/SIGINT are passed on to them; the first
failure, a timeout or a signal ends them all; `--max-restarts` starts the
job again as torchrun's does.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional
from typing import Sequence

from keras_distribute.job.exit_codes import PREEMPTION_EXIT_CODE
from keras_distribute.launch.processes import DEFAULT_SIGNAL_GRACE_S
from keras_distribute.launch.processes import DEFAULT_TIMEOUT_S
from keras_distribute.launch.processes import GRACE_S
from keras_distribute.launch.processes import SignalForwarder
from keras_distribute.launch.processes import attach_notes
from keras_distribute.launch.processes import blamed_peer
from keras_distribute.launch.processes import check_num_processes
from keras_distribute.launch.processes import check_timeout
from keras_distribute.launch.processes import first_frozen
from keras_distribute.launch.processes import free_port
from keras_distribute.launch.processes import free_ports
from keras_distribute.launch.processes import frozen_message
from keras_distribute.launch.processes import last_note
from keras_distribute.launch.processes import process_env
from keras_distribute.launch.processes import signal_exit_code
from keras_distribute.launch.processes import signal_name
from keras_distribute.launch.processes import stop_process


def run_script(script: str, script_args: Sequence[str], num_processes: int,
               timeout: float = DEFAULT_TIMEOUT_S,
               signal_grace: float = DEFAULT_SIGNAL_GRACE_S,
               max_restarts: int = 0) -> int:
    """Runs `python script args...` in `num_processes` processes.

    SIGTERM or SIGINT sent to the launcher is passed on to every process;
    they get `signal_grace` seconds to exit before they are killed, and the
    launcher exits with 128 + the signal (143 for SIGTERM). No process is
    left behind.

    With `max_restarts`, a job whose process failed (or exited with
    `PREEMPTION_EXIT_CODE`) is started again, every process on fresh ports,
    up to that many times (torchrun's `--max-restarts`): a script with
    `kd.callbacks.BackupAndRestore` or `PreemptionCheckpoint` resumes from
    its last backup. A timeout or a signal sent to the launcher is never
    restarted.

    Returns:
        0 if every process succeeded, else the first failure's exit code
        (124 on the timeout, 128 + the signal when signalled).
        `PREEMPTION_EXIT_CODE` (42) when the processes saved on a
        preemption signal (`kd.callbacks.PreemptionCheckpoint`): the others
        get `signal_grace` seconds to finish that save, never cut short.
    """
    if isinstance(max_restarts, bool) or not isinstance(
            max_restarts, int) or max_restarts < 0:
        raise ValueError(
            "Expected `max_restarts` to be a non-negative integer. Received: "
            f"max_restarts={max_restarts!r}.")
    deadline = time.monotonic() + timeout
    for attempt in range(max_restarts + 1):
        code, final = _run_script_once(script, script_args, num_processes,
                                       deadline, timeout, signal_grace)
        if code == 0 or final or attempt == max_restarts:
            return code
        print(f"keras_distribute.launch: restarting the job ({attempt + 1} of "
              f"{max_restarts} restarts) after exit code {code}.",
              file=sys.stderr)
    return code


def _run_script_once(script, script_args, num_processes, deadline, timeout,
                     signal_grace) -> tuple:
    """One start of every process: `(exit code, final)`, final when a
    timeout or a signal ended it (no restart then)."""
    port, job_ports = free_port(), free_ports(num_processes)
    notes_dir = tempfile.mkdtemp(prefix="keras_distribute-notes-")
    processes = []
    for rank in range(num_processes):
        env = dict(os.environ, **process_env(rank, num_processes, port,
                                             job_ports, notes_dir))
        processes.append(subprocess.Popen(
            [sys.executable, script, *script_args], env=env))
        attach_notes(processes[-1], notes_dir)

    def send(signum):
        for process in processes:
            if process.poll() is None:
                try:
                    process.send_signal(signum)
                except OSError:
                    pass

    with SignalForwarder(send) as forwarder:
        try:
            code = _watch(processes, num_processes, deadline, timeout,
                          forwarder, signal_grace)
        finally:
            shutil.rmtree(notes_dir, ignore_errors=True)
        return code, bool(forwarder.received) or code == 124


def _watch(processes, num_processes, deadline, timeout, forwarder,
           signal_grace) -> int:
    """`run_script`'s loop: the first failure, a timeout or a signal ends
    every process; returns the launcher's exit code."""
    try:
        while True:
            if forwarder.received:
                signum = forwarder.received[0]
                print(f"keras_distribute.launch: received "
                      f"{signal.Signals(signum).name}, passed it on to every "
                      f"process; waiting up to {signal_grace:.0f} s for them "
                      "to exit.", file=sys.stderr)
                codes = _wait_all(processes, signal_grace)
                if codes == [PREEMPTION_EXIT_CODE] * len(codes):
                    return PREEMPTION_EXIT_CODE  # all saved: restart me
                return signal_exit_code(signum)
            codes = [p.poll() for p in processes]
            failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if failed and failed[0][1] == PREEMPTION_EXIT_CODE:
                # Saved on a preemption signal: the others are leaving from
                # the same step; ending them now could cut their save.
                codes = _wait_all(processes, signal_grace)
                print(f"keras_distribute.launch: the processes saved on a "
                      f"preemption signal and exited with {codes}; exiting "
                      f"with {PREEMPTION_EXIT_CODE} (restart me).",
                      file=sys.stderr)
                return PREEMPTION_EXIT_CODE
            if failed:
                rank, code = failed[0]
                frozen = first_frozen(processes)
                if frozen is not None:
                    print(f"keras_distribute.launch: "
                          f"{frozen_message(frozen, num_processes)}; "
                          f"process {rank} then exited with code {code}; "
                          "ending every process.", file=sys.stderr)
                elif blamed_peer(processes, rank) is not None:
                    lost = blamed_peer(processes, rank)
                    print(f"keras_distribute.launch: process {lost} of "
                          f"{num_processes} was lost (named by process "
                          f"{rank}, which then exited with code {code}); "
                          "ending every process.", file=sys.stderr)
                else:
                    print(f"keras_distribute.launch: process {rank} of "
                          f"{num_processes} exited with code {code}"
                          f"{signal_name(code)}"
                          f"{last_note(processes, rank, code)}; ending the "
                          "others.", file=sys.stderr)
                return code if code > 0 else 1
            if all(c == 0 for c in codes):
                return 0
            if time.monotonic() > deadline:
                print(f"keras_distribute.launch: timeout of {timeout:.0f} s "
                      "reached; ending every process.", file=sys.stderr)
                return 124
            time.sleep(0.1)
    finally:
        for process in processes:
            if process.poll() is None:
                stop_process(process)
        for process in processes:
            try:
                process.wait(GRACE_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(GRACE_S)


def _wait_all(processes, grace_s: float) -> list:
    """Waits up to `grace_s` for every process to exit; their exit codes
    (`None` for one still running)."""
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(p.poll() is None for p in processes):
        time.sleep(0.1)
    return [p.poll() for p in processes]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_distribute.launch",
        description="Run a training script in N local processes (torchrun-"
        "style environment).")
    parser.add_argument("--nproc", "--nproc-per-node", type=int, default=2,
                        dest="nproc", help="number of processes (default 2)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds before every process is ended")
    parser.add_argument("--signal-grace", type=float,
                        default=DEFAULT_SIGNAL_GRACE_S,
                        help="seconds the processes get to exit after a "
                        "SIGTERM/SIGINT passed on to them (default 25)")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="start the job again up to this many times when "
                        "a process fails (default 0)")
    parser.add_argument("script", help="the Python script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    try:
        check_num_processes(args.nproc, name="--nproc")
        check_timeout(args.timeout, name="--timeout")
    except ValueError as error:
        parser.error(str(error))
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0; received "
                     f"{args.max_restarts}")
    return run_script(args.script, args.script_args, args.nproc, args.timeout,
                      args.signal_grace, args.max_restarts)
