"""/proc/cpuinfo, read without torch: the OpenMP wait policy depends on the CPU and is set before torch loads."""

from __future__ import annotations

from pathlib import Path


def cpuinfo(*keys: str) -> str:
    """The first line of /proc/cpuinfo that starts with one of ``keys`` ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line for line in lines if line.startswith(keys)), "")


def cpu_flags() -> set[str]:
    """The x86 feature flags /proc/cpuinfo names (empty elsewhere)."""
    return set(cpuinfo("flags").partition(":")[2].split())
