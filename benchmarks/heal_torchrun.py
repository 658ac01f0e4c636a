"""torchrun's elastic agent restarting ``ringtune serve``: SIGKILL of rank 1, time until healthz 200 again.

Starts ``torchrun --standalone --nproc-per-node 2 --max-restarts 1 -m ringtune.cli serve --cp 2 --autosave-every 1``
with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (docs/operations.md), trains one step through the SDK, SIGKILLs
rank 1 and prints how long healthz was down, that the run's autosave is listed after the restart, and what the
same SDK client sees next: the restarted server brought the run back from its autosave (a torchrun restart always
restores live runs, ``ringtune.gateway.restore``), so its first request fails with a ``server`` error naming the
step, and the next step continues the run (step 2). Last, SIGTERM to torchrun with a forward_backward in flight:
what the request got, the agent's exit, and whether any ringtune process is left.

    .venv/bin/python benchmarks/heal_torchrun.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import tinker

from ringtune.gateway.server import free_port

ADAM = tinker.AdamParams(learning_rate=1e-3)
DATUM = tinker.Datum(
    model_input=tinker.ModelInput.from_ints([1, 2, 3, 4]),
    loss_fn_inputs={"target_tokens": [2, 3, 4, 5], "weights": [1.0] * 4},
)


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/api/v1/healthz", timeout=3).status_code == 200
    except httpx.HTTPError:
        return False


def ranks_of(port: int) -> list[int]:
    """Pids of the ``ringtune.cli`` processes serving on ``port`` (alive)."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"ringtune.cli" in (entry / "cmdline").read_bytes():
                if str(port).encode() in (entry / "cmdline").read_bytes():
                    out.append(int(entry.name))
        except OSError:
            continue
    return out


def rank_pid(port: int, rank: int, agent: int) -> int:
    """The pid of the torchrun worker with ``RANK=rank`` serving on ``port``."""
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int(entry.name) == agent:
                continue
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"ringtune.cli" in cmdline and str(port).encode() in cmdline and f"RANK={rank}".encode() in environ:
            return int(entry.name)
    raise RuntimeError(f"no rank {rank} found")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            str(Path(sys.executable).with_name("torchrun")),
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "-m",
            "ringtune.cli",
        ]
        command += ["serve", "--model", args.model, "--cp", "2", "--context-length", "64", "--port", str(port)]
        command += ["--checkpoint-root", f"{tmp}/ckpt", "--autosave-every", "1"]
        env = os.environ | {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        with open(f"{tmp}/torchrun.log", "wb") as log:
            agent = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while not healthy(url):
                if agent.poll() is not None:
                    raise RuntimeError(f"torchrun exited with {agent.returncode}; see {tmp}/torchrun.log")
                time.sleep(0.2)
            sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
            tc = sc.create_lora_training_client(args.model, rank=0).result()
            tc.forward_backward([DATUM], "cross_entropy").result()
            tc.optim_step(ADAM).result()
            killed = time.monotonic()
            os.kill(rank_pid(port, 1, agent.pid), signal.SIGKILL)
            down = None
            while down is None or not healthy(url):
                if down is None and not healthy(url):
                    down = time.monotonic()
                time.sleep(0.1)
            back = time.monotonic()
            rest = tinker.RestClient(base_url=url, api_key="tml-local")
            listed = [c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints]
            try:
                tc.forward_backward([DATUM], "cross_entropy").result()
                notice = "none (wrong: the run lost a step silently)"
            except tinker.RequestFailedError as exc:
                notice = f"{exc.category}: {str(exc)[:160]}"
            tc.forward_backward([DATUM], "cross_entropy").result()
            step = tc.optim_step(ADAM).result().metrics["step:max"]
            print(f"torchrun --max-restarts 1, ringtune serve --cp 2 on {url}; rank 1 SIGKILLed:")
            print(
                f"  healthz down {down - killed:.1f} s after the SIGKILL, "
                f"200 again on the same address {back - killed:.1f} s after"
            )
            print(f"  checkpoints listed after the restart: {listed}")
            print(f"  the same client's next request: {notice}")
            print(f"  then forward_backward + optim_step on the restored run: step {step:.0f} (goal 2)")

            # SIGTERM to the agent (how torchrun is stopped) with a forward_backward in flight.
            busy = tc.forward_backward([DATUM] * 64, "cross_entropy")
            time.sleep(0.3)
            stopped = time.monotonic()
            os.kill(agent.pid, signal.SIGTERM)
            try:
                busy.result(timeout=120)
                outcome = "completed"
            except tinker.RequestFailedError as exc:
                outcome = f"failed, category {exc.category}"
            except Exception as exc:  # the server went away before answering
                outcome = f"no answer ({type(exc).__name__})"
            code = agent.wait(120)
            gone = time.monotonic() - stopped
            left = [p for p in ranks_of(port) if p != agent.pid]
            print(f"  SIGTERM to torchrun with a forward_backward in flight: the request {outcome}; torchrun exited")
            print(f"  with {code} {gone:.1f} s after the signal; ringtune processes left: {len(left)}")
        finally:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGTERM)
                try:
                    agent.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(agent.pid, signal.SIGKILL)
                    agent.wait()
        os._exit(0)  # the SDK clients' sessions would be finished over HTTP against a stopped server


if __name__ == "__main__":
    main()
