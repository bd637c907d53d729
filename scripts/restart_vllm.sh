#!/usr/bin/env bash
# Restart production vLLM on a host without systemd, and block until it serves: the daemon's
# [production].restart for such hosts (with systemd, use systemd/vllm@.service instead).
#
#   restart = ["/opt/autotune/scripts/restart_vllm.sh", "--config", "/etc/vllm/production.yaml",
#              "--url", "http://127.0.0.1:8000", "--pidfile", "/run/vllm/production.pid",
#              "--log", "/var/log/vllm/production.log", "--timeout", "900", "--",
#              "/opt/vllm/.venv/bin/vllm", "serve"]
#
# Stops the server the pidfile names (SIGTERM to its whole session, SIGKILL after --grace
# seconds), starts `<command> --config <config>` in a session of its own (it outlives this
# script), then waits until <url>/health answers 200: exit 0. If the server exits, or the timeout
# passes first, it prints the log's last lines and exits 1, and the daemon rolls back. The daemon
# writes the config (model included) before it calls this; the command must not name a model.
set -euo pipefail

config="" url="" pidfile="" log="" timeout=900 grace=30
while [ $# -gt 0 ]; do
  case "$1" in
    --config) config="$2"; shift 2 ;;
    --url) url="${2%/}"; shift 2 ;;
    --pidfile) pidfile="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --timeout) timeout="$2"; shift 2 ;;
    --grace) grace="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "restart_vllm.sh: unknown option $1 (see the header of this script)" >&2; exit 2 ;;
  esac
done
if [ -z "$config" ] || [ -z "$url" ] || [ -z "$pidfile" ] || [ -z "$log" ] || [ $# -eq 0 ]; then
  echo "restart_vllm.sh: needs --config FILE --url URL --pidfile FILE --log FILE -- COMMAND..." >&2
  exit 2
fi
[ -r "$config" ] || { echo "restart_vllm.sh: cannot read the config $config" >&2; exit 2; }

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }

# stop the running server: its session is its process group (started with setsid below)
if [ -s "$pidfile" ]; then
  old="$(cat "$pidfile")"
  if alive "$old"; then
    kill -TERM -- "-$old" 2>/dev/null || kill -TERM "$old" 2>/dev/null || true
    for _ in $(seq 1 $((grace * 10))); do alive "$old" || break; sleep 0.1; done
    alive "$old" && { kill -KILL -- "-$old" 2>/dev/null || kill -KILL "$old" 2>/dev/null || true; }
  fi
fi

mkdir -p "$(dirname "$log")" "$(dirname "$pidfile")"
# a session of its own: this script (and the daemon that runs it) may end, the server goes on
setsid "$@" --config "$config" >>"$log" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$pidfile"

deadline=$((SECONDS + timeout))
while [ $SECONDS -lt $deadline ]; do
  if ! alive "$pid"; then
    echo "restart_vllm.sh: the server exited during start-up; last lines of $log:" >&2
    tail -n 20 "$log" >&2
    exit 1
  fi
  if curl -fsS -o /dev/null --max-time 2 "$url/health" 2>/dev/null; then
    exit 0
  fi
  sleep 1
done
echo "restart_vllm.sh: $url/health did not answer within ${timeout}s; last lines of $log:" >&2
tail -n 20 "$log" >&2
exit 1
