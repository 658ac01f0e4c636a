"""Mesh coordinates and the autograd-aware collectives (forward and backward) on 4 gloo ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ringtune.errors import ParallelConfigError
from ringtune.parallel import all_gather, all_to_all, measure_comm, reduce_scatter, ring_shift, spawn
from ringtune.parallel.mesh import build_mesh


def mesh_case(ctx, *, dp: int, cp: int):
    mesh = ctx.mesh(dp=dp, cp=cp)
    return {
        "coords": (mesh.dp_rank, mesh.cp_rank, mesh.tp_rank),
        "cp_members": dist.get_process_group_ranks(mesh.cp_group),
        "dp_members": dist.get_process_group_ranks(mesh.dp_group),
        "dp_cp_size": dist.get_world_size(mesh.dp_cp_group),
    }


@pytest.mark.parametrize(("dp", "cp"), [(1, 4), (2, 2), (4, 1)])
def test_mesh_rank_order_cp_fastest(pool4, dp, cp):
    for rank, info in enumerate(pool4.run(mesh_case, dp=dp, cp=cp)):
        assert info["coords"] == (rank // cp, rank % cp, 0)
        assert info["cp_members"] == [(rank // cp) * cp + i for i in range(cp)]
        assert info["dp_members"] == [i * cp + rank % cp for i in range(dp)]
        assert info["dp_cp_size"] == 4


def bad_mesh_case(ctx):
    try:
        build_mesh(dp=3, cp=2)
    except ParallelConfigError as exc:
        return str(exc)
    return None


def test_mesh_size_mismatch_is_a_clear_error(pool4):
    for message in pool4.run(bad_mesh_case):
        assert "3*2*1 = 6 must equal the world size 4" in message


def data_backend_case(ctx):
    """The data groups' backend as asked (recorded on the mesh for rebuilds); NCCL for a CPU mesh refused."""
    mesh = build_mesh(dp=2, cp=2, device_type="cpu", data_backend="gloo")
    out = {"backend": mesh.data_backend, "group": str(dist.get_backend(mesh.cp_group))}
    try:
        build_mesh(dp=2, cp=2, device_type="cpu", data_backend="nccl")
    except ParallelConfigError as exc:
        out["refused"] = str(exc)
    return out


def test_mesh_data_backend_is_explicit(pool4):
    for info in pool4.run(data_backend_case):
        assert info["backend"] == "gloo" and info["group"] == "gloo"
        assert "data_backend='nccl' cannot serve device 'cpu'" in info["refused"]


def collectives_case(ctx):
    """Each collective's forward and its backward against what the other ranks hold (float64)."""
    mesh = ctx.mesh(dp=1, cp=4)
    group, r, size = mesh.cp_group, mesh.cp_rank, 4
    out = {}
    base = [torch.arange(6, dtype=torch.float64).reshape(3, 2) + 10 * i for i in range(size)]
    weights = [torch.full((12, 2), float(i + 1), dtype=torch.float64) for i in range(size)]

    x = base[r].clone().requires_grad_()
    with measure_comm() as meter:
        y = all_gather(x, group)
        (y * weights[r]).sum().backward()
    out["all_gather_fwd"] = torch.equal(y.detach(), torch.cat(base))
    out["all_gather_bwd"] = torch.equal(x.grad, sum(w[3 * r : 3 * r + 3] for w in weights))
    out["all_gather_bytes"] = meter.by_op

    x = torch.cat(base).clone().requires_grad_()
    y = reduce_scatter(x, group)
    (y * weights[r][:3]).sum().backward()
    out["reduce_scatter_fwd"] = torch.equal(y.detach(), size * base[r])
    out["reduce_scatter_bwd"] = torch.equal(x.grad, torch.cat([w[:3] for w in weights]))

    # Uneven all-to-all: rank i sends j+1 rows to rank j, each row tagged (src, dst).
    send_counts = [j + 1 for j in range(size)]
    recv_counts = [r + 1] * size
    x = torch.cat([torch.tensor([[r, j]] * (j + 1), dtype=torch.float64) for j in range(size)]).requires_grad_()
    y = all_to_all(x, group, send_counts, recv_counts)
    expect = torch.cat([torch.tensor([[i, r]] * (r + 1), dtype=torch.float64) for i in range(size)])
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
    (y * g).sum().backward()
    out["all_to_all_fwd"] = torch.equal(y.detach(), expect)
    out["all_to_all_grad"] = x.grad  # checked by the parent against the receivers' g
    out["all_to_all_g"] = g

    x = base[r].clone().requires_grad_()
    y = ring_shift(x, group, 1)
    (y * weights[r][:3]).sum().backward()
    out["ring_fwd"] = torch.equal(y.detach(), base[(r - 1) % size])
    out["ring_bwd"] = torch.equal(x.grad, weights[(r + 1) % size][:3])
    return out


def test_collectives_forward_backward(pool4):
    results = pool4.run(collectives_case)
    for r, res in enumerate(results):
        for key in ("all_gather_fwd", "all_gather_bwd", "reduce_scatter_fwd", "reduce_scatter_bwd"):
            assert res[key], (r, key)
        assert res["all_to_all_fwd"] and res["ring_fwd"] and res["ring_bwd"], r
        assert res["all_gather_bytes"]["all_gather"] == 3 * (3 * 2 * 8)  # its 48-byte block to 3 peers
        assert res["all_gather_bytes"]["reduce_scatter"] == 3 * (3 * 2 * 8)
        # The gradient of the rows rank r sent to rank j is the block of j's g that came from r.
        want = torch.cat([results[j]["all_to_all_g"][r * (j + 1) : (r + 1) * (j + 1)] for j in range(4)])
        assert torch.equal(res["all_to_all_grad"], want), r


def _spawned(rank: int, scale: int) -> int:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t)


def _spawned_failing(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 refuses")


def test_spawn_returns_rank_order_and_reports_failures():
    assert spawn(_spawned, 2, 5) == [5, 5]
    with pytest.raises(RuntimeError, match="rank 1 refuses"):
        spawn(_spawned_failing, 2)


def relayout_case(ctx, *, cp: int, seq_lens: tuple[int, ...]):
    """zigzag -> contiguous gives the global padded stream's part; back gives the shard; grads too."""
    from ringtune.layout import relayout_plan, zigzag_plan
    from ringtune.parallel.relayout import contiguous_to_zigzag, zigzag_to_contiguous

    mesh = ctx.mesh(dp=ctx.world_size // cp, cp=cp)
    plan = zigzag_plan(seq_lens, cp_size=cp, cp_rank=mesh.cp_rank, pad_multiplier=4)
    moves = relayout_plan(plan)
    # Each local row carries its own global index, so the contiguous part must be arange.
    x = plan.global_index.to(torch.float64).unsqueeze(1).repeat(1, 3).requires_grad_()
    part = zigzag_to_contiguous(x, moves, mesh.cp_group)
    lo = mesh.cp_rank * plan.local_len
    want = torch.arange(lo, lo + plan.local_len, dtype=torch.float64).unsqueeze(1).repeat(1, 3)
    back = contiguous_to_zigzag(part, moves, mesh.cp_group)
    (part * part.detach()).sum().backward()  # d/dx of sum(part * const) routes const back to x
    return {
        "forward": torch.equal(part.detach(), want),
        "roundtrip": torch.equal(back.detach(), x.detach()),
        "backward": torch.equal(x.grad, x.detach()),
    }


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("seq_lens", [(5, 1, 17, 3, 40), (100,), ()])
def test_relayout_zigzag_contiguous_is_a_permutation(pool4, cp, seq_lens):
    for res in pool4.run(relayout_case, cp=cp, seq_lens=seq_lens):
        assert res == {"forward": True, "roundtrip": True, "backward": True}
