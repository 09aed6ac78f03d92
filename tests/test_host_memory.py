"""decoder/host_memory.py: huge-page host memory for the context arrays a GPU reads in place."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from decoder.host_memory import HUGE_PAGE, huge_mapping, pinned_copy, pinned_empty


def test_huge_mapping_is_aligned_zeroed_and_released_with_its_last_view():
    t, m = huge_mapping(3 * HUGE_PAGE + 100)
    assert t.dtype == torch.uint8 and t.numel() == 3 * HUGE_PAGE + 100
    assert t.data_ptr() % HUGE_PAGE == 0  # THP can back it from its first byte
    assert int(t.count_nonzero()) == 0
    t[-1] = 7  # writable to its last byte
    alive = weakref.ref(m)
    del m
    view = t[HUGE_PAGE:].view(torch.int16)
    del t
    gc.collect()
    assert alive() is not None  # a view keeps the mapping
    assert int(view[-1]) == 7 << 8
    del view
    gc.collect()
    assert alive() is None  # unmapped with the last tensor over it


def test_huge_mapping_refuses_more_than_the_host_has():
    with pytest.raises(MemoryError, match="available"):
        huge_mapping(1 << 60)


@pytest.mark.gpu
def test_gpu_pinned_empty_is_pinned_mapped_and_unregistered_when_released():
    from decoder import host_memory
    from decoder.backends.offload import mapped

    before = host_memory.registered_bytes
    src = torch.randn(8, 4096, 128, dtype=torch.bfloat16, device="cuda")  # 8 MiB: the huge-page path
    host = pinned_copy(src)
    assert host.is_pinned() and host.device.type == "cpu" and host.data_ptr() % HUGE_PAGE == 0
    assert host_memory.registered_bytes == before + src.numel() * 2
    view = mapped(host)
    rows = torch.tensor([0, 17, 4095], device="cuda")
    assert torch.equal(view.index_select(1, rows), src.index_select(1, rows))  # the GPU reads it in place
    assert torch.equal(host, src.cpu())
    del host, view
    gc.collect()
    assert host_memory.registered_bytes == before  # unregistered (then unmapped) with its last view
    small = pinned_empty((4, 4), torch.float32)  # below a huge page: torch's pinned allocator
    assert small.is_pinned()
