"""The parity matrix's serve options (issue 34), without servers: which flags each layout serves, which CP=1
server it is held against, that the default slice crosses every option at CP 2 and 4 and ``--full`` the product,
that each new debug fault is served at a layout of its option, the long-row profile's datums, and the client's
permutation putting outputs back in the datums' order. (The served runs are ``ringtune parity matrix``'s, recorded
in docs/validation.md: each takes a server, too slow for the suite.)"""

from __future__ import annotations

from types import SimpleNamespace

from ringtune.debug_faults import DEBUG_FAULTS, LONG_ROW_SEQUENCES
from ringtune.engine.packing import row_local_len
from ringtune.parity.client import _record
from ringtune.parity.datums import ParityDatum, text_token_stream
from ringtune.parity.limits import (
    BF16_CP_SPREAD,
    LIMITS,
    MEASURED_NOISE,
    NOISE_FACTOR,
    PERMUTATION_RESOLUTION,
    limits_from_noise,
)
from ringtune.parity.long_rows import MESH_PROMPT, MESH_PROMPT_TOKENS, PACKED_DATUMS, packed_datums
from ringtune.parity.matrix import FAULT_SPECS, OPTIONS_DEFAULT, options_full
from ringtune.parity.report import layout_cell
from ringtune.parity.servers import MAX_MATRIX_RANKS, ServeSpec


def test_a_spec_serves_its_options_and_names_them():
    spec = ServeSpec(
        model="m",
        cp=4,
        dtype="bf16-mixed",
        linear_cp_mode="chunkwise",
        attention="allgather",
        shard_params="dp_cp",
        recompute="selective",
        max_tokens_per_rank=256,
    )
    args = spec.arguments()
    for flag, value in (("--attention", "allgather"), ("--shard-params", "dp_cp"), ("--recompute", "selective")):
        assert args[args.index(flag) + 1] == value
    assert spec.name == "cp4-chunkwise-allgather-dp1-bf16-mixed-shard_dp_cp-rc_selective"
    assert layout_cell(spec) == "CP4 chunkwise allgather, shard dp_cp, recompute selective"
    lora = ServeSpec(model="m", cp=2, lora_rank=32, lora_pass_runs=2, shared_decode=False, long_rows=True)
    args = lora.arguments()
    assert args[args.index("--lora-pass-runs") + 1] == "2" and "--no-shared-decode" in args
    assert args[args.index("--mesh-prompt-tokens") + 1] == str(MESH_PROMPT_TOKENS) and lora.companion
    assert not ServeSpec(model="m", lora_rank=32).companion  # one run per pass: no companion needed
    assert layout_cell(lora) == "CP2 headwise, LoRA 32 (2 runs/pass, no shared decode), long rows"


def test_the_reference_keeps_what_changes_the_numbers_and_drops_what_must_not():
    spec = ServeSpec(
        model="m",
        cp=4,
        dp=1,
        dtype="bf16-mixed",
        attention="allgather",
        shard_params="dp_cp",
        recompute="full",
        lora_rank=32,
        lora_pass_runs=2,
        shared_decode=False,
        long_rows=True,
        max_tokens_per_rank=256,
        debug_fault="lora_grads_doubled_last_cp",
    )
    ref = spec.reference()
    assert (ref.cp, ref.dp, ref.attention, ref.shard_params, ref.recompute, ref.debug_fault) == (
        1,
        1,
        "ring",
        "none",
        "none",
        None,
    )
    assert ref.shared_decode and ref.max_tokens_per_rank == 1024  # the same packed-row budget
    assert (ref.dtype, ref.lora_rank, ref.lora_pass_runs, ref.long_rows) == ("bf16-mixed", 32, 2, True)


def _axes(layouts) -> dict[str, set]:
    seen: dict[str, set] = {}
    for o in layouts:
        spec = ServeSpec(model="m", max_tokens_per_rank=1024 // o["cp"], **o)
        for axis, value in (
            ("attention", spec.attention),
            ("dtype", spec.dtype),
            ("shard", spec.shard_params),
            ("lora", spec.lora_rank > 0),
            ("runs", spec.lora_pass_runs if spec.lora_rank else None),
            ("decode", spec.shared_decode if spec.lora_rank else None),
            ("recompute", spec.recompute),
            ("long", spec.long_rows),
        ):
            seen.setdefault(axis, set()).add((value, spec.cp))
        assert spec.dp * spec.cp <= MAX_MATRIX_RANKS
        assert spec.attention != "alltoall" or spec.cp == 2  # the tiny model's 2 KV heads
    return seen


def test_the_default_slice_crosses_each_option_at_cp_2_and_4():
    seen = _axes(OPTIONS_DEFAULT)
    cps = {axis: {cp for _, cp in values} for axis, values in seen.items()}
    values = {axis: {v for v, _ in pairs} for axis, pairs in seen.items()}
    assert {"allgather", "alltoall"} <= values["attention"] and "bf16-mixed" in values["dtype"]
    assert {"dp", "dp_cp"} <= values["shard"] and {"full", "selective"} <= values["recompute"]
    assert True in values["lora"] and True in values["long"] and False in values["decode"] and 2 in values["runs"]
    assert all(cps[axis] == {2, 4} for axis in ("shard", "lora", "recompute", "long", "dtype"))
    assert "float64" in values["dtype"] and len(OPTIONS_DEFAULT) == 9


def test_full_is_the_product():
    full = options_full()
    seen = _axes(full)
    values = {axis: {v for v, _ in pairs} for axis, pairs in seen.items()}
    assert values["dtype"] == {"float32", "bfloat16", "bf16-mixed", "float64"}
    assert values["attention"] == {"ring", "allgather", "alltoall"} and values["shard"] == {"none", "dp", "dp_cp"}
    assert values["recompute"] == {"none", "full", "selective"} and values["runs"] >= {1, 2}
    assert values["decode"] >= {True, False}
    combos = {
        (o.get("dtype", "float32"), o["cp"], o.get("attention", "ring"), o.get("shard_params", "none")) for o in full
    }
    for dtype in values["dtype"]:
        assert (dtype, 4, "allgather", "dp_cp") in combos and (dtype, 2, "alltoall", "dp") in combos
    assert len({tuple(sorted(o.items())) for o in full}) == len(full)  # no layout twice


def test_each_new_fault_is_served_at_a_layout_of_its_option():
    assert set(FAULT_SPECS) == set(DEBUG_FAULTS)
    assert FAULT_SPECS["allgather_kv_rank_reversed"]["attention"] == "allgather"
    assert FAULT_SPECS["mixed_cast_detached_last_cp"]["dtype"] == "bf16-mixed"
    assert FAULT_SPECS["sharded_step_count_cp1"]["shard_params"] == "dp_cp"
    assert FAULT_SPECS["lora_grads_doubled_last_cp"]["lora_rank"] == 32
    assert FAULT_SPECS["recompute_rerun_shifted"]["recompute"] == "selective"
    assert FAULT_SPECS["long_row_positions_carried"]["long_rows"]


def test_the_packed_row_holds_more_datums_than_the_long_row_fault_needs_within_the_budget():
    stream = text_token_stream(96, None)
    packed = packed_datums(stream, row_tokens=1024, seed=0)
    assert len(packed) == PACKED_DATUMS > LONG_ROW_SEQUENCES
    assert all(d.tokens[1:] == d.targets[:-1] for d in packed)
    for cp in (1, 2, 4):  # one packed row at every CP of the matrix (1024-token rows)
        assert row_local_len([len(d.tokens) for d in packed], cp_size=cp, multiple=8) <= 1024 // cp
    assert packed == packed_datums(stream, row_tokens=1024, seed=0)  # seeded
    assert MESH_PROMPT >= MESH_PROMPT_TOKENS  # the prompt takes the mesh prefill


def test_permuted_outputs_go_back_to_the_datums_order():
    datums = [ParityDatum(f"d{i}", "short", (1,) * (i + 1), (1,) * (i + 1), (1.0,) * (i + 1)) for i in range(3)]
    order = [2, 0, 1]  # sent d2, d0, d1

    def output(i: int):
        values = SimpleNamespace(to_torch=lambda: __import__("torch").full((i + 1,), float(i)))
        return {"logprobs": values, "elementwise_loss": values}

    result = SimpleNamespace(loss_fn_outputs=[output(i) for i in order], metrics={"loss:sum": 0.0})
    record = _record(result, datums, order)
    assert record["logprobs"] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]


def test_bf16_limits_come_from_the_measured_noise_where_a_permutation_moves_the_figure():
    for dtype in ("bfloat16", "bf16-mixed"):
        floors, limits = MEASURED_NOISE[dtype], LIMITS[dtype]
        for field in ("grad_norm", "grad_norm_later", "post_mean", "post_p99", "post_loss_per_token"):
            assert floors[field] > PERMUTATION_RESOLUTION
            assert getattr(limits, field) == NOISE_FACTOR * floors[field], (dtype, field)
        # the starting-weight forwards do not move under a permutation: their limits stay the CP spread's
        for field in ("lp_mean", "lp_p99", "kl", "short_max", "loss_per_token"):
            assert floors[field] <= PERMUTATION_RESOLUTION
            assert getattr(limits, field) == getattr(BF16_CP_SPREAD, field), (dtype, field)
    assert limits_from_noise(BF16_CP_SPREAD, {"grad_norm": 1e-3}, factor=2).grad_norm == 2e-3
