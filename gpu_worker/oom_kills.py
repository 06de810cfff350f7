"""The kernel's count of OOM kills in this process's memory cgroup (the ranks share it).

A rank the kernel kills for memory ends by SIGKILL like one an operator kills by hand; the
counter tells them apart: if it went up while the rank was alive, the kernel did it, and running
the same request again would only kill the group again. cgroup v2 keeps it in `memory.events`,
v1 in `memory.oom_control` (kernels since 4.13); both as a line `oom_kill <n>`.
"""

from __future__ import annotations

from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def oom_kill_count(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """The cgroup's `oom_kill` counter; None where no counter can be read."""
    for path in counter_files(root, proc_cgroup):
        count = _read_oom_kill(path)
        if count is not None:
            return count
    return None


def counter_files(root: Path, proc_cgroup: Path) -> list[Path]:
    """Where the counter may be, most specific first: this cgroup's own, then the root's."""
    candidates: list[Path] = []
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        controllers, relative = fields[1], fields[2].lstrip("/")
        if controllers == "":  # the v2 unified hierarchy: "0::/path"
            candidates.append(root / relative / "memory.events")
        elif "memory" in controllers.split(","):
            candidates.append(root / "memory" / relative / "memory.oom_control")
    # Inside a container the listed path may be the host's; the namespace root is then ours.
    candidates += [root / "memory.events", root / "memory" / "memory.oom_control"]
    return list(dict.fromkeys(candidates))


def _read_oom_kill(path: Path) -> int | None:
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == "oom_kill" and value.strip().isdigit():
            return int(value)
    return None
