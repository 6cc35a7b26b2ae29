"""The benches' clock: the median of CUDA-event times of a call, after warm-up calls."""
from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_ms(call: Callable[[], object], reps: int, warmup: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        call()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)
