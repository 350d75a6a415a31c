"""Every metric family memtel exports, one entry each: the hook's exporter, the live forecast, the node
daemon (its collectors, its health, its flight recorder), the exporters' own HTTP health and the lab server.

Collectors build their families from these entries (`FAMILY.new(...)`), so a name, a type, a label or a
help text is written here once. tests/test_catalogue.py fails when a collector produces a family that is
not here (or differs from its entry), and when the docs, a rule, a dashboard or a golden file names a
series that no entry (or recording rule) produces. How to add one: docs/architecture.md, "Metric names".
"""

from __future__ import annotations

from telemetry import hook_env
from telemetry.catalogue.family import CounterFamily, Family, GaugeFamily, counter, gauge, histogram

# -- the hook (telemetry/hook/collector.py): labels site, rank, node -----------------------------------------
_SITE = ("site", "rank", "node")
ALLOCATOR_RESERVED = gauge("memtel_allocator_reserved_bytes",
                           "Bytes reserved by the caching allocator after the site's last hooked call.", _SITE,
                           source="hook")
ALLOCATOR_ALLOCATED = gauge("memtel_allocator_allocated_bytes",
                            "Bytes allocated to tensors after the site's last hooked call.", _SITE, source="hook")
ALLOCATOR_DEVICE_ALLOC = counter(
    "memtel_allocator_device_alloc",
    "The allocator's num_device_alloc after the site's last hooked call: device allocations (segments mapped) "
    "so far.", _SITE, source="hook")
ALLOCATOR_DEVICE_FREE = counter(
    "memtel_allocator_device_free",
    "The allocator's num_device_free after the site's last hooked call: device frees (segments released) so far.",
    _SITE, source="hook")
ALLOCATOR_ALLOC_RETRIES = counter(
    "memtel_allocator_alloc_retries",
    "The allocator's num_alloc_retries: allocations retried after freeing the cache.", _SITE, source="hook")
ALLOCATOR_OOMS = counter("memtel_allocator_ooms",
                         "The allocator's num_ooms: out-of-memory errors raised by the allocator.", _SITE,
                         source="hook")
HOOK_HOST_MEM_AVAILABLE = gauge("memtel_hook_host_mem_available_bytes",
                                "Host MemAvailable after the site's last hooked call.", _SITE, source="hook")
HOOK_HOST_SWAP_FREE = gauge("memtel_hook_host_swap_free_bytes", "Host SwapFree after the site's last hooked call.",
                            _SITE, source="hook")
HOOK_CALLS = counter("memtel_hook_calls", "Hooked calls recorded.", _SITE, source="hook")
# The growth-event definition, used word for word in docs/hook.md and docs/architecture.md.
HOOK_GROWTH_EVENTS = counter(
    "memtel_hook_growth_events",
    "Hooked calls of this site after which the allocator's num_device_alloc was higher than after the previous "
    "hooked call of any target in this process (or than at install, for the first).", _SITE, source="hook")
HOOK_RESERVED_DELTA = histogram(
    "memtel_hook_reserved_delta_bytes",
    "Per-call growth of the allocator's reserved bytes since the previous hooked call of any target in this "
    "process (a decrease counts as 0).", _SITE, source="hook")
HOOK_ERRORS = counter("memtel_hook_errors", "Errors inside the hook, caught and counted, never raised.",
                      ("site", "stage", "rank", "node"), source="hook")
HOOK_INSTALL_FAILURES = counter("memtel_hook_install_failures", "Hook targets that could not be installed.",
                                ("target", "reason", "rank", "node"), source="hook")
HOOK_UNRESOLVED_TARGETS = gauge(
    "memtel_hook_unresolved_targets",
    "1 for a configured hook target that is not resolved: not installed (its module was never imported, or it "
    "does not exist) or, by its preset, in none of the loaded model's layers; 0 once installed. Present after the "
    "model loaded (or the unresolved timer ran out).", ("target", "rank", "node"), source="hook")
HOOK_ALLOCATOR_READER_INFO = gauge(
    "memtel_hook_allocator_reader_info",
    "1 for the way the hook reads the allocator: torch._C._cuda_memoryStats (the fast private binding), "
    "torch.cuda.memory_stats (the public fallback where torch lacks the binding) or allocator_source "
    "(set_allocator_source).", ("reader", "rank", "node"), source="hook")
HOOK_LOG_DROPPED_RECORDS = counter(
    "memtel_hook_log_dropped_records",
    "Per-call log records that never reached the file: queue_full (the writer fell behind) or write_failed (a "
    "full disk, an I/O error).", ("reason", "rank", "node"), source="hook")

# -- the engine's memory (telemetry/hook/engine.py): labels rank, node, pid; read at scrape time -------------------
_ENGINE = ("rank", "node", "pid")
ENGINE_WEIGHTS = gauge("memtel_engine_weights_bytes",
                       "Bytes of the engine's model parameters (distinct storages), read from the model when it "
                       "loaded.", _ENGINE, source="engine")
ENGINE_KV_CACHE = gauge("memtel_engine_kv_cache_bytes",
                        "Bytes of the engine's KV cache tensors (distinct storages), read from the worker once "
                        "allocated.", _ENGINE, source="engine")
ENGINE_CUDA_GRAPH_POOL = gauge(
    "memtel_engine_cuda_graph_pool_bytes",
    "Bytes the caching allocator holds in private pools (CUDA graphs) other than the KV cache's and the weights', "
    "read after warm-up.", _ENGINE, source="engine")
ENGINE_ALLOCATOR_RESERVED = gauge(
    "memtel_engine_allocator_reserved_at_scrape_bytes",
    "The caching allocator's reserved bytes at scrape time (memtel_allocator_reserved_bytes is after the last hooked "
    "call).", _ENGINE, source="engine")
ENGINE_ALLOCATOR_ALLOCATED = gauge("memtel_engine_allocator_allocated_at_scrape_bytes",
                                   "The caching allocator's allocated bytes at scrape time.", _ENGINE, source="engine")
ENGINE_DEVICE_USED = gauge(
    "memtel_engine_device_used_bytes",
    "Used bytes of this process's CUDA device at scrape time (cudaMemGetInfo: every process on the device).",
    _ENGINE, source="engine")
ENGINE_DEVICE_TOTAL = gauge("memtel_engine_device_total_bytes",
                            "Total bytes of this process's CUDA device (cudaMemGetInfo).", _ENGINE, source="engine")
ENGINE_RESIDENT = gauge("memtel_engine_resident_bytes",
                        "Resident set size of this process at scrape time (/proc/self/statm).", _ENGINE,
                        source="engine")
ENGINE_START_REMAINING = gauge(
    "memtel_engine_start_remaining_bytes",
    "While the engine starts (model loaded, warm-up not returned): what its start will still take, its own budget "
    "(vLLM's requested memory) less what it holds now; absent once it serves.", _ENGINE, source="engine")

# -- the live forecast (telemetry/hook/forecast/collector.py): labels rank, node (no site) ---------------------
FORECAST_RESERVED_GROWTH = gauge(
    "memtel_forecast_reserved_growth_bytes",
    "Bytes the caching allocator would add to its reserved bytes during the next prefill of `tokens` tokens, "
    "forecast by simulating the allocator from its live state (what stays reserved after the prefill).",
    ("tokens", "rank", "node"), source="forecast")
FORECAST_PEAK_RESERVED = gauge(
    "memtel_forecast_peak_reserved_bytes",
    "The allocator's highest reserved bytes during the next prefill of `tokens` tokens, forecast from its live "
    "state (absolute, as memtel_allocator_reserved_bytes counts).", ("tokens", "rank", "node"), source="forecast")
FORECAST_DEVICE_ALLOC = gauge(
    "memtel_forecast_device_alloc",
    "Device allocs (num_device_alloc: cudaMalloc calls, or map calls under expandable segments) the allocator "
    "would make during the next prefill of `tokens` tokens, forecast from its live state.",
    ("tokens", "rank", "node"), source="forecast")
# Labels: the workload's info labels (telemetry.hook.forecast.workload.ForecastWorkload.info_labels), rank, node.
FORECAST_WORKLOAD_INFO = gauge(
    "memtel_forecast_workload_info",
    "1 for the indexer workload the live forecast simulates; `source`: vllm (read from vLLM's config), program "
    f"(set_forecast_workload), config ({hook_env.FORECAST_SHAPE}) or reference (the reference workload).",
    ("source", "mode", "layers", "chunk", "compress_ratio", "max_model_len", "logits_budget_bytes", "padded_width",
     "topk", "rank", "node"), source="forecast")
FORECAST_MAX_PREFILL_TOKENS = gauge(
    "memtel_forecast_max_prefill_tokens",
    "The longest cold prefill (in tokens, up to the engine's max-model-len) that, with every shorter one, keeps this "
    "rank's simulated peak reserved within its allocated bytes plus memtel_forecast_fit_budget_bytes.",
    ("rank", "node"), source="forecast")
FORECAST_MAX_PREFILL_TOKENS_AT_BEST = gauge(
    "memtel_forecast_max_prefill_tokens_at_best",
    "The longest cold prefill (in tokens, up to the engine's max-model-len) that, with every shorter one, would "
    "keep this rank's simulated peak reserved within the same limit as memtel_forecast_max_prefill_tokens if its "
    "allocator first released every cached segment that holds no live block (what torch.cuda.empty_cache() "
    "releases; live blocks, the KV cache and the weights included, stay); never below "
    "memtel_forecast_max_prefill_tokens.",
    ("rank", "node"), source="forecast")
FORECAST_FIT_BUDGET = gauge(
    "memtel_forecast_fit_budget_bytes",
    "Memory this rank may still take beyond its live bytes: on unified memory its share of the node's headroom, "
    "on a discrete GPU the device's free memory less the driver's slack, either less "
    f"{hook_env.GUARD_RESERVE_MB}, plus what its allocator holds free.",
    ("rank", "node"), source="forecast")
FORECAST_LAST_DURATION = gauge(
    "memtel_forecast_last_duration_seconds",
    "Wall time of the live forecast's last cycle: the allocator snapshot, reading it and simulating every prefill "
    "length (only the snapshot when nothing changed since the cycle before).", ("rank", "node"), source="forecast")
FORECAST_LAST_SUCCESS = gauge(
    "memtel_forecast_last_success_timestamp_seconds",
    "Unix time of the allocator snapshot that the live forecast's last successful cycle started from: the "
    "forecast is the allocator's as of then.", ("rank", "node"), source="forecast")
FORECAST_CPU = counter(
    "memtel_forecast_cpu_seconds",
    "CPU time the live forecast's cycles have taken in this process (the cost of its thread).", ("rank", "node"),
    source="forecast")
FORECAST_HELPER_CPU = counter(
    "memtel_forecast_helper_cpu_seconds",
    "CPU time the live forecast's helper process has spent simulating for this process (off the serving "
    "process).", ("rank", "node"), source="forecast")
FORECAST_SNAPSHOT_READER_INFO = gauge(
    "memtel_forecast_snapshot_reader_info",
    "1 for the way the live forecast took its last allocator snapshot: native (memtel's extension, without holding "
    "the GIL), memory_snapshot (torch.cuda.memory_snapshot(): where the extension is off, the log says why) or "
    "allocator_source (set_allocator_source).", ("reader", "rank", "node"), source="forecast")
FORECAST_SNAPSHOT_RESYNCS = counter(
    "memtel_forecast_snapshot_resyncs",
    "Full allocator snapshots the live forecast took to (re)start its event shadow, by reason: start (the first, "
    "or a new helper), mismatch (a replayed allocation or segment call differed from the allocator's), pool (an "
    "event of a private pool), stream (an event on another stream), oom (the allocator ran out of memory), "
    "overflow (the event log dropped events), no_marker, lost (events not replayed), state (a snapshot the shadow "
    "cannot start from).", ("reason", "rank", "node"), source="forecast")
FORECAST_FAILURES = counter(
    "memtel_forecast_failures",
    "Live forecast cycles that failed, by reason: snapshot (taking or reading the allocator snapshot), "
    "unsupported_state (the snapshot holds what the simulator does not model), settings (allocator settings it "
    "cannot simulate), simulation (any other error, or the helper process failing), budget (the fit budget could "
    "not be read), unavailable (the forecast cannot run in this process: no CUDA device).",
    ("reason", "rank", "node"), source="forecast")

# -- the node daemon's health (telemetry/daemon/registry.py) ---------------------------------------------------
COLLECTOR_SUCCESS = gauge("memtel_collector_success", "1 if the collector succeeded during this scrape, else 0.",
                          ("collector",), source="daemon")
COLLECTOR_DURATION = gauge("memtel_collector_duration_seconds", "Time the collector took during this scrape.",
                           ("collector",), source="daemon")
COLLECTOR_FAILURES = counter("memtel_collector_failures", "Failed collections since the daemon started.",
                             ("collector",), source="daemon")
EXPORTER_BUILD_INFO = gauge("memtel_exporter_build_info",
                            "memtel version and Python version of the daemon (always 1).", ("version", "python"),
                            source="daemon")
EXPORTER_START_TIME = gauge("memtel_exporter_start_time_seconds", "Unix time the daemon started.", source="daemon")
EXPORTER_SCRAPES = counter("memtel_exporter_scrapes", "Scrapes of /metrics served since the daemon started.",
                           source="daemon")

# -- the exporter's HTTP health (telemetry/exporter/metrics.py) ------------------------------------------------
HTTP_CONNECTIONS_OPEN = gauge("memtel_exporter_http_connections_open", "HTTP connections open on this exporter now.",
                              source="exporter")
HTTP_CONNECTIONS_MAX = gauge(
    "memtel_exporter_http_connections_max",
    "Most HTTP connections this exporter keeps open at once (the idlest is closed past it).", source="exporter")
HTTP_CONNECTIONS_CLOSED = counter(
    "memtel_exporter_http_connections_closed",
    "HTTP connections the exporter closed before an answer, by reason: evicted (to stay under the connection "
    "bound), idle_timeout, request_timeout, tls_failed.", ("reason",), source="exporter")
HTTP_UNAUTHORIZED = counter("memtel_exporter_http_unauthorized_requests",
                            "HTTP requests refused for missing or wrong basic-auth credentials.", source="exporter")

# -- meminfo (telemetry/daemon/collectors/meminfo.py) ----------------------------------------------------------
MEM_TOTAL = gauge("memtel_node_mem_total_bytes", "Total usable memory (MemTotal).", source="meminfo")
MEM_AVAILABLE = gauge(
    "memtel_node_mem_available_bytes",
    "Memory available for new work without swapping (MemAvailable); GPU memory comes out of it on unified memory.",
    source="meminfo")
MEM_FREE = gauge("memtel_node_mem_free_bytes", "Unused memory (MemFree).", source="meminfo")
MEM_CACHED = gauge("memtel_node_mem_cached_bytes", "Page cache (Cached).", source="meminfo")
MEM_BUFFERS = gauge("memtel_node_mem_buffers_bytes", "Block device buffers (Buffers).", source="meminfo")
MEM_SHMEM = gauge("memtel_node_mem_shmem_bytes", "Shared memory and tmpfs (Shmem).", source="meminfo")
MEM_ACTIVE_FILE = gauge("memtel_node_mem_active_file_bytes", "File pages on the active LRU list (Active(file)).",
                        source="meminfo")
MEM_INACTIVE_FILE = gauge("memtel_node_mem_inactive_file_bytes", "File pages on the inactive LRU list "
                          "(Inactive(file)).", source="meminfo")
SWAP_TOTAL = gauge("memtel_node_swap_total_bytes", "Total swap space (SwapTotal).", source="meminfo")
SWAP_FREE = gauge("memtel_node_swap_free_bytes", "Unused swap space (SwapFree).", source="meminfo")
HUGEPAGES_CONFIGURED = gauge(
    "memtel_node_hugepages_configured_pages",
    "Persistent huge pages of the default size set aside (HugePages_Total); not part of MemAvailable.",
    source="meminfo")
HUGEPAGES_FREE = gauge("memtel_node_hugepages_free_pages", "Huge pages not yet allocated (HugePages_Free).",
                       source="meminfo")
HUGEPAGES_RESERVED = gauge("memtel_node_hugepages_reserved_pages",
                           "Huge pages promised to mappings but not yet faulted in (HugePages_Rsvd).", source="meminfo")
HUGEPAGES_SURPLUS = gauge("memtel_node_hugepages_surplus_pages", "Surplus huge pages (HugePages_Surp).",
                          source="meminfo")
HUGEPAGE_SIZE = gauge("memtel_node_hugepage_size_bytes", "Default huge page size (Hugepagesize).", source="meminfo")
HUGETLB = gauge("memtel_node_hugetlb_bytes", "Memory held by huge pages of all sizes (Hugetlb).", source="meminfo")
SWAP_USED = gauge("memtel_node_swap_used_bytes", "Swap space in use (SwapTotal - SwapFree).", source="meminfo")
MEM_UNACCOUNTED = gauge(
    "memtel_node_mem_unaccounted_bytes",
    "Memory no /proc/meminfo field accounts for: MemTotal minus free, LRU, slab and other kernel fields "
    "(docs/metrics.md); on unified memory mostly what GPU drivers hold. Not clamped at 0.", source="meminfo")
# (family, /proc/meminfo field) in the order the collector exports them; a field the kernel lacks leaves it out.
MEMINFO_FIELDS = (
    (MEM_TOTAL, "MemTotal"), (MEM_AVAILABLE, "MemAvailable"), (MEM_FREE, "MemFree"), (MEM_CACHED, "Cached"),
    (MEM_BUFFERS, "Buffers"), (MEM_SHMEM, "Shmem"), (MEM_ACTIVE_FILE, "Active(file)"),
    (MEM_INACTIVE_FILE, "Inactive(file)"), (SWAP_TOTAL, "SwapTotal"), (SWAP_FREE, "SwapFree"),
    (HUGEPAGES_CONFIGURED, "HugePages_Total"), (HUGEPAGES_FREE, "HugePages_Free"),
    (HUGEPAGES_RESERVED, "HugePages_Rsvd"), (HUGEPAGES_SURPLUS, "HugePages_Surp"), (HUGEPAGE_SIZE, "Hugepagesize"),
    (HUGETLB, "Hugetlb"),
)

# -- vmstat (telemetry/daemon/collectors/vmstat.py): (family, /proc/vmstat field) ------------------------------
VMSTAT_FIELDS = tuple(
    (counter(f"memtel_node_vmstat_{field}", help_text, source="vmstat"), field)
    for field, help_text in (
        ("pswpin", "Pages swapped in since boot (pswpin)."),
        ("pswpout", "Pages swapped out since boot (pswpout)."),
        ("oom_kill", "Processes killed by the kernel OOM killer since boot (oom_kill)."),
        ("pgmajfault", "Major page faults since boot (pgmajfault)."),
        # Direct compaction: an allocation that found no free block of its order compacted memory itself.
        ("compact_stall", "Direct compactions run by allocations since boot (compact_stall)."),
        ("compact_success", "Direct compactions that produced the block asked for, since boot (compact_success)."),
        ("compact_fail", "Direct compactions that did not produce the block asked for, since boot (compact_fail)."),
        ("thp_fault_alloc", "Transparent huge pages allocated on a page fault since boot (thp_fault_alloc)."),
        ("thp_fault_fallback", "Page faults that wanted a transparent huge page and fell back to small pages, "
                               "since boot (thp_fault_fallback)."),
    )
)

# -- pressure (telemetry/daemon/collectors/pressure.py): by PSI line ------------------------------------------
PRESSURE_KINDS = (
    (counter("memtel_node_pressure_memory_some_seconds",
             "Time in which at least one task was stalled on memory (PSI some total).", source="pressure"), "some"),
    (counter("memtel_node_pressure_memory_full_seconds",
             "Time in which all non-idle tasks were stalled on memory at once (PSI full total).", source="pressure"),
     "full"),
)

# -- buddyinfo (telemetry/daemon/collectors/buddyinfo.py) ------------------------------------------------------
MEM_FREE_CONTIGUOUS = gauge(
    "memtel_node_mem_free_contiguous_bytes",
    "Free memory in blocks of at least 2 MiB (/proc/buddyinfo, summed over nodes and zones).", source="buddyinfo")
MEM_FREE_BUDDY = gauge(
    "memtel_node_mem_free_buddy_bytes",
    "Free memory on the page allocator's free lists, every order (/proc/buddyinfo); a little below MemFree, which "
    "also counts per-CPU lists.", source="buddyinfo")
MEM_FREE_BLOCKS = gauge("memtel_node_mem_free_blocks",
                        "Free blocks of 2^order pages (/proc/buddyinfo, summed over nodes and zones).", ("order",),
                        source="buddyinfo")
PAGE_SIZE = gauge("memtel_node_page_size_bytes", "The kernel's page size (order 0 block size).", source="buddyinfo")

# -- headroom (telemetry/daemon/collectors/headroom.py) --------------------------------------------------------
# The definitions are in telemetry/procfs/headroom.py and docs/metrics.md ("Unified-memory headroom").
UNIFIED_HEADROOM = gauge(
    "memtel_node_unified_headroom_bytes",
    "Memory a GPU on unified memory could still get: min(MemAvailable, free memory in blocks of at least 2 MiB "
    "plus the rest of MemAvailable times the share of recent huge-page faults that got a huge page).",
    source="headroom")
UNIFIED_HEADROOM_WITHOUT_RECLAIM = gauge(
    "memtel_node_unified_headroom_without_reclaim_bytes",
    "Memory a large-page allocation gets now, without reclaim or compaction: min(MemAvailable, free memory in "
    "blocks of at least 2 MiB) (how memtel defined the headroom before it counted huge-page fault success).",
    source="headroom")
HUGE_PAGE_FAULT_SUCCESS_RATIO = gauge(
    "memtel_node_huge_page_fault_success_ratio",
    "Share of the transparent-huge-page faults of the last 300 s that got a huge page (/proc/vmstat "
    "thp_fault_alloc / (thp_fault_alloc + thp_fault_fallback)); absent with fewer than 8, or where faults fall "
    "back without compacting (THP always with defrag other than always).", source="headroom")

# -- protect (telemetry/daemon/protect.py): the evidence-gated last resort ----------------------------------
PROTECT_DECISIONS = counter(
    "memtel_protect_decisions",
    "Decisions of the daemon's protect action, by decision: acted, would_act (dry run) or failed (the action "
    "could not be done).", ("decision",), source="protect")
PROTECT_DRY_RUN = gauge("memtel_protect_dry_run", "1 if the protect action only logs what it would do (dry_run).",
                        source="protect")
PROTECT_EPISODE_ACTIVE = gauge(
    "memtel_protect_episode_active",
    "1 while a falling-headroom episode lasts (the action runs once per episode), else 0.", source="protect")
PROTECT_LAST_DECISION_TIMESTAMP = gauge("memtel_protect_last_decision_timestamp_seconds",
                                        "Unix time of the protect action's last decision.", source="protect")
PROTECT_LAST_HEADROOM = gauge("memtel_protect_last_decision_headroom_bytes",
                              "The headroom when the protect action last decided.", source="protect")
PROTECT_LAST_SLOPE = gauge("memtel_protect_last_decision_slope_bytes_per_second",
                           "The headroom's fitted slope over 8 s when the protect action last decided.",
                           source="protect")
PROTECT_LAST_DROP = gauge("memtel_protect_last_decision_drop_bytes",
                          "How far the headroom fell within 8 s when the protect action last decided.",
                          source="protect")

# -- nvml (telemetry/daemon/collectors/nvml.py) ----------------------------------------------------------------
_GPU = ("gpu", "uuid")
GPU_NVML_AVAILABLE = gauge("memtel_gpu_nvml_available", "1 if the NVML library loaded and initialised, else 0.",
                           source="nvml")
GPU_INFO = gauge("memtel_gpu_info", "One series per GPU (always 1).", ("gpu", "uuid", "name", "driver_version"),
                 source="nvml")
GPU_UNIFIED_MEMORY = gauge(
    "memtel_gpu_unified_memory",
    "1 when NVML does not report device memory (NOT_SUPPORTED: unified memory, GPU memory is host memory).", _GPU,
    source="nvml")
GPU_MEMORY_USED = gauge("memtel_gpu_memory_used_bytes", "Device memory used.", _GPU, source="nvml")
GPU_MEMORY_TOTAL = gauge("memtel_gpu_memory_total_bytes", "Device memory total.", _GPU, source="nvml")
GPU_PROCESS_MEMORY_USED = gauge("memtel_gpu_process_memory_used_bytes",
                                "GPU memory used by one process (NVML running processes).",
                                ("gpu", "uuid", "pid", "process"), source="nvml")
GPU_PROCESSES = gauge("memtel_gpu_processes", "Processes NVML lists on this GPU.", _GPU, source="nvml")
GPU_POWER = gauge("memtel_gpu_power_watts", "GPU power draw (NVML power usage); absent where NVML cannot say.", _GPU,
                  source="nvml")

# -- processes (telemetry/daemon/collectors/processes.py) ------------------------------------------------------
PROCESS_RESIDENT = gauge("memtel_process_resident_bytes", "Resident set size of a matched serving process.",
                         ("role", "pid"), source="processes")
PROCESS_ROLE_RESIDENT = gauge("memtel_process_role_resident_bytes",
                              "Resident set size of all processes of the role.", ("role",), source="processes")
PROCESS_ROLE_PROCESSES = gauge("memtel_process_role_processes", "Number of running processes matched to the role.",
                               ("role",), source="processes")


# -- kmsg (telemetry/daemon/collectors/kmsg.py): three families per kind of kernel line ------------------------
def _kernel_kind(lines: str, events: str, seen: str, what: str, label: str | None = None,
                 events_help: str | None = None) -> tuple[CounterFamily, CounterFamily, GaugeFamily]:
    labels = (label,) if label else ()
    return (
        counter(lines, f"Kernel log: {what}.", labels, source="kmsg"),
        counter(events, events_help or f"Kernel log: bursts of {what} (lines within the burst window count once).",
                labels, source="kmsg"),
        gauge(seen, f"Unix time of the last of the {what}.", labels, source="kmsg"),
    )


KERNEL_NV_ERR_NO_MEMORY = _kernel_kind(
    "memtel_kernel_nv_err_no_memory", "memtel_kernel_nv_err_no_memory_events",
    "memtel_kernel_nv_err_no_memory_last_seen_timestamp_seconds", "NVIDIA driver lines reporting NV_ERR_NO_MEMORY")
KERNEL_NVRM_ERRORS = _kernel_kind(
    "memtel_kernel_nvrm_errors", "memtel_kernel_nvrm_error_events",
    "memtel_kernel_nvrm_error_last_seen_timestamp_seconds",
    "NVRM (NVIDIA driver) error lines")
KERNEL_OOM_KILLS = _kernel_kind(
    "memtel_kernel_oom_kills", "memtel_kernel_oom_kill_events", "memtel_kernel_oom_kill_last_seen_timestamp_seconds",
    "kernel OOM-killer kill lines")
KERNEL_XID = _kernel_kind(
    "memtel_kernel_xid", "memtel_kernel_xid_events", "memtel_kernel_xid_last_seen_timestamp_seconds",
    "NVRM Xid lines, by Xid code", "xid", events_help="Kernel log: bursts of NVRM Xid lines, by Xid code.")
KERNEL_PATTERN = _kernel_kind(
    "memtel_kernel_pattern_matches", "memtel_kernel_pattern_events",
    "memtel_kernel_pattern_last_seen_timestamp_seconds",
    "kernel log lines matching the user pattern", "pattern",
    events_help="Kernel log: bursts of kernel log lines matching the user pattern.")
KMSG_RECORDS = counter("memtel_kernel_kmsg_records", "Kernel log records read and classified this boot.",
                       source="kmsg")
KMSG_MISSED_RECORDS = counter(
    "memtel_kernel_kmsg_missed_records",
    "Kernel log records lost before they were read (ring-buffer overruns, sequence gaps).", source="kmsg")
KMSG_STATE_WRITE_FAILURES = counter(
    "memtel_kernel_kmsg_state_write_failures",
    "Failed writes of the kmsg state file (the last good state is kept; kept across restarts).", source="kmsg")
KMSG_IGNORED_TEST_LINES = counter(
    "memtel_kernel_kmsg_ignored_test_lines",
    "Kernel log lines written by memtel's own test suite (they start with 'memtel-test:'), read this boot and "
    "counted nowhere else (kmsg.ignore_test_lines).", source="kmsg")

# -- the flight recorder (telemetry/flight/recorder.py), collector `flight` ------------------------------------
FLIGHT_RECORDING = gauge("memtel_flight_recording",
                         "1 if the flight recorder's last record was written and made durable, else 0.",
                         source="flight")
FLIGHT_RECORDS_WRITTEN = counter("memtel_flight_records_written", "Records written to the flight ring since start.",
                                 source="flight")
FLIGHT_WRITE_FAILURES = counter("memtel_flight_write_failures",
                                "Failed attempts to create or write the flight ring since start.", source="flight")
FLIGHT_LAST_RECORD_TIME = gauge("memtel_flight_last_record_timestamp_seconds", "Unix time of the last record written.",
                                source="flight")
FLIGHT_LAST_WRITE_DURATION = gauge("memtel_flight_last_write_duration_seconds",
                                   "Time the last record took to write and fdatasync.", source="flight")
FLIGHT_LAST_RECORD_BYTES = gauge("memtel_flight_last_record_bytes",
                                 "Size of the last record on disk (compressed, with its header).", source="flight")
FLIGHT_PREVIOUS_BOOT_RECORDS = gauge("memtel_flight_previous_boot_records",
                                     "Readable records in the previous boot's flight ring.", source="flight")
FLIGHT_PREVIOUS_BOOT_LAST_RECORD_TIME = gauge(
    "memtel_flight_previous_boot_last_record_timestamp_seconds",
    "Unix time of the previous boot's last flight record: about when that boot ended.", source="flight")
FLIGHT_PREVIOUS_BOOT_MIN_HEADROOM = gauge(
    "memtel_flight_previous_boot_min_headroom_bytes",
    "Lowest memtel_node_unified_headroom_bytes in the previous boot's flight ring.", source="flight")

# -- the guard (telemetry/guard/metrics.py) ---------------------------------------------------------------------
GUARD_ADMITTED = counter(
    "memtel_guard_admitted",
    "Completion requests the guard forwarded, by path and how the prompt was counted: byte_bound (its UTF-8 bytes "
    "were within the limit), token_ids, tokenize (the upstream counted it), blind (no limit known; --when-blind "
    "admit).", ("path", "counted_by"), source="guard")
GUARD_REJECTED = counter(
    "memtel_guard_rejected",
    "Requests the guard answered itself instead of forwarding, by reason: context_length_exceeded (at least the "
    "engine's max-model-len: 400, permanent), exceeds_memory_at_best (more than the deployment could take with "
    "an empty cache: 400, permanent), would_not_fit (longer than the longest prefill that fits now), "
    "in_prefill (fits alone, not beside the admitted prefills), blind (--when-blind reject), bad_request "
    "(malformed, or prompt_embeds too large to bound), not_forwarded (a path the guard does not pass), no_replica "
    "(no replica healthy).", ("reason",),
    source="guard")
GUARD_BLIND_DECISIONS = counter(
    "memtel_guard_blind_decisions",
    "Completion requests decided while the guard was blind, by what --when-blind made of them (admit or reject).",
    ("decision",), source="guard")
GUARD_PASSED_THROUGH = counter(
    "memtel_guard_passed_through",
    "Requests to paths that run no prefill (/v1/models, /health, /tokenize, ...) forwarded unchanged.", source="guard")
GUARD_TOKENIZE_CALLS = counter(
    "memtel_guard_tokenize_calls",
    "Calls to the upstream's /tokenize to count a prompt whose byte bound exceeded the limit.", source="guard")
GUARD_UPSTREAM_FAILURES = counter(
    "memtel_guard_upstream_failures",
    "Exchanges with the upstream that failed, by stage: connect, request (no response head), body (the response "
    "broke off), tokenize.", ("stage",), source="guard")
GUARD_CONNECTIONS = counter(
    "memtel_guard_connections_closed",
    "Client connections the guard closed at its connection bound, by how: evicted (the idlest, to make room), "
    "refused (none was idle).", ("how",), source="guard")
GUARD_ADDED_LATENCY = histogram(
    "memtel_guard_added_latency_seconds",
    "Time the guard spent on a completion request before forwarding or refusing it: from its last byte read to the "
    "request written upstream (or the refusal decided), parsing, counting and any /tokenize call included.",
    source="guard")
GUARD_LIMIT_TOKENS = gauge(
    "memtel_guard_limit_tokens",
    "The longest prompt the guard admits now: the smallest fresh memtel_forecast_max_prefill_tokens among its hooks "
    "(less --reserve-mb) less the tokens of admitted requests still in their prefill. Absent while blind.",
    source="guard")
GUARD_MAX_PREFILL_TOKENS = gauge(
    "memtel_guard_max_prefill_tokens",
    "The limiting rank's longest fitting prefill as the guard uses it (after --reserve-mb), with its node and rank.",
    ("node", "rank"), source="guard")
GUARD_LIMIT_TOKENS_AT_BEST = gauge(
    "memtel_guard_limit_tokens_at_best",
    "The most the deployment could ever take, as the guard's permanent refusal uses it: the best replica's "
    "smallest rank's memtel_forecast_max_prefill_tokens_at_best, read only while the guard had no prefill in flight "
    "there (the highest such reading of the last five minutes), with that rank's node and rank; absent while "
    "unknown (then no refusal is permanent by memory).", ("node", "rank"), source="guard")
GUARD_IN_PREFILL_TOKENS = gauge(
    "memtel_guard_in_prefill_tokens",
    "Tokens of admitted requests whose prefill has not ended (no byte of their response yet).", source="guard")
GUARD_HOOKS = gauge("memtel_guard_hooks", "Hook exporters the guard reads (--hooks).", source="guard")
GUARD_FRESH_RANKS = gauge(
    "memtel_guard_fresh_ranks",
    "Ranks whose forecast the guard holds fresh now (their hook answered and their forecast is younger than "
    "--stale-s).", source="guard")
GUARD_BLIND = gauge(
    "memtel_guard_blind",
    "1 while the guard is blind: no fresh forecast from any hook, so --when-blind decides every completion request.",
    source="guard")
GUARD_HOOKS_WITHOUT_GAUGE = gauge(
    "memtel_guard_hooks_without_gauge",
    "Hook exporters that answer without any forecast (their engine runs without it: the guard is blind for their "
    f"ranks); start the engine with the hook on a known engine or set {hook_env.FORECAST_TOKENS}.", source="guard")
GUARD_BLIND_SECONDS = counter("memtel_guard_blind_seconds", "Seconds the guard has been blind since it started.",
                              source="guard")
GUARD_BLIND_EPISODES = counter("memtel_guard_blind_episodes", "Times the guard became blind.", source="guard")
GUARD_HOOK_SCRAPE_FAILURES = counter(
    "memtel_guard_hook_scrape_failures",
    "Scrapes of a hook exporter that failed (no answer, an error status, a malformed answer), by hook URL.",
    ("hook",), source="guard")
GUARD_QUEUE_DEPTH = gauge(
    "memtel_guard_queue_depth",
    "Completion requests waiting in the guard's queue now (--queue-s) for the limit to rise.", source="guard")
GUARD_QUEUE_WAIT = histogram(
    "memtel_guard_queue_wait_seconds",
    "Time a completion request waited in the guard's queue, whatever the outcome (queue_full excepted).",
    source="guard")
GUARD_QUEUE_OUTCOMES = counter(
    "memtel_guard_queue_outcomes",
    "Completion requests that entered (or found full) the guard's queue, by outcome: admitted (forwarded after the "
    "wait), timed_out (503 after --queue-s), client_left (the client closed its connection while waiting), "
    "queue_full (503 at once, --max-queued reached), refused (a permanent refusal on a later decision).",
    ("outcome",), source="guard")
GUARD_REPLICA_IN_POOL = gauge(
    "memtel_guard_replica_in_pool",
    "1 while a replica takes completion requests: its /health answers 200 and one of its hooks is fresh.",
    ("replica",), source="guard")
GUARD_REPLICA_LIMIT_TOKENS = gauge(
    "memtel_guard_replica_limit_tokens",
    "The longest prompt a replica admits now (memtel_guard_limit_tokens of that replica alone); absent while blind.",
    ("replica",), source="guard")
GUARD_REPLICA_FORWARDED = counter(
    "memtel_guard_replica_forwarded",
    "Requests the guard forwarded to each replica (completions and pass-through paths).", ("replica",),
    source="guard")

# -- the LiteLLM gate (telemetry/litellm/metrics.py): GET /memtel/metrics on the proxy ----------------------------
LITELLM_DEPLOYMENT_BLIND = gauge(
    "memtel_litellm_deployment_blind",
    "1 while a guarded deployment the gate has met is blind: no fresh forecast from its hooks (no answer, a failed "
    "scrape, a hook without the forecast); its prompts are then held or refused, never sized by memory.",
    ("deployment",), source="litellm")
LITELLM_HOOK_SCRAPE_FAILURES = counter(
    "memtel_litellm_hook_scrape_failures",
    "Scrapes of a guarded deployment's hook exporter that failed (no answer, an error status, a malformed or "
    "oversized answer), by hook URL.", ("hook",), source="litellm")
LITELLM_HOLDS = gauge(
    "memtel_litellm_holds",
    "Admitted requests whose hold is in the gate's book now (their call has not ended).", source="litellm")
LITELLM_REFUSALS = counter(
    "memtel_litellm_refusals",
    "Requests the gate refused, by reason (the admission core's: would_not_fit, in_prefill, blind, no_replica, "
    "context_length_exceeded, exceeds_memory_at_best, bad_request, unknown_model, unsized_route, ...).",
    ("reason",), source="litellm")

# -- the lab server (harness/labserver/server.py) --------------------------------------------------------------
LAB_INDEXER_LAUNCHES = counter("memtel_lab_indexer_launches", "Indexer logits launches made, per rank summed.",
                               ("model_name", "engine"), source="lab")   # labelled as the lab's vLLM series


def _collect() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for value in globals().values():
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if isinstance(item, tuple):
                item = item[0]
            if isinstance(item, Family):
                if found.get(item.name, item) != item:
                    raise ValueError(f"two catalogue entries named {item.name}")
                found[item.name] = item
    return found


FAMILIES: dict[str, Family] = _collect()
"""Every family by name (prometheus_client's family name, counters without _total)."""
