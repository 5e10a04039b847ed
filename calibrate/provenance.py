"""Where and when a measurement was made: the date, lowbit's commit, the CPU and the GPU.

results.json records it (`measured`), and so do the bench scripts' JSON files; bench/results_tables.py
shows it beside each figure. Each field is given only where it can be found out, never guessed: the
commit only from a git checkout of lowbit itself (an installed package has none).
"""
from __future__ import annotations

import datetime
import os
import platform
import subprocess
from pathlib import Path

SOURCE = Path(__file__).resolve().parent.parent  # the checkout's root in a development install


def provenance() -> dict:
    """Date, commit, CPU and GPU of this run, each only where it can be found out (never guessed)."""
    found = {"date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(), "commit": git_commit(),
             "cpu": cpu_description(), "gpu": gpu_names()}
    return {key: value for key, value in found.items() if value}


def git_commit() -> str | None:
    """HEAD's short hash, marked when the working tree differs from it (a measurement of uncommitted code)."""
    def git(*args):
        env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read only: never touch the index
        return subprocess.run(["git", *args], cwd=SOURCE, env=env, capture_output=True, text=True, timeout=30)

    if not (SOURCE / ".git").exists():  # an installed wheel (its folder may sit in another project's repository)
        return None
    try:
        head = git("rev-parse", "--short", "HEAD")
        if head.returncode != 0:
            return None
        changed = git("diff", "--quiet", "HEAD", "--").returncode != 0
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + (" with uncommitted changes" if changed else "")


def cpu_description() -> str:
    """'<model>, <n> cores, <memory> GiB': what decides a CPU figure."""
    parts = [cpu_model(), f"{usable_cores()} cores"]
    memory = total_memory_gib()
    if memory:
        parts.append(f"{memory:.0f} GiB")
    return ", ".join(parts)


def usable_cores() -> int:
    """The cores this process may run on (a container's or taskset's share), not the host's count."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def total_memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        return None
    return None


def gpu_names() -> str | None:
    """nvidia-smi's names, without importing torch or starting CUDA in the recording process."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return ", ".join(names) if done.returncode == 0 and names else None
