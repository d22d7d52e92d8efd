"""File pages of mapped weights: find the tensors a checkpoint's mapping serves, and take
their pages out of this process's resident memory once packed or quantised copies replace
them (Linux's ``/proc/self/maps`` and ``madvise``; elsewhere nothing is found or released).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from pathlib import Path


def file_mappings() -> list[tuple[int, int]]:
    """The address ranges ``[start, end)`` this process has mapped from files."""
    ranges = []
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return ranges
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[4] != "0":  # an inode: backed by a file
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def file_backed(tensors, mappings: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(address, bytes)`` of each of ``tensors`` whose memory lies in one of ``mappings``
    (:func:`file_mappings`): weights a checkpoint's mapping serves."""
    found = []
    for tensor in tensors:
        address, size = tensor.data_ptr(), tensor.nbytes
        if any(start <= address and address + size <= end for start, end in mappings):
            found.append((address, size))
    return found


def release_file_pages(ranges) -> None:
    """Take the whole pages of ``ranges`` (:func:`file_backed`) out of this process's resident
    memory once nothing reads them any more (a weight replaced by its packed or quantised
    copy). They are the file's: read again, they would come back from it, so this is safe
    while the mapping lasts; call it while something still holds the tensors. Where the kernel
    refuses, the pages stay resident (more memory, nothing wrong) and a warning says so."""
    if not ranges or not hasattr(mmap, "MADV_DONTNEED"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    for address, size in ranges:
        first = -(-address // page) * page
        last = (address + size) // page * page
        if last <= first:
            continue
        length = last - first
        if libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(length), mmap.MADV_DONTNEED):
            reason = os.strerror(ctypes.get_errno())
            warnings.warn(
                f"could not release {length} bytes of mapped weights at {first:#x} ({reason}): "
                "they stay in memory",
                RuntimeWarning,
                stacklevel=2,
            )
