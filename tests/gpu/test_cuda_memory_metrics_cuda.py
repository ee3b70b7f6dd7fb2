"""The CUDA allocator's counters as a stage's metrics, on a CUDA GPU: a cudaMalloc of a new size is
counted, an allocation that must free the cache to fit is counted as a retry. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

from services.common.cuda_memory import allocator_metrics


def test_the_allocators_mallocs_and_frees_are_counted():
    device = torch.device("cuda")
    snapshot = allocator_metrics(lambda: torch.cuda.memory_stats(device))
    before = {name: value for name, (_, _, value) in snapshot().items()}
    block = torch.empty(3 << 30, dtype=torch.uint8, device=device)  # a new 3 GiB segment: a cudaMalloc
    del block
    torch.cuda.empty_cache()  # its segment returned: a cudaFree
    after = {name: value for name, (_, _, value) in snapshot().items()}
    assert after["cuda_device_allocs"] >= before["cuda_device_allocs"] + 1
    assert after["cuda_device_frees"] >= before["cuda_device_frees"] + 1
    kinds = {name: kind for name, (kind, _, _) in snapshot().items()}
    assert kinds["cuda_alloc_retries"] == "counter" and kinds["cuda_reserved_bytes"] == "gauge"
