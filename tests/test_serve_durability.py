"""Durability across a SIGKILL of the whole ``ringtune serve`` (every rank), and a graceful SIGTERM.

Two CP=2 servers (float64, tiny Qwen3.5) one after the other on the same ``--checkpoint-root``, driven by the
real SDK over 127.0.0.1:

1. The first trains a run (with ``user_metadata``) for 2 steps, saves ``weights/ck2`` (with metadata) and
   ``sampler_weights/s2``, goes on for steps 3-4 (the uninterrupted reference) and exports its weights; a save
   is started and the whole process group is SIGKILLed (during that save when the poll catches its staging
   directory). A torn checkpoint directory (no seal) is left in the root as well.
2. The second lists the run, its metadata and every complete checkpoint (never the torn or cut one; their
   leftovers are removed), resumes ``ck2`` with its optimizer from a new session and repeats steps 3-4: the
   losses, gradient norms and final weights equal the reference bit for bit; ``s2`` samples.
3. SIGTERM to the second server's process group while a forward_backward runs and a save is queued: the
   forward_backward completes (or fails with ``category: server``), the save completes or fails cleanly, every
   rank exits, no process is left, no staging directory is left in the root.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import tinker
import torch
from gateway_fixtures import tiny_model_dir
from safetensors.torch import load_file
from tinker.types import RequestErrorCategory

from ringtune.gateway.serve_process import ServeProcess

API_KEY = "tml-durable"
ADAM = tinker.AdamParams(learning_rate=1e-2, eps=1e-8)
ARGS = ["--cp", "2", "--dtype", "float64", "--max-tokens-per-rank", "64", "--linear-cp-mode", "chunkwise"]


def sdk_datums(seed: int, lens=(5, 17, 3, 11, 2, 9, 13, 30)) -> list[tinker.Datum]:
    gen = torch.Generator().manual_seed(seed)
    return [
        tinker.Datum(
            model_input=tinker.ModelInput.from_ints(torch.randint(0, 90, (n,), generator=gen).tolist()),
            loss_fn_inputs={"target_tokens": torch.randint(0, 90, (n,), generator=gen).tolist(), "weights": [1.0] * n},
        )
        for n in lens
    ]


def step(tc: tinker.TrainingClient, seed: int) -> tuple[float, float]:
    loss = tc.forward_backward(sdk_datums(seed), "cross_entropy").result().metrics["loss:sum"]
    return loss, tc.optim_step(ADAM).result().metrics["grad_norm:mean"]


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def weights_of(root: Path, run_id: str, name: str) -> dict[str, torch.Tensor]:
    return load_file(root / run_id / "sampler_weights" / name / "model.safetensors")


class _Gone(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        self.send_response(404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b'{"error": "the server is gone", "category": "user"}')

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self._answer()

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def answered_as_gone(port: int):
    """A stand-in on the stopped server's address answering 404, so an SDK client's close (which finishes its
    session over HTTP, retrying while nothing listens) returns at once."""
    http = ThreadingHTTPServer(("127.0.0.1", port), _Gone)
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        http.shutdown()
        http.server_close()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("durable")
    return {"tmp": tmp, "model_dir": tiny_model_dir(tmp / "models" / "tiny"), "root": tmp / "ckpt"}


def server(setup, name: str, port: int = 0) -> ServeProcess:
    return ServeProcess(
        str(setup["model_dir"]),
        checkpoint_root=setup["root"],
        log_path=setup["tmp"] / f"{name}.log",
        port=port,
        api_key=API_KEY,
        extra_args=ARGS,
    )


def test_sigkill_of_the_whole_server_then_resume_bit_exact_and_sigterm(setup):
    root, model = setup["root"], str(setup["model_dir"])
    first = server(setup, "first")
    with first:
        # No `with`: closing a client finishes its session over HTTP, which waits for the server; this one dies.
        # The second server comes back on the same address, where that late close is answered.
        old_client = tinker.ServiceClient(base_url=first.url, api_key=API_KEY)
        tc = old_client.create_lora_training_client(model, rank=0, user_metadata={"owner": "durability"}).result()
        run_id = tc.model_id
        step(tc, 0), step(tc, 1)
        tc.save_state("ck2", user_metadata={"note": "two steps"}).result()
        tc.save_weights_for_sampler("s2").result()
        reference = [step(tc, 2), step(tc, 3)]
        tc.save_weights_for_sampler("ref4").result()
        tc.save_state("cut")
        weights_dir = root / run_id / "weights"
        deadline = time.monotonic() + 10
        while not any(p.name.endswith(".partial") for p in weights_dir.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.001)
        caught = any(p.name.endswith(".partial") for p in weights_dir.iterdir())
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        deadline = time.monotonic() + 30
        while group_alive(first.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(first.proc.pid)
    torn = weights_dir / "torn"
    torn.mkdir()
    (torn / "__0_0.distcp").write_bytes(b"half")  # a DCP shard without metadata or seal
    print(f"\nSIGKILL during the save 'cut': staging directory caught = {caught}")

    second = server(setup, "second", port=first.port)
    with second:
        try:
            old_client.close("interrupted").result(timeout=60)
        except Exception:
            pass  # its session is unknown to the new server: nothing to finish
        rest = tinker.RestClient(base_url=second.url, api_key=API_KEY)
        run = rest.get_training_run(run_id).result()
        assert run.user_metadata == {"owner": "durability"}
        assert run_id in {r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs}
        listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
        assert {"weights/ck2", "sampler_weights/s2", "sampler_weights/ref4"} <= set(listed), listed
        assert "weights/torn" not in listed
        assert listed["weights/ck2"].user_metadata == {"note": "two steps"}
        assert not [p for p in weights_dir.iterdir() if p.name.startswith(".") and p.name.endswith(".partial")]
        if "weights/cut" in listed:  # the save finished before the kill: then it is complete and loads
            assert not caught or (weights_dir / "cut").exists()
        sc = tinker.ServiceClient(base_url=second.url, api_key=API_KEY)
        try:
            tc = sc.create_training_client_from_state_with_optimizer(f"tinker://{run_id}/weights/ck2").result()
            resumed = [step(tc, 2), step(tc, 3)]
            assert resumed == reference  # float64, same ranks and layout, same state: bit for bit
            tc.save_weights_for_sampler("resumed4").result()
            want, got = weights_of(root, run_id, "ref4"), weights_of(root, tc.model_id, "resumed4")
            assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
            sampler = sc.create_sampling_client(model_path=f"tinker://{run_id}/sampler_weights/s2")
            params = tinker.SamplingParams(max_tokens=4, seed=3)
            assert len(sampler.sample(tinker.ModelInput.from_ints([1, 2, 3]), 1, params).result().sequences) == 1

            # SIGTERM to the whole process group with a forward_backward running and a save queued behind it.
            busy = tc.forward_backward(sdk_datums(11, lens=(30,) * 40), "cross_entropy")
            save = tc.save_state("at-sigterm")
            time.sleep(0.3)
            os.killpg(second.proc.pid, signal.SIGTERM)
            outcomes = []
            for future in (busy, save):
                try:
                    future.result(timeout=120)
                    outcomes.append("done")
                except tinker.RequestFailedError as exc:
                    assert exc.category == RequestErrorCategory.Server, exc
                    outcomes.append("failed")
            assert second.proc.wait(120) is not None
        finally:
            with answered_as_gone(second.port):
                with contextlib.suppress(Exception):
                    sc.close("interrupted").result(timeout=60)
        deadline = time.monotonic() + 30
        while group_alive(second.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not group_alive(second.proc.pid), "a rank process outlived the SIGTERM"
        leftovers = [p for p in root.rglob(".*") if ".ckpt-" in p.name and p.name.endswith((".partial", ".link"))]
        assert not leftovers, leftovers
        saved = root / tc.model_id / "weights" / "at-sigterm"
        assert (outcomes[1] == "done") == (saved / "ringtune.json").is_file()
        print(f"SIGTERM: forward_backward {outcomes[0]}, queued save {outcomes[1]}; every rank exited")


def test_restart_with_restore_live_runs_continues_the_same_client(setup):
    """``--autosave-every 1``, two steps, SIGKILL of the whole server, a restart with ``--restore-live-runs``: the
    same SDK objects go on. The run's first request gets a ``category: server`` error naming step 2 and the
    checkpoint; then step 3 equals step 3 of an uninterrupted twin run bit for bit (float64, same layout)."""
    root = setup["tmp"] / "ckpt-restore"
    model = str(setup["model_dir"])

    def restore_server(name: str, port: int = 0, extra: tuple[str, ...] = ()) -> ServeProcess:
        return ServeProcess(
            model,
            checkpoint_root=root,
            log_path=setup["tmp"] / f"{name}.log",
            port=port,
            api_key=API_KEY,
            extra_args=[*ARGS, "--autosave-every", "1", *extra],
        )

    first = restore_server("restore-first")
    with first:
        client = tinker.ServiceClient(base_url=first.url, api_key=API_KEY)  # lives across the restart
        tc = client.create_lora_training_client(model, rank=0).result()
        twin = client.create_lora_training_client(model, rank=0).result()
        step(tc, 0), step(tc, 1)
        step(twin, 0), step(twin, 1)
        want = step(twin, 2)
        os.killpg(first.proc.pid, signal.SIGKILL)
        first.proc.wait(30)
        deadline = time.monotonic() + 30
        while group_alive(first.proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    second = restore_server("restore-second", port=first.port, extra=("--restore-live-runs",))
    with second:
        try:
            with pytest.raises(tinker.RequestFailedError) as failed:
                tc.forward_backward(sdk_datums(2), "cross_entropy").result(timeout=120)
            assert failed.value.category == RequestErrorCategory.Server
            assert f"run {tc.model_id} was restored to step 2" in str(failed.value)  # (the SDK shortens the rest)
            assert step(tc, 2) == want  # the same client object, on the restored run
            runs = tinker.RestClient(base_url=second.url, api_key=API_KEY).list_training_runs(limit=100).result()
            assert {tc.model_id, twin.model_id} <= {r.training_run_id for r in runs.training_runs}
        finally:
            with contextlib.suppress(Exception):
                client.close().result(timeout=60)
