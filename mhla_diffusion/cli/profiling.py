"""`--profile` of the bench commands: where one call's time goes, from torch.profiler.

A speed target that is missed should be explained by measurement: this prints, per call, the
wall time, the GPU busy time (sum of kernel times) and the kernels and CPU ops that take it.
The profiler's own buffer requests ("Activity Buffer Request", device time of its own) are left out
of the busy time (they made a Wan 14B MHLA forward read 1.66 ms busy against 1.27 ms graph replay).
"""

from __future__ import annotations

import time

import torch

PROFILER_OWN = {"Activity Buffer Request"}


def _profiled(fn, calls: int):
    """torch.profiler events of `calls` calls of `fn` (after one warm-up), the wall ms per call, and the
    GPU busy ms per call (kernels counted once, under the CPU op that launched them, as the table's own
    total does)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        wall_ms = (time.perf_counter() - start) * 1e3 / calls
    events = prof.key_averages()
    gpu_ms = sum(e.self_device_time_total for e in events
                 if e.device_type == DeviceType.CPU and e.key not in PROFILER_OWN) / 1e3 / calls
    return events, wall_ms, gpu_ms


def kernel_profile(fn, calls: int = 3, top: int = 15) -> str:
    """Profile `calls` calls of `fn` (after one warm-up) and return a printable report."""
    events, wall_ms, gpu_ms = _profiled(fn, calls)
    head = (f"per call: wall {wall_ms:.3f} ms, GPU busy {gpu_ms:.3f} ms "
            f"({'GPU' if gpu_ms > 0.8 * wall_ms else 'CPU/launch'}-bound); times below are totals over {calls} calls")
    by_gpu = events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60)
    by_cpu = events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
    return f"{head}\n-- by GPU time --\n{by_gpu}\n-- by CPU time --\n{by_cpu}"
