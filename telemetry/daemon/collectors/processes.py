"""processes collector: resident memory of the serving processes (vLLM by default), by role, via psutil.

Bounded work per scrape: a process's command line is read when it is first seen and re-read, with
growing gaps (1, 2, 4, ... s), only during its first `recheck_seconds`, because vLLM renames its engine
and worker processes (setproctitle "VLLM::EngineCore", "VLLM::Worker_TP0") a few seconds after they
start. Afterwards only matched processes cost a read (their RSS). Bounded series: at most
`max_per_role` per role.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil
from prometheus_client.core import Metric

from telemetry.catalogue.metrics import PROCESS_RESIDENT, PROCESS_ROLE_PROCESSES, PROCESS_ROLE_RESIDENT
from telemetry.daemon.registry import register
from telemetry.daemon.settings import DEFAULT_ROLES, RolePattern

if TYPE_CHECKING:
    from telemetry.daemon.settings import DaemonConfig


@dataclass
class _Seen:
    first_seen: float
    role: str | None
    process: psutil.Process | None
    next_check: float = 0.0
    gap: float = 1.0


class ProcessCollector:
    def __init__(
        self, roles: tuple[RolePattern, ...] = DEFAULT_ROLES, *, max_per_role: int = 8, recheck_seconds: float = 60.0
    ) -> None:
        self.roles = roles
        self.max_per_role = max_per_role
        self.recheck_seconds = recheck_seconds
        self._seen: dict[int, _Seen] = {}

    def _match(self, pid: int) -> tuple[str | None, psutil.Process | None]:
        try:
            # Read directly: psutil.Process() also reads /proc/<pid>/stat, doubling the cost per process.
            with open(f"{psutil.PROCFS_PATH}/{pid}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode("utf-8", "replace").strip()
        except OSError:
            return None, None
        for pattern in self.roles:
            if command and pattern.cmdline.search(command):
                try:
                    return pattern.role, psutil.Process(pid)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    return None, None
        return None, None

    def collect(self) -> list[Metric]:
        now = time.monotonic()
        pids = psutil.pids()
        alive = set(pids)
        for pid in list(self._seen):
            if pid not in alive:
                del self._seen[pid]
        by_role: dict[str, list[tuple[int, int]]] = {pattern.role: [] for pattern in self.roles}
        for pid in pids:
            seen = self._seen.get(pid)
            if seen is None:
                role, process = self._match(pid)
                seen = self._seen[pid] = _Seen(now, role, process, next_check=now + 1.0)
            elif seen.role is None and now >= seen.next_check and now - seen.first_seen < self.recheck_seconds:
                seen.role, seen.process = self._match(pid)
                seen.gap *= 2
                seen.next_check = now + seen.gap
            if seen.role is None or seen.process is None:
                continue
            try:
                rss = seen.process.memory_info().rss
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            by_role[seen.role].append((rss, pid))

        resident = PROCESS_RESIDENT.new()
        role_resident = PROCESS_ROLE_RESIDENT.new()
        role_count = PROCESS_ROLE_PROCESSES.new()
        for role, members in by_role.items():
            members.sort(reverse=True)
            for rss, pid in members[: self.max_per_role]:
                resident.add_metric([role, str(pid)], rss)
            role_resident.add_metric([role], sum(rss for rss, _ in members))
            role_count.add_metric([role], len(members))
        return [resident, role_resident, role_count]


@register("processes", order=70, help="resident memory of the serving processes, by role (psutil)")
def build(config: DaemonConfig) -> ProcessCollector:
    psutil.PROCFS_PATH = str(config.proc_root)  # psutil reads processes from one global /proc path
    processes = config.processes
    return ProcessCollector(processes.roles, max_per_role=processes.max_per_role,
                            recheck_seconds=processes.recheck_seconds)
