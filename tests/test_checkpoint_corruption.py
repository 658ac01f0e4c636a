"""Corruption catalogue for ringtune.engine.checkpoint: every broken, foreign or badly named checkpoint is refused
with a UserInputError that names it, and the model weights, gradients and AdamW state (moments, step counts,
hyper-parameters) stay bit-identical (``torch.equal`` on every tensor).

The checkpoints come from the tiny Qwen3.5 hybrid model (GatedDeltaNet + gated attention layers, float64) after
one AdamW step; each corruption is applied to a plain copy of the published version. The last test runs on two
gloo ranks: a corruption that only rank 1 can see, and a DCP read failure injected on rank 1 only, make both ranks
raise the same error with nothing changed on either, while a good checkpoint loads on both.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.harness import RankPool

from ringtune.engine.checkpoint import export_hf_weights, load_checkpoint, save_checkpoint
from ringtune.engine.checkpoint_manifest import assign_files, hash_file
from ringtune.engine.checkpoint_root import KINDS, CheckpointRoot
from ringtune.errors import UserInputError
from ringtune.models.checkpoints.hf import load_hf
from ringtune.models.decoder import CausalLM

RECORD = "ringtune.json"
DISTCP = "__0_0.distcp"


# --------------------------------------------------------------------------------------------------- models


def stepped(hf_dir: str | Path, seed: int) -> tuple[CausalLM, torch.optim.AdamW]:
    """The float64 model of ``hf_dir`` and an AdamW that took one step on seeded random gradients.

    The gradients of that step are left in place (a live model between forward_backward and optim_step), so
    a refused load can be seen to leave them alone as well.
    """
    model = load_hf(hf_dir, dtype=torch.float64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.01)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    optimizer.step()
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    return model, optimizer


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """Copies of every model tensor, gradient, optimizer state entry and hyper-parameter."""
    names = {id(p): n for n, p in model.named_parameters()}
    state, groups = {}, []
    if optimizer is not None:
        state = {
            names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for p, s in optimizer.state.items()
        }
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    return {
        "model": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "grads": {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        "state": state,
        "groups": groups,
    }


def differences(a: dict, b: dict) -> list[str]:
    """Where two snapshots differ (dtype or any bit of any tensor); [] when identical."""

    def tensors_differ(x, y) -> bool:
        if x is None or y is None:
            return (x is None) != (y is None)
        if torch.is_tensor(x) != torch.is_tensor(y):
            return True
        if not torch.is_tensor(x):
            return x != y
        return x.dtype != y.dtype or not torch.equal(x, y)

    found = []
    for part in ("model", "grads"):
        if a[part].keys() != b[part].keys():
            found.append(f"{part} keys")
        found += [f"{part} {k}" for k in a[part] if k in b[part] and tensors_differ(a[part][k], b[part][k])]
    if a["state"].keys() != b["state"].keys():
        found.append("optimizer state parameters")
    for name in a["state"].keys() & b["state"].keys():
        sa, sb = a["state"][name], b["state"][name]
        if sa.keys() != sb.keys():
            found.append(f"state {name} keys")
        found += [f"state {name}.{k}" for k in sa.keys() & sb.keys() if tensors_differ(sa[k], sb[k])]
    if a["groups"] != b["groups"]:
        found.append("param_groups")
    return found


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory) -> dict[str, str]:
    """HF directories: the source and target Qwen3.5 models, one with other MLP shapes, a Llama (other keys)."""
    import transformers
    from support.tiny_models import hf_config, hf_model

    base = tmp_path_factory.mktemp("hf")
    dirs = {}
    for name, family, seed in (("source", "qwen3_5", 0), ("target", "qwen3_5", 1), ("llama", "llama", 2)):
        hf_model(family, seed=seed).save_pretrained(base / name)
        dirs[name] = str(base / name)
    config = hf_config("qwen3_5")
    config.intermediate_size = 40
    torch.manual_seed(3)
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(base / "wide")
    dirs["wide"] = str(base / "wide")
    return dirs


@pytest.fixture(scope="module")
def saved(hf_dirs, tmp_path_factory) -> dict[str, Path]:
    """Published checkpoints: the stepped source with AdamW and weights only, and the wide model with AdamW."""
    root = tmp_path_factory.mktemp("saved")
    model, optimizer = stepped(hf_dirs["source"], seed=0)
    save_checkpoint(root / "good", model=model, optimizer=optimizer, step=1, extra={"run": "source"})
    save_checkpoint(root / "weights_only", model=model, optimizer=None, step=1)
    wide, wide_optimizer = stepped(hf_dirs["wide"], seed=0)
    save_checkpoint(root / "wide", model=wide, optimizer=wide_optimizer, step=1)
    return {"root": root, "good": root / "good", "weights_only": root / "weights_only", "wide": root / "wide"}


def refused(path: Path, model, optimizer, match: str) -> UserInputError:
    """Load ``path``; it must raise a UserInputError matching ``match`` that names ``path``, changing nothing."""
    before = snapshot(model, optimizer)
    with pytest.raises(UserInputError, match=match) as info:
        load_checkpoint(path, model=model, optimizer=optimizer)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)
    assert differences(before, snapshot(model, optimizer)) == []
    return info.value


def test_good_checkpoint_loads_bit_exact(hf_dirs, saved):
    """The positive control: the uncorrupted checkpoint restores the source exactly (and drops gradients)."""
    source, source_optimizer = stepped(hf_dirs["source"], seed=0)
    for p in source.parameters():
        p.grad = None
    model, optimizer = stepped(hf_dirs["target"], seed=1)
    assert differences(snapshot(model, optimizer), snapshot(source, source_optimizer)) != []
    assert load_checkpoint(saved["good"], model=model, optimizer=optimizer) == (1, {"run": "source"})
    assert differences(snapshot(model, optimizer), snapshot(source, source_optimizer)) == []

    copy = saved["root"] / "copy_of_good"  # a plain directory copy (what every corruption below starts from)
    shutil.copytree(saved["good"].resolve(), copy)
    model, optimizer = stepped(hf_dirs["target"], seed=1)
    assert load_checkpoint(copy, model=model, optimizer=optimizer) == (1, {"run": "source"})
    assert differences(snapshot(model, optimizer), snapshot(source, source_optimizer)) == []


# --------------------------------------------------------------------------------------------------- corruptions


def truncate(name: str) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        data = (directory / name).read_bytes()
        (directory / name).write_bytes(data[: len(data) // 2])

    return apply


def flip(name: str, count: int = 64) -> Callable[[Path], None]:
    """XOR ``count`` bytes in the middle of the file with 0xFF (the size stays)."""

    def apply(directory: Path) -> None:
        data = bytearray((directory / name).read_bytes())
        mid = len(data) // 2
        data[mid : mid + count] = bytes(b ^ 0xFF for b in data[mid : mid + count])
        (directory / name).write_bytes(bytes(data))

    return apply


def edit_record(change: Callable[[dict], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        record = json.loads((directory / RECORD).read_text())
        change(record)
        (directory / RECORD).write_text(json.dumps(record))

    return apply


def rewrite_manifest(directory: Path) -> None:
    """Make the manifest match the files as they are now (what a buggy writer would do)."""
    record = json.loads((directory / RECORD).read_text())
    files = {}
    for p in directory.iterdir():
        if p.name != RECORD:
            found = hash_file(p)
            files[p.name] = {"size": found.size, "sha256": found.sha256}
    record["manifest"]["files"] = files
    (directory / RECORD).write_text(json.dumps(record))


def then_rewrite(change: Callable[[Path], None]) -> Callable[[Path], None]:
    def apply(directory: Path) -> None:
        change(directory)
        rewrite_manifest(directory)

    return apply


def write(name: str, data: bytes) -> Callable[[Path], None]:
    return lambda directory: (directory / name).write_bytes(data)


def remove(name: str) -> Callable[[Path], None]:
    return lambda directory: (directory / name).unlink()


def manifest_files(change: Callable[[dict], None]) -> Callable[[Path], None]:
    return edit_record(lambda r: change(r["manifest"]["files"]))


def set_field(key: str, value) -> Callable[[dict], None]:
    return lambda r: r.__setitem__(key, value)


def drop_field(key: str) -> Callable[[dict], None]:
    return lambda r: r.pop(key)


def make_saved(record: dict) -> None:
    record["optimizer"] = "saved"
    record["optimizer_class"] = "torch.optim.adamw.AdamW"


# (id, base checkpoint, corruption, expected message pattern)
CORRUPTIONS = [
    ("truncated_distcp", "good", truncate(DISTCP), rf"{DISTCP} has \d+ bytes, its manifest says \d+ \(truncated"),
    ("truncated_metadata", "good", truncate(".metadata"), r"\.metadata has \d+ bytes, its manifest says \d+"),
    ("flipped_distcp", "good", flip(DISTCP), rf"{DISTCP} is corrupt: sha256 [0-9a-f]{{16}}\.\.\. over"),
    ("flipped_metadata", "good", flip(".metadata", 8), r"\.metadata is corrupt: sha256"),
    ("deleted_distcp", "good", remove(DISTCP), rf"missing files \['{DISTCP}'\] \(1 in all\), unlisted files \[\]"),
    ("deleted_metadata", "good", remove(".metadata"), r"missing files \['\.metadata'\]"),
    (
        "extra_file",
        "good",
        write("stray.bin", b"x"),
        r"missing files \[\] \(0 in all\), unlisted files \['stray\.bin'\]",
    ),
    ("record_missing", "good", remove(RECORD), "incomplete or not a ringtune checkpoint: ringtune.json is missing"),
    ("record_not_json", "good", write(RECORD, b'{"format": "ringtune.dcp/2", '), "ringtune.json is not valid JSON"),
    ("record_not_utf8", "good", write(RECORD, b"\xff\xfe\x00{"), "ringtune.json is not valid JSON"),
    ("record_not_object", "good", write(RECORD, b"[1, 2]"), "ringtune.json is a list; must be a JSON object"),
    ("step_missing", "good", edit_record(drop_field("step")), "ringtune.json has no field 'step'"),
    ("step_negative", "good", edit_record(set_field("step", -1)), r"field step=-1; must be an int >= 0"),
    ("step_string", "good", edit_record(set_field("step", "3")), r"field step='3'; must be an int >= 0"),
    ("step_float", "good", edit_record(set_field("step", 1.0)), r"field step=1\.0; must be an int >= 0"),
    ("step_bool", "good", edit_record(set_field("step", True)), r"field step=True; must be an int >= 0"),
    ("extra_missing", "good", edit_record(drop_field("extra")), "ringtune.json has no field 'extra'"),
    ("extra_list", "good", edit_record(set_field("extra", [1])), r"field extra=\[1\]; must be a JSON object"),
    ("format_old", "good", edit_record(set_field("format", "ringtune.dcp/1")), r"format='ringtune\.dcp/1'; this"),
    ("format_missing", "good", edit_record(drop_field("format")), r"field format=None; this ringtune reads"),
    ("optimizer_kind", "good", edit_record(set_field("optimizer", "adam")), r"field optimizer='adam'; must be one"),
    ("optimizer_class_missing", "good", edit_record(set_field("optimizer_class", None)), "must name the optimizer"),
    ("world_size_zero", "good", edit_record(set_field("world_size", 0)), r"field world_size=0; must be an int >= 1"),
    ("manifest_missing", "good", edit_record(drop_field("manifest")), "ringtune.json has no field 'manifest'"),
    (
        "manifest_other_hash",
        "good",
        edit_record(lambda r: r["manifest"].__setitem__("hash", "md5")),
        r'field manifest=.*; must be \{"hash": "sha256"',
    ),
    (
        "manifest_size_wrong",
        "good",
        manifest_files(lambda f: f[".metadata"].__setitem__("size", f[".metadata"]["size"] + 1)),
        r"\.metadata has \d+ bytes, its manifest says \d+",
    ),
    (
        "manifest_digest_wrong",
        "good",
        manifest_files(lambda f: f[DISTCP].__setitem__("sha256", "0" * 64)),
        rf"{DISTCP} is corrupt: sha256 .* the manifest says 0000000000000000\.\.\.",
    ),
    (
        "manifest_digest_malformed",
        "good",
        manifest_files(lambda f: f[DISTCP].__setitem__("sha256", "XYZ")),
        r"sha256='XYZ'; must be 64 lowercase hex digits",
    ),
    ("manifest_entry_dropped", "good", manifest_files(lambda f: f.pop(DISTCP)), rf"unlisted files \['{DISTCP}'\]"),
    (
        "manifest_entry_ghost",
        "good",
        manifest_files(lambda f: f.__setitem__("__1_0.distcp", f[DISTCP])),
        r"missing files \['__1_0\.distcp'\]",
    ),
    (
        "manifest_entry_traversal",
        "good",
        manifest_files(lambda f: f.__setitem__("../good", f[DISTCP])),
        r"manifest entry '\.\./good': not a plain file name",
    ),
    (
        "manifest_lists_record",
        "good",
        manifest_files(lambda f: f.__setitem__(RECORD, f[DISTCP])),
        "manifest entry 'ringtune.json': the record cannot list itself",
    ),
    # Past the manifest (as if the writer itself were wrong): DCP's own errors are caught and reported.
    (
        "truncated_distcp_manifest_rewritten",
        "good",
        then_rewrite(truncate(DISTCP)),
        r"could not be read \(corrupt, missing or foreign data\): CheckpointException",
    ),
    (
        "garbage_metadata_manifest_rewritten",
        "good",
        then_rewrite(write(".metadata", b"\x80\x04not a pickle")),
        "cannot read its DCP metadata",
    ),
    (
        "record_claims_optimizer_state",
        "weights_only",
        edit_record(make_saved),
        r"its record says optimizer='saved' but it holds 0 optimizer entries",
    ),
]


@pytest.mark.parametrize(("case", "base", "corrupt", "match"), CORRUPTIONS, ids=[c[0] for c in CORRUPTIONS])
def test_corrupt_checkpoint_is_refused_and_changes_nothing(hf_dirs, saved, tmp_path, case, base, corrupt, match):
    checkpoint = tmp_path / case
    shutil.copytree(saved[base].resolve(), checkpoint)
    corrupt(checkpoint)
    model, optimizer = stepped(hf_dirs["target"], seed=1)
    refused(checkpoint, model, optimizer, match)
    if not case.endswith("_manifest_rewritten"):
        # Weights only (optimizer=None) is refused too: files and record are checked whatever is read.
        model, _ = stepped(hf_dirs["target"], seed=1)
        refused(checkpoint, model, None, match)


def test_foreign_checkpoints_are_refused(hf_dirs, saved):
    model, optimizer = stepped(hf_dirs["target"], seed=1)
    refused(saved["wide"], model, optimizer, r"different model: model tensor model\.layers\.0\.mlp\.\w+\.weight is")
    refused(saved["wide"], model, None, "different model")
    llama, llama_optimizer = stepped(hf_dirs["llama"], seed=1)
    refused(saved["good"], llama, llama_optimizer, r"different model: model tensors missing \[")
    refused(saved["weights_only"], model, optimizer, r"has no optimizer state \(saved without one\)")
    refused(saved["good"], model.float(), None, r"different model: .* is torch\.float64 .* needs torch\.float32")

    model, _ = stepped(hf_dirs["target"], seed=1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    refused(saved["good"], model, sgd, r"different optimizer: it holds torch\.optim\.adamw\.AdamW state, this")
    assert not sgd.state
    # Same class, other hyper-parameter names (amsgrad adds none, so use an optimizer group with an extra key).
    adamw = torch.optim.AdamW(model.parameters(), lr=0.1)
    adamw.param_groups[0]["tag"] = "extra"
    refused(saved["good"], model, adamw, r"optimizer hyper-parameters of .* this optimizer has \[")


def test_read_errors_of_any_kind_are_caught_but_interrupts_pass(hf_dirs, saved, monkeypatch):
    """A BaseException from DCP's reader (not an Exception) is refused like corruption; Ctrl-C is not swallowed
    (DCP wraps it into a CheckpointException; the load unwraps and re-raises it)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    class Odd(BaseException):
        pass

    model, optimizer = stepped(hf_dirs["target"], seed=1)
    for error, match in (
        (CheckpointException("injected", {0: OSError("disk")}), "could not be read .*CheckpointException"),
        (Odd("odd"), r"could not be read .*Odd: odd"),
        (OSError(5, "Input/output error"), r"could not be read .*OSError: \[Errno 5\]"),
    ):

        def read_data(self, plan, planner, error=error):
            raise error

        monkeypatch.setattr(FileSystemReader, "read_data", read_data)
        refused(saved["good"], model, optimizer, match)

    before = snapshot(model, optimizer)

    def out_of_memory(self, plan, planner):
        raise MemoryError("injected")

    monkeypatch.setattr(FileSystemReader, "read_data", out_of_memory)  # a server error, not the checkpoint's fault
    with pytest.raises(RuntimeError, match=r"out of memory while reading \(CheckpointException \(rank 0: MemoryError"):
        load_checkpoint(saved["good"], model=model, optimizer=optimizer)

    def interrupted(self, plan, planner):
        raise KeyboardInterrupt

    monkeypatch.setattr(FileSystemReader, "read_data", interrupted)
    with pytest.raises(KeyboardInterrupt):
        load_checkpoint(saved["good"], model=model, optimizer=optimizer)
    assert differences(before, snapshot(model, optimizer)) == []


# --------------------------------------------------------------------------------------------------- names


ROOT_BAD_NAMES = ["..", "../x", "/abs", "a/b", "a\\b", "nul\x00x", "new\nline", "", "x" * 200, ".hidden", ".", "é"]
"""Refused by the root as checkpoint names (and, for the run id column, as run ids except 200 characters)."""
PATH_BAD_NAMES = ["..", "a\\b", "nul\x00x", "new\nline", "x" * 200, ".hidden", "sp ace", "tab\tx"]
"""Refused as the last component of a path given straight to save/load/export."""


def tree(directory: Path) -> list[str]:
    return sorted(str(p.relative_to(directory)) for p in directory.rglob("*"))


def test_bad_names_are_refused_for_save_and_load(hf_dirs, saved, tmp_path):
    root = CheckpointRoot(tmp_path / "root")
    model, optimizer = stepped(hf_dirs["target"], seed=1)
    before = snapshot(model, optimizer)
    shutil.copytree(saved["good"].resolve(), root.path("run", "weights", "good"))
    listing = tree(tmp_path)

    for name in ROOT_BAD_NAMES:
        rule = r"allowed: 1 to 128 characters from \[A-Za-z0-9\._:-\], not starting with '\.'"
        for kind in KINDS:
            with pytest.raises(UserInputError, match=f"checkpoint name=.*; {rule}"):
                save_checkpoint(root.path("run", kind, name), model=model, optimizer=optimizer, step=2)
            with pytest.raises(UserInputError, match=f"checkpoint name=.*; {rule}"):
                load_checkpoint(root.path("run", kind, name), model=model, optimizer=optimizer)
        with pytest.raises(UserInputError, match=r"path.*(checkpoint name=|parts after tinker://)"):
            root.resolve(f"tinker://run/weights/{name}")
        bad_run_id = "x" * 300 if len(name) > 100 else name
        with pytest.raises(UserInputError, match=r"run_id=.*allowed: 1 to 255 characters"):
            root.path(bad_run_id, "weights", "good")
    kinds = r"\['weights', 'sampler_weights', 'external_weights'\]"
    with pytest.raises(UserInputError, match=r"checkpoint kind='\.\.' is not one of " + kinds):
        root.path("run", "..", "good")

    for name in PATH_BAD_NAMES:
        with pytest.raises(UserInputError, match=r"checkpoint name=.*allowed") as info:
            save_checkpoint(tmp_path / name, model=model, optimizer=optimizer, step=2)
        assert "\n" not in str(info.value)
        with pytest.raises(UserInputError, match=r"checkpoint name=.*allowed"):
            load_checkpoint(tmp_path / name, model=model, optimizer=optimizer)
        with pytest.raises(UserInputError, match=r"export name=.*allowed"):
            export_hf_weights(model, tmp_path / name)
    assert tree(tmp_path) == listing  # nothing written anywhere
    assert differences(before, snapshot(model, optimizer)) == []

    # The good name next to them still loads (the names, not the files, were refused).
    load_checkpoint(root.resolve("tinker://run/weights/good"), model=model, optimizer=optimizer)
    assert differences(before, snapshot(model, optimizer)) != []


def test_symlinks_out_of_the_root_are_refused(saved, tmp_path):
    root = CheckpointRoot(tmp_path / "root")
    outside = tmp_path / "outside"
    shutil.copytree(saved["good"].resolve(), outside / "ck")
    root.run_dir("run").mkdir()
    (root.run_dir("run") / "weights").mkdir()
    (root.run_dir("run") / "weights" / "evil").symlink_to(outside / "ck")
    with pytest.raises(UserInputError, match=r"resolves to .*outside/ck, outside the checkpoint root"):
        root.path("run", "weights", "evil")
    (root.directory / "linked").symlink_to(outside)
    with pytest.raises(UserInputError, match="outside the checkpoint root"):
        root.path("linked", "weights", "ck")
    assert [i.ref.name for i in root.checkpoints("run")] == []  # listing skips it too


def test_save_under_a_file_is_refused_and_writes_nothing(hf_dirs, tmp_path):
    model, optimizer = stepped(hf_dirs["source"], seed=0)
    before = snapshot(model, optimizer)
    (tmp_path / "file.txt").write_text("keep")
    root = CheckpointRoot(tmp_path / "root")
    root.run_dir("filerun").write_text("a file where a run directory belongs")
    listing = tree(tmp_path)
    for path in (tmp_path / "file.txt" / "ck", tmp_path / "file.txt" / "sub" / "ck"):
        with pytest.raises(UserInputError, match=rf"checkpoint path {re.escape(str(path))}: .*file\.txt exists and"):
            save_checkpoint(path, model=model, optimizer=optimizer, step=1)
        with pytest.raises(UserInputError, match="exists and is not a directory"):
            export_hf_weights(model, path)
    with pytest.raises(UserInputError, match=r"filerun exists and is not a directory"):
        save_checkpoint(root.path("filerun", "weights", "ck"), model=model, optimizer=optimizer, step=1)
    with pytest.raises(UserInputError, match="not a directory"):
        CheckpointRoot(tmp_path / "file.txt")
    assert tree(tmp_path) == listing
    assert (tmp_path / "file.txt").read_text() == "keep"
    assert differences(before, snapshot(model, optimizer)) == []


# --------------------------------------------------------------------------------------------------- two ranks


@pytest.fixture(scope="module")
def pool2():
    pool = RankPool(2, timeout=180)
    yield pool
    pool.close()


def two_rank_save(ctx, source: str, root: str) -> None:
    """Both ranks hold the same stepped source; they save it together over the mesh's control group."""
    mesh = ctx.mesh(dp=2, cp=1)
    model, optimizer = stepped(source, seed=0)
    save_checkpoint(
        Path(root) / "two", model=model, optimizer=optimizer, step=1, extra={"ranks": 2}, group=mesh.control_group
    )


def two_rank_loads(ctx, source: str, target: str, root: str, cases: list[tuple[str, str, bool]]) -> list[dict]:
    """Per case (checkpoint name, fault, use the control group): the outcome on this rank and what changed."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.api import CheckpointException

    mesh = ctx.mesh(dp=2, cp=1)
    expected, expected_optimizer = stepped(source, seed=0)
    for p in expected.parameters():
        p.grad = None
    results = []
    for name, fault, control in cases:
        model, optimizer = stepped(target, seed=1)
        before = snapshot(model, optimizer)
        original = FileSystemReader.read_data
        if fault == "read_fails_on_rank1" and ctx.rank == 1:

            def read_data(self, plan, planner):
                raise CheckpointException("injected read failure", {1: OSError("injected")})

            FileSystemReader.read_data = read_data
        try:
            step, extra = load_checkpoint(
                Path(root) / name, model=model, optimizer=optimizer, group=mesh.control_group if control else None
            )
            outcome = f"loaded step={step} extra={extra}"
        except UserInputError as exc:
            outcome = f"UserInputError: {exc}"
        finally:
            FileSystemReader.read_data = original
        after = snapshot(model, optimizer)
        results.append(
            {
                "outcome": outcome,
                "unchanged": differences(before, after) == [],
                "is_source": differences(after, snapshot(expected, expected_optimizer)) == [],
            }
        )
    return results


def test_two_ranks_refuse_together_and_change_nothing(pool2, hf_dirs, tmp_path):
    pool2.run(two_rank_save, source=hf_dirs["source"], root=str(tmp_path))
    two = (tmp_path / "two").resolve()
    record = json.loads((two / RECORD).read_text())
    files = record["manifest"]["files"]
    assert record["world_size"] == 2 and sorted(files) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # Flip bytes in the largest file that only rank 1 hashes: rank 0 alone would load it.
    share1 = assign_files({n: f["size"] for n, f in files.items()}, 2)[1]
    victim = max(share1, key=lambda n: files[n]["size"])
    assert victim.endswith(".distcp")
    shutil.copytree(two, tmp_path / "rank1_sees_it")
    flip(victim)(tmp_path / "rank1_sees_it")

    cases = [
        ("two", "", True),
        ("two", "", False),  # the default (world) group
        ("rank1_sees_it", "", True),
        ("two", "read_fails_on_rank1", True),
    ]
    per_rank = pool2.run(
        two_rank_loads, source=hf_dirs["source"], target=hf_dirs["target"], root=str(tmp_path), cases=cases
    )
    for i, (name, fault, _) in enumerate(cases):
        rank0, rank1 = per_rank[0][i], per_rank[1][i]
        assert rank0["outcome"] == rank1["outcome"], (name, fault)  # the same verdict, word for word
        if name == "two" and not fault:
            assert rank0["outcome"] == "loaded step=1 extra={'ranks': 2}"
            assert rank0["is_source"] and rank1["is_source"]
            continue
        assert rank0["unchanged"] and rank1["unchanged"], (name, fault)
        assert str(tmp_path / name) in rank0["outcome"]
        if fault:
            assert re.match(r"UserInputError: .* could not be read .*CheckpointException", rank0["outcome"])
        else:
            assert re.match(rf"UserInputError: .*{victim} is corrupt: .*\(checked on rank 1\)", rank0["outcome"])
