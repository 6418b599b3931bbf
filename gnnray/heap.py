"""What a process hands back to the OS of the memory it freed.

glibc keeps freed memory for reuse: in its heaps, and after a large free it
raises its mmap threshold, so later blocks of that size come from the heap
too. A process that has loaded a graph and freed the loading copy keeps
hundreds of MB that way (0.54 GB of the driver's 1.07 GB at products size),
counted against the run until it exits.
"""

from __future__ import annotations


def trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``), so USS shows what is held, not cached."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
