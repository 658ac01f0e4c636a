"""Live CPU tensor bytes from a ``torch.profiler.profile(profile_memory=True)`` run (tests and benchmarks).

While memory profiling is on, torch's CPU allocator reports every allocation and free with its running total
of the bytes allocated since profiling started and still live. Blocks allocated before the profile (and freed
in it) are not counted.
"""

from __future__ import annotations

import torch


def allocation_events(prof: torch.profiler.profile) -> list[tuple[int, int, int]]:
    """(start ns, bytes allocated (< 0: freed), running total of live bytes) of every CPU allocation event,
    in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            out.append((event.start_time_ns, event.typed[1].alloc_size, event.typed[1].total_allocated))
    return sorted(out)


def tensor_peak_bytes(prof: torch.profiler.profile) -> int:
    """Peak bytes of live CPU tensor storage allocated inside the profile (0 if nothing was allocated)."""
    return max((total for _, _, total in allocation_events(prof)), default=0)
