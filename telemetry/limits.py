"""Every size and count a ladder, a file or a flag of the harness and the lab may ask for, in one place.

A bad or hostile input must fail at once with one line, never make memtel build a structure too large
for the machine (a ladder step of 10^21 tokens, 10^12 repeats, a words file that is /dev/zero, a
replay of 10^9 layers). Each limit sits far above any real workload: prompts of real users reach 1M
tokens, so a step may ask for 4M. The tables in docs/harness.md ("Limits") and docs/lab.md ("Limits")
list them; change both together.
"""

from __future__ import annotations

MIB = 1024 * 1024

# --- ladders (harness/ab/config.py) and prompts (harness/ab/prompts.py) ---------------------------
MAX_PREFILL_TOKENS = 4 * MIB  # 4,194,304: a step's `tokens`; `replay --tokens`, `forecast --tokens`
MIN_STEP_TOKENS = 64  # a prompt's fixed part (header, needle, question) is about 50 tokens
MAX_STEPS = 1_000
MAX_REPEATS = 1_000
MAX_ARMS = 64
MAX_ENDPOINTS = 1_024  # `nodes`, `ranks` (each, ladder-wide or per arm)
MAX_OUTPUT_TOKENS = 1_048_576  # request.max_tokens
MAX_SEED = 2**63 - 1
MAX_TIMEOUT_S = 7 * 86_400.0  # request.timeout_s, serve.startup_timeout_s
MAX_STOP_GRACE_S = 3_600.0
MAX_NAME_CHARS = 128  # arm names and step labels (they name files)
MAX_TEXT_CHARS = 4_096  # model, URLs, cwd, log_file, hook_log_dir
MAX_EXTRA_BODY_BYTES = 64 * 1024  # request.extra_body as JSON
MAX_WORDS_FILE_BYTES = 64 * MIB  # request.words_file (a tokenizer.json is a few MB)
MAX_ENV_VARS = 1_024  # serve.env entries
MAX_ARG_CHARS = 128 * 1024  # one argument or environment value (Linux's MAX_ARG_STRLEN)
MAX_COMMAND_ARGS = 4_096  # serve.command entries

# --- the indexer's workload (telemetry/model/indexer) and the lab --------------------------------------------
MAX_LAYERS = 1_024
MAX_MODEL_LEN = 16 * MIB  # 16,777,216 tokens: max_model_len, chunk, fixed_width
MAX_COMPRESS_RATIO = 1_024
MAX_TOPK = 65_536
MAX_BUDGET_MIB = 1_048_576.0  # a logits budget of 1 TiB
MAX_TRANSIENT_MIB = 1_048_576.0
MAX_CAPACITY_GIB = 1_048_576.0  # a simulated device of 1 PiB
MAX_REPLAY_LAUNCHES = 1_000_000  # logits launches of one replayed arm (about 100 s and 0.5 GB on the simulator)
MAX_REPLAY_ARMS = 16
MAX_FORECAST_TOKEN_COUNTS = 64  # `forecast --tokens N,N,...`
MAX_LAB_RANKS = 64
MAX_TIME_SCALE = 1_000.0
MAX_TENANT_S = 7 * 86_400.0  # `lab serve --tenant` START_S and DURATION_S, `POST /lab/tenant` seconds

# --- files of the allocator lab ---------------------------------------------------------------------
MAX_OP_FILE_BYTES = 256 * MIB  # `memtel allocsim FILE` (and stdin); the H200 truth file is 0.4 MB

# --- memory snapshots and recorded histories (telemetry/model/allocsim: snapshot_file, snapshot, trace) ----
MAX_SNAPSHOT_FILE_BYTES = 2 * 1024 * MIB  # the file, and its content once decompressed (`--max-file-gb`)
MAX_SNAPSHOT_OBJECTS = 2_000_000  # containers built while unpickling or parsing, and trace entries (`--max-objects`);
#   about 0.5 GB at most
MAX_SNAPSHOT_BLOCKS = 250_000  # segments + blocks of a snapshot, shared ones counted each time they are read
#   (`--max-blocks`); a serving process holds thousands; reading 250,000 takes about 2.5 s
MAX_SNAPSHOT_VALUE_BYTES = 64 * MIB  # one string, byte string or pickle frame (a snapshot's are short)
MAX_SNAPSHOT_JSON_BYTES = 256 * MIB  # a JSON snapshot is parsed whole; its numbers cost up to 8x its text
