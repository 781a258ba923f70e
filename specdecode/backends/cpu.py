"""What the CPU offers this process: the one place the backends and the CLI count its cores."""

from __future__ import annotations

import os


def default_threads() -> int:
    """The machine's cores available to this process (its affinity mask, as llama.cpp's default)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)
