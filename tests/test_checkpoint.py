"""Tests of ringtune.engine.checkpoint: exact round trips, resume after a kill, kills mid-save, world sizes, errors.

Processes that must be fresh (resume, SIGKILL) are forked from a ``forkserver`` that has only imported torch
and ringtune (it never ran a tensor op, so each child starts clean, without paying the imports again) and run
module-level functions; the 2-rank case forks its gloo ranks from that server too. Every training run is pinned to one
CPU thread so float64 results are bit-identical across processes. Comparisons are exact (``torch.equal`` /
``==``): a checkpoint must restore bits, not values.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from support.tiny_models import packed_tokens

from ringtune.engine.checkpoint import export_hf_weights, list_checkpoints, load_checkpoint, save_checkpoint
from ringtune.errors import UserInputError
from ringtune.layout.zigzag import zigzag_slice
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.config import DecoderConfig
from ringtune.models.decoder import CausalLM
from ringtune.models.shard import shard_of
from ringtune.parallel.launch import free_port, init_process_group

LENS = (5, 9, 3, 7)
VOCAB = 48
CHILD_TIMEOUT = 60.0


def tiny_model(seed: int, *, hidden: int = 16) -> CausalLM:
    """A float64 Qwen3-style CausalLM (tied embeddings, qk norm), 2 layers; random weights from ``seed``."""
    config = DecoderConfig.from_hf(
        {
            "model_type": "qwen3",
            "vocab_size": VOCAB,
            "hidden_size": hidden,
            "intermediate_size": 24,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 8,
            "tie_word_embeddings": True,
        }
    )
    torch.manual_seed(seed)
    model = CausalLM(config).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def adamw(model: CausalLM) -> torch.optim.AdamW:
    return torch.optim.AdamW(model.parameters(), lr=0.0)


def next_token_labels(ids: torch.Tensor, lens: tuple[int, ...]) -> torch.Tensor:
    """int64 [T]: the next token inside each sequence, -100 at each sequence's last token."""
    labels = torch.full_like(ids, -100)
    start = 0
    for n in lens:
        labels[start : start + n - 1] = ids[start + 1 : start + n]
        start += n
    return labels


def train(model: CausalLM, optimizer: torch.optim.Optimizer, first: int, last: int) -> list[float]:
    """Run steps ``first``..``last - 1`` (0-based): loss = -mean label logprob of that step's fixed token row.

    Hyper-parameters are set per step, as the Tinker ``optim_step`` does (lr follows a warm-up schedule,
    beta2 = 0.95, eps = 1e-12), with gradient clipping. One CPU thread. Returns the losses.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    shard = shard_of(LENS)
    losses = []
    try:
        for step in range(first, last):
            ids = packed_tokens(LENS, VOCAB, seed=100 + step)
            labels = zigzag_slice(next_token_labels(ids, LENS), shard.plan, pad_value=-100)
            ids = zigzag_slice(ids, shard.plan)
            for group in optimizer.param_groups:
                group.update(lr=1e-2 * (step + 1) / 4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.01)
            optimizer.zero_grad(set_to_none=True)
            logprobs = model.label_logprobs(ids, labels, shard)
            loss = -logprobs.sum() / (labels != -100).sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(threads)
    return losses


def snapshot(model: CausalLM, optimizer: torch.optim.Optimizer | None) -> dict:
    """Deep copies of the model tensors and the optimizer state (keyed by parameter name)."""
    names = {id(p): n for n, p in model.named_parameters()}
    optim = {}
    if optimizer is not None:
        optim = {names[id(p)]: {k: v.clone() for k, v in s.items()} for p, s in optimizer.state.items()}
    return {"model": {k: v.clone() for k, v in model.state_dict().items()}, "optim": optim}


def assert_same(a: dict, b: dict) -> None:
    assert a["model"].keys() == b["model"].keys()
    for k in a["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    assert a["optim"].keys() == b["optim"].keys()
    for name in a["optim"]:
        assert a["optim"][name].keys() == b["optim"][name].keys(), name
        for k in a["optim"][name]:
            x, y = a["optim"][name][k], b["optim"][name][k]
            assert x.dtype == y.dtype and torch.equal(x, y), (name, k)


def as_bytes(state: dict) -> bytes:
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> dict:
    return torch.load(io.BytesIO(data))


def fresh_context():
    """The ``forkserver`` multiprocessing context, its server preloading torch, ringtune and this module.

    The preload list only takes effect if nothing in this session started the forkserver before (children
    then just import more themselves).
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "ringtune.engine.checkpoint", __name__])
    return ctx


def run_child(target, *args, kill_when: Path | None = None) -> int:
    """Run ``target(*args)`` in a fresh process; SIGKILL it as soon as ``kill_when`` exists; its exit code."""
    proc = fresh_context().Process(target=target, args=args)
    proc.start()
    deadline = time.monotonic() + CHILD_TIMEOUT
    if kill_when is not None:
        while not kill_when.exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
    proc.join(max(0.0, deadline - time.monotonic()))
    if proc.is_alive():
        proc.kill()
        proc.join()
        pytest.fail(f"{target.__name__} did not finish within {CHILD_TIMEOUT}s")
    return proc.exitcode


def rank_entry(rank: int, world_size: int, init_method: str, fn, args: tuple, results) -> None:
    torch.set_num_threads(1)
    try:
        init_process_group(rank=rank, world_size=world_size, init_method=init_method)
        results.put((rank, True, fn(rank, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args) -> list:
    """``ringtune.parallel.spawn`` semantics (``fn(rank, *args)`` on fresh gloo ranks, results in rank order), but
    forked from the preloaded forkserver: each rank starts in well under a second instead of re-importing torch.
    """
    ctx = fresh_context()
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{free_port()}"
    procs = [
        ctx.Process(target=rank_entry, args=(r, world_size, init_method, fn, args, results)) for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            rank, ok, value = results.get(timeout=CHILD_TIMEOUT)
            if not ok:
                pytest.fail(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10 if len(got) == world_size else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world_size)]


# --------------------------------------------------------------------------------------------------- 1. round trip


def test_round_trip_bit_exact(tmp_path):
    model = tiny_model(0)
    optimizer = adamw(model)
    train(model, optimizer, 0, 3)
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, step=3, extra={"run": "a", "tokens": [1, 2]})
    saved = snapshot(model, optimizer)
    assert list_checkpoints(tmp_path) == ["ck"]

    model2 = tiny_model(1)
    optimizer2 = adamw(model2)
    step, extra = load_checkpoint(tmp_path / "ck", model=model2, optimizer=optimizer2)
    assert (step, extra) == (3, {"run": "a", "tokens": [1, 2]})
    assert_same(snapshot(model2, optimizer2), saved)
    assert optimizer2.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert optimizer2.param_groups[0]["betas"] == (0.9, 0.95)
    # The restored pair trains on exactly like the original.
    assert train(model2, optimizer2, 3, 4) == train(model, optimizer, 3, 4)

    # Weights only: fresh moments.
    model3 = tiny_model(2)
    optimizer3 = adamw(model3)
    assert load_checkpoint(tmp_path / "ck", model=model3, optimizer=None) == (3, {"run": "a", "tokens": [1, 2]})
    assert not optimizer3.state
    assert_same(snapshot(model3, None), {"model": saved["model"], "optim": {}})
    # Overwrite the same name: the new one is published, no hidden leftovers beside it.
    save_checkpoint(tmp_path / "ck", model=model2, optimizer=optimizer2, step=4)
    model4 = tiny_model(3)
    optimizer4 = adamw(model4)
    assert load_checkpoint(tmp_path / "ck", model=model4, optimizer=optimizer4) == (4, {})
    assert_same(snapshot(model4, optimizer4), snapshot(model2, optimizer2))
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".ck.")]) == 1


def test_fresh_optimizer_stays_fresh(tmp_path):
    """An optimizer that never stepped is saved as fresh; loading gives one that has not stepped either."""
    model = tiny_model(0)
    optimizer = adamw(model)
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, step=0)
    assert not optimizer.state  # saving did not initialise moments

    used = tiny_model(1)
    used_optimizer = adamw(used)
    train(used, used_optimizer, 0, 1)
    load_checkpoint(tmp_path / "ck", model=used, optimizer=used_optimizer)
    assert not used_optimizer.state
    assert train(used, used_optimizer, 0, 2) == train(model, optimizer, 0, 2)


def test_optimizer_built_from_named_parameters(tmp_path):
    """An optimizer given ``named_parameters()`` carries ``param_names`` in its groups: it is no hyper-parameter."""
    model = tiny_model(0)
    optimizer = torch.optim.AdamW(model.named_parameters(), lr=0.0)
    train(model, optimizer, 0, 2)
    save_checkpoint(tmp_path / "named", model=model, optimizer=optimizer, step=2)
    save_checkpoint(tmp_path / "plain", model=model, optimizer=adamw_from(model, optimizer), step=2)
    for name in ("named", "plain"):
        for named in (True, False):
            target = tiny_model(1)
            target_optimizer = torch.optim.AdamW(target.named_parameters() if named else target.parameters(), lr=0.0)
            assert load_checkpoint(tmp_path / name, model=target, optimizer=target_optimizer) == (2, {})
            assert_same(snapshot(target, target_optimizer), snapshot(model, optimizer))
            assert ("param_names" in target_optimizer.param_groups[0]) == named


def adamw_from(model: CausalLM, named: torch.optim.AdamW) -> torch.optim.AdamW:
    """An AdamW over ``model.parameters()`` (no param_names) holding a copy of ``named``'s state and settings."""
    plain = torch.optim.AdamW(model.parameters(), lr=0.0)
    state = named.state_dict()
    for group in state["param_groups"]:
        group.pop("param_names")
    plain.load_state_dict(state)
    return plain


def test_export_hf_weights(tmp_path):
    model = tiny_model(0)
    export_hf_weights(model, tmp_path / "hf")
    again = load_hf(tmp_path / "hf")
    for k, v in model.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


# --------------------------------------------------------------------------------------------------- 2. resume


def resume_first_half(path: str) -> None:
    """Fresh process: steps 0-1, save, then die by SIGKILL the moment the save returns."""
    model = tiny_model(0)
    optimizer = adamw(model)
    train(model, optimizer, 0, 2)
    save_checkpoint(path, model=model, optimizer=optimizer, step=2)
    os.kill(os.getpid(), signal.SIGKILL)


def resume_second_half(path: str, out: str) -> None:
    """Fresh process: a differently initialised model loads the checkpoint and runs steps 2-3."""
    model = tiny_model(7)
    optimizer = adamw(model)
    step, _ = load_checkpoint(path, model=model, optimizer=optimizer)
    Path(out).write_text(json.dumps(train(model, optimizer, step, 4)))


def test_save_kill_load_continue_is_bit_identical(tmp_path):
    model = tiny_model(0)
    uninterrupted = train(model, adamw(model), 0, 4)

    assert run_child(resume_first_half, str(tmp_path / "ck")) == -signal.SIGKILL
    assert run_child(resume_second_half, str(tmp_path / "ck"), str(tmp_path / "losses.json")) == 0
    resumed = json.loads((tmp_path / "losses.json").read_text())
    assert resumed == uninterrupted[2:]


# --------------------------------------------------------------------------------------------------- 3. kill mid-save


def save_twice_and_hang(root: str, point: str) -> None:
    """Fresh process: save A, train a step, save B to the same name but hang at ``point`` (then get killed).

    ``point``: "write" (DCP tensor data written, no .metadata), "publish" (B complete under its hidden name,
    symlink not yet swapped), "cleanup" (symlink swapped to B, old version not yet removed). The expected
    states of A and B are written with torch.save before each save; ``<root>/hanging`` signals the hang.
    """
    import ringtune.engine.checkpoint as ckpt
    import ringtune.engine.checkpoint_layout as ckpt_layout

    root_path = Path(root)
    model = tiny_model(0)
    optimizer = adamw(model)
    train(model, optimizer, 0, 1)
    torch.save(snapshot(model, optimizer), root_path / "a.pt")
    save_checkpoint(root_path / "ck", model=model, optimizer=optimizer, step=1, extra={"v": "A"})
    train(model, optimizer, 1, 2)
    torch.save(snapshot(model, optimizer), root_path / "b.pt")

    def hang() -> None:
        (root_path / "hanging").touch()
        time.sleep(CHILD_TIMEOUT)

    if point == "write":
        original = ckpt.FileSystemWriter.write_data

        def slow_write(self, plan, planner):
            original(self, plan, planner).wait()
            hang()

        ckpt.FileSystemWriter.write_data = slow_write
    elif point == "publish":
        ckpt_layout.os.symlink = lambda *args, **kwargs: hang()
    elif point == "cleanup":
        ckpt_layout.remove_versions = lambda *args, **kwargs: hang()
    save_checkpoint(root_path / "ck", model=model, optimizer=optimizer, step=2, extra={"v": "B"})


@pytest.mark.parametrize(("point", "survivor"), [("write", "a"), ("publish", "a"), ("cleanup", "b")])
def test_kill_during_save_leaves_a_complete_checkpoint(tmp_path, point, survivor):
    code = run_child(save_twice_and_hang, str(tmp_path), point, kill_when=tmp_path / "hanging")
    assert code == -signal.SIGKILL
    hidden = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ck."))
    assert len(hidden) == 2  # the published version and the interrupted save's leftover

    model = tiny_model(5)
    optimizer = adamw(model)
    step, extra = load_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer)
    assert (step, extra) == ((1, {"v": "A"}) if survivor == "a" else (2, {"v": "B"}))
    assert_same(snapshot(model, optimizer), torch.load(tmp_path / f"{survivor}.pt"))
    assert list_checkpoints(tmp_path) == ["ck"]

    # The next save of the same name works and sweeps the leftovers away.
    train(model, optimizer, step, step + 1)
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, step=step + 1)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".ck.")]) == 1
    fresh = tiny_model(6)
    fresh_optimizer = adamw(fresh)
    assert load_checkpoint(tmp_path / "ck", model=fresh, optimizer=fresh_optimizer) == (step + 1, {})
    assert_same(snapshot(fresh, fresh_optimizer), snapshot(model, optimizer))


def test_failed_write_removes_the_partial_save_and_keeps_the_old(tmp_path, monkeypatch):
    import ringtune.engine.checkpoint as ckpt

    model = tiny_model(0)
    optimizer = adamw(model)
    train(model, optimizer, 0, 1)
    save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, step=1)
    saved = snapshot(model, optimizer)
    train(model, optimizer, 1, 2)

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt.FileSystemWriter, "write_data", disk_full)
    with pytest.raises(
        RuntimeError, match=r"ck: writing failed \(CheckpointException \(rank 0: OSError: \[Errno 28\] No space left"
    ):
        save_checkpoint(tmp_path / "ck", model=model, optimizer=optimizer, step=2)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith(".ck.")]) == 1  # no .partial left behind
    monkeypatch.undo()
    fresh = tiny_model(5)
    fresh_optimizer = adamw(fresh)
    assert load_checkpoint(tmp_path / "ck", model=fresh, optimizer=fresh_optimizer) == (1, {})
    assert_same(snapshot(fresh, fresh_optimizer), saved)


# --------------------------------------------------------------------------------------------------- 4. world sizes


def two_rank_case(rank: int, root: str) -> dict:
    """On 2 gloo ranks: load the world-1 checkpoint; save (twice, replacing) identical replicas at world 2."""
    root_path = Path(root)
    loaded = tiny_model(9)
    loaded_optimizer = adamw(loaded)
    step, extra = load_checkpoint(root_path / "w1", model=loaded, optimizer=loaded_optimizer)

    model = tiny_model(0)  # same seed and data on both ranks: replicated parameters
    optimizer = adamw(model)
    train(model, optimizer, 0, 1)
    save_checkpoint(root_path / "w2", model=model, optimizer=optimizer, step=1)
    train(model, optimizer, 1, 2)
    save_checkpoint(root_path / "w2", model=model, optimizer=optimizer, step=2, extra={"world": 2})
    return {
        "loaded": as_bytes(snapshot(loaded, loaded_optimizer)),
        "step": step,
        "extra": extra,
        "saved": as_bytes(snapshot(model, optimizer)),
    }


def test_save_and_load_across_world_sizes(tmp_path):
    model = tiny_model(0)
    optimizer = adamw(model)
    train(model, optimizer, 0, 2)
    save_checkpoint(tmp_path / "w1", model=model, optimizer=optimizer, step=2, extra={"world": 1})
    single_bytes = sum(f.stat().st_size for f in (tmp_path / "w1").glob("*.distcp"))

    results = run_ranks(two_rank_case, 2, str(tmp_path))
    for r in results:  # world 1 -> world 2
        assert (r["step"], r["extra"]) == (2, {"world": 1})
        assert_same(from_bytes(r["loaded"]), snapshot(model, optimizer))

    # world 2 -> world 1: both ranks held the same replicas; one copy was written.
    saved = from_bytes(results[0]["saved"])
    assert_same(from_bytes(results[1]["saved"]), saved)
    model1 = tiny_model(4)
    optimizer1 = adamw(model1)
    assert load_checkpoint(tmp_path / "w2", model=model1, optimizer=optimizer1) == (2, {"world": 2})
    assert_same(snapshot(model1, optimizer1), saved)
    files = sorted((tmp_path / "w2").glob("*.distcp"))
    assert len(files) == 2
    assert sum(f.stat().st_size for f in files) < 1.5 * single_bytes  # deduplicated, not two copies
    assert list_checkpoints(tmp_path) == ["w1", "w2"]


# --------------------------------------------------------------------------------------------------- 5. errors


def test_errors_leave_the_target_unchanged(tmp_path):
    source = tiny_model(0)
    source_optimizer = adamw(source)
    train(source, source_optimizer, 0, 1)
    save_checkpoint(tmp_path / "ck", model=source, optimizer=source_optimizer, step=1)
    save_checkpoint(tmp_path / "weights", model=source, optimizer=None, step=1)

    def untouched(load_path: Path, model: CausalLM, optimizer, match: str) -> None:
        before = snapshot(model, optimizer)
        with pytest.raises(UserInputError, match=match) as info:
            load_checkpoint(load_path, model=model, optimizer=optimizer)
        assert str(load_path) in str(info.value)
        assert_same(snapshot(model, optimizer), before)

    target = tiny_model(1)
    fresh = adamw(target)
    untouched(tmp_path / "nowhere", target, fresh, "does not exist")
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "__0_0.distcp").write_bytes(b"\0" * 10)
    untouched(tmp_path / "half", target, fresh, "incomplete")
    wide = tiny_model(1, hidden=24)
    untouched(tmp_path / "ck", wide, adamw(wide), "different model")
    untouched(tmp_path / "ck", tiny_model(1).float(), None, "different model")  # same shapes, other dtype
    untouched(tmp_path / "weights", target, fresh, "no optimizer state")
    assert not fresh.state

    # Another optimizer type: refused by the class recorded in the checkpoint, before anything changes.
    sgd = torch.optim.SGD(target.parameters(), lr=0.1, momentum=0.9)
    grad = torch.randn_like(target.model.norm.weight)
    target.model.norm.weight.grad = grad
    untouched(tmp_path / "ck", target, sgd, "different optimizer")
    assert not sgd.state
    assert target.model.norm.weight.grad is grad
    assert all(p.grad is None for n, p in target.named_parameters() if n != "model.norm.weight")
    # An optimizer that has stepped keeps its moments too.
    stepped = adamw(target)
    train(target, stepped, 0, 1)
    untouched(tmp_path / "weights", target, stepped, "no optimizer state")

    with pytest.raises(UserInputError, match="JSON"):
        save_checkpoint(tmp_path / "bad", model=source, optimizer=None, step=0, extra={"t": torch.ones(1)})
    with pytest.raises(UserInputError, match="step"):
        save_checkpoint(tmp_path / "bad", model=source, optimizer=None, step=-1)
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep")
    with pytest.raises(UserInputError, match="not a ringtune checkpoint"):
        save_checkpoint(tmp_path / "precious", model=source, optimizer=None, step=0)
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep"
    assert not (tmp_path / "bad").exists()
    assert list_checkpoints(tmp_path) == ["ck", "weights"]
