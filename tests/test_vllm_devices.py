"""``--vllm-devices`` split over the started engines and the splits ``serve`` refuses (no GPU needed: the host's
ranks and GPU count are given)."""

from __future__ import annotations

import pytest

from ringtune.errors import UserInputError
from ringtune.worker.vllm_devices import engine_devices, engine_gpu_count


def test_devices_split_evenly_in_order():
    assert engine_devices("4,5,6,7", 2, [], ranks_on_host=4, gpus_on_host=8) == ["4,5", "6,7"]
    tp2 = ["--tensor-parallel-size", "2"]
    assert engine_devices("4,5,6,7", 2, tp2, ranks_on_host=4, gpus_on_host=8) == ["4,5", "6,7"]
    assert engine_devices("2", 1, [], ranks_on_host=2, gpus_on_host=4) == ["2"]
    assert engine_devices(None, 2, []) == []  # a CPU host: the engines see no GPU anyway
    assert engine_gpu_count(["--tensor-parallel-size=2", "-pp", "2", "--enforce-eager"]) == 4


@pytest.mark.parametrize(
    ("text", "engines", "extra", "message"),
    [
        ("4,5,6", 2, [], "do not split evenly over 2 started engine"),
        ("4,5", 1, ["-tp", "4"], "at least 4 GPU"),
        ("4,4", 2, [], r"GPU\(s\) \[4\] listed twice"),
        ("4,x", 2, [], "comma-separated GPU indices"),
        ("2,3,4,5", 2, [], r"GPU\(s\) \[2, 3\] hold training ranks"),
        ("6,8", 2, [], r"GPU\(s\) \[8\] do not exist"),
        ("6", 0, [], "no engine is started"),
        (None, 1, [], "give --vllm-devices"),
        ("4", 1, ["--tensor-parallel-size", "0"], "must be an integer >= 1"),
    ],
)
def test_splits_that_cannot_work_are_refused_naming_the_flag(text, engines, extra, message):
    with pytest.raises(UserInputError, match=message):
        engine_devices(text, engines, extra, ranks_on_host=4, gpus_on_host=8)


def test_a_shared_gpu_is_allowed_when_the_operator_sets_the_memory_share():
    assert engine_devices(None, 1, ["--gpu-memory-utilization", "0.3"], ranks_on_host=1, gpus_on_host=1) == []
