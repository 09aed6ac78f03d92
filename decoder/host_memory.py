"""Pinned host memory for the context arrays a GPU reads in place (the `offload` backends).

torch's pinned allocator (`pin_memory=True`: cudaHostAlloc) page-locks 4 KiB pages one at a time:
measured on an H200 host, 64.4 GB in 41.8 s (1.5 GB/s; benchmarks/RESULTS.md, "Offload_v's reads"), so
pinning one 128K context's values for the 8B shape (8.6 GB) would hold up its first question by
~5.6 s. `pinned_empty` maps anonymous memory advised to use transparent huge pages (2 MiB, where
the kernel grants them: THP in "madvise" or "always" mode), faults it in, and registers it with
cudaHostRegister: the same 64.4 GB in 3.7 s. The GPU reads it as it reads torch's pinned memory
(the same `decoder.backends.offload.mapped` views; scattered reads measured equal). On a host with
several NUMA nodes the pages are bound to the GPU's node (the measured host has one).

The memory is returned to the system when the last tensor over it goes: the mapping unregisters
itself from CUDA first, then unmaps. Without CUDA (or below a huge page) it falls back to torch's
allocator; a registration that fails raises (as torch's allocator would).
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


class _Mapping(mmap.mmap):
    """An anonymous mapping that unregisters itself from CUDA before it is unmapped (`registered`:
    the address cudaHostRegister was given, None while nothing is registered)."""

    registered: int | None = None
    nbytes = 0

    def __del__(self):
        global registered_bytes
        if self.registered is not None:
            ptr, self.registered = self.registered, None
            registered_bytes -= self.nbytes
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:  # noqa: BLE001 - interpreter shutdown: the process's memory goes with it
                pass


#: bytes this process has registered through `pinned_empty` and not yet released
registered_bytes = 0


def _available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # not Linux: the mapping itself reports what does not fit


_MPOL_BIND = 2
_SYS_MBIND = {"x86_64": 237, "aarch64": 235}


def numa_node_of(device: torch.device | str | int | None = None) -> int | None:
    """The host NUMA node a CUDA device hangs off (from its PCI address in sysfs), or None where
    unknown or the host has one node."""
    try:
        props = torch.cuda.get_device_properties(torch.device("cuda", torch.cuda.current_device())
                                                 if device is None else device)
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            node = int(f.read())
    except (AttributeError, OSError, ValueError, RuntimeError, AssertionError):
        return None
    return node if node >= 0 else None


def _bind(addr: int, nbytes: int, node: int) -> bool:
    """mbind(2) [addr, addr + nbytes) to `node` before it is faulted in; False where it cannot."""
    import ctypes
    import platform

    nr = _SYS_MBIND.get(platform.machine())
    if nr is None or node >= 64:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    mask = ctypes.c_ulong(1 << node)
    rc = libc.syscall(ctypes.c_long(nr), ctypes.c_void_p(addr), ctypes.c_ulong(nbytes), ctypes.c_int(_MPOL_BIND),
                      ctypes.byref(mask), ctypes.c_ulong(64), ctypes.c_uint(0))
    return rc == 0


def huge_mapping(nbytes: int, node: int | None = None) -> tuple[torch.Tensor, _Mapping]:
    """(uint8 tensor of nbytes, its mapping): zeroed anonymous memory starting on a huge-page
    boundary, advised MADV_HUGEPAGE (a no-op where THP is off) and faulted in. The tensor keeps the
    mapping alive; it is unmapped when no tensor over it is left. `node`: bind the pages to that
    NUMA node (best effort: where mbind fails they go where the kernel puts them). Raises MemoryError (instead of
    faulting pages in until the OOM killer stops the process) when the host has not that much
    memory available."""
    if nbytes > _available_bytes():
        raise MemoryError(f"{nbytes} bytes of host memory asked, {_available_bytes()} available")
    m = _Mapping(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out: 4 KiB pages, still correct
            pass
    raw = torch.frombuffer(m, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    t = raw[off:off + nbytes]
    if node is not None:
        _bind(t.data_ptr(), nbytes, node)
    t.zero_()  # fault every page in now (huge where granted), before registration locks them
    return t, m


def pinned_empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor that CUDA maps (module docstring). Needs CUDA."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not torch.cuda.is_available():
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    torch.cuda.init()
    t, m = huge_mapping(nbytes, numa_node_of())  # on a multi-socket host: the pages next to the GPU
    rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 1 | 2))  # portable | mapped
    if rc != 0:  # what would make torch's allocator fail too (the memlock limit, no memory)
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {rc}")
    global registered_bytes
    m.registered, m.nbytes = t.data_ptr(), nbytes
    registered_bytes += nbytes
    return t.view(dtype).view(shape)


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """`t` copied into `pinned_empty` memory."""
    return pinned_empty(t.shape, t.dtype).copy_(t)


__all__ = ["HUGE_PAGE", "huge_mapping", "pinned_copy", "pinned_empty"]
