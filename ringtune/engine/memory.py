"""This process's peak memory: CUDA's max allocated bytes on GPU, the RSS high-water mark on CPU."""

from __future__ import annotations

import torch


def peak_memory_bytes() -> int:
    """Peak bytes of this process so far (CUDA: ``max_memory_allocated``; CPU: VmHWM of /proc/self/status)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
