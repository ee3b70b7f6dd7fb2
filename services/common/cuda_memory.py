"""The CUDA caching allocator's own counters as a stage's metrics: whether the stage's host waits
for the device inside the allocator. A ``cudaFree`` (returning cached blocks when an allocation
finds none free, an "alloc retry") synchronizes the whole device, and a ``cudaMalloc`` can take
milliseconds; in steady serving both should stay flat. Read at scrape time from the stage's
``torch.cuda.memory_stats`` (the allocator's lock, no device sync; passed in, as this room imports no
torch); nothing off CUDA."""

from __future__ import annotations

from collections.abc import Callable

# memory_stats key -> (metric name, kind, help)
_STATS = {
    "num_alloc_retries": ("cuda_alloc_retries", "counter",
                          "allocations that freed the cache to retry (each a device sync)"),
    "num_device_alloc": ("cuda_device_allocs", "counter", "cudaMalloc calls of the caching allocator"),
    "num_device_free": ("cuda_device_frees", "counter", "cudaFree calls of the allocator (each syncs)"),
    "num_ooms": ("cuda_ooms", "counter", "allocations that failed out of memory"),
    "reserved_bytes.all.current": ("cuda_reserved_bytes", "gauge", "GPU memory the caching allocator holds"),
    "allocated_bytes.all.current": ("cuda_allocated_bytes", "gauge", "GPU memory in live tensors"),
}


def allocator_metrics(memory_stats: Callable[[], dict] | None) -> Callable[[], dict]:
    """A snapshot function for ``services.common.metrics.register`` from ``memory_stats`` (the
    stage's ``lambda: torch.cuda.memory_stats(device)``; None off CUDA: an empty snapshot)."""
    if memory_stats is None:
        return dict

    def snapshot() -> dict:
        stats = memory_stats()
        return {name: (kind, text, stats.get(key, 0)) for key, (name, kind, text) in _STATS.items()}

    return snapshot
