#!/usr/bin/env bash
# Idempotent: the Debian packages the test suite needs beyond Python.
#
#   systemd      systemd-analyze (tests/test_systemd.py: verify + security of systemd/*.service)
#   postgresql   server binaries initdb, pg_ctl, postgres (tests that run a real PostgreSQL)
#   nodejs       node (tests/test_systemd.py evaluates the polkit rule, which is JavaScript)
#   gcc          cc (tests/test_bench_replay.py compiles scripts/fixed_timing_server.c, the client benchmark's server)
#   chromium     headless Chromium (tests/test_screenshots.py renders the report and optuna-dashboard;
#                scripts/screenshots.py makes docs/*.png)
#   nginx        the reverse proxy of blue/green publishing (tests/test_bluegreen.py runs
#                systemd/nginx-autotune.conf in a real nginx; Debian puts it in /usr/sbin)
#   fonts-dejavu-core  the font the screenshots are drawn in (fontconfig usually brings it; checked so that
#                every host draws the same text)
#
#   sudo bash scripts/ci_system_deps.sh
#
# Does nothing when the tools are there (on PATH, or for PostgreSQL in
# /usr/lib/postgresql/<version>/bin, where Debian puts them off PATH). Installs the
# missing packages with apt-get when run as root; otherwise says what to install and
# exits 1.
set -euo pipefail

log() { printf '[ci_system_deps] %s\n' "$*" >&2; }

have_postgres() {
  if command -v initdb >/dev/null && command -v pg_ctl >/dev/null && command -v postgres >/dev/null; then
    return 0
  fi
  local bin
  for bin in /usr/lib/postgresql/*/bin; do
    if [ -x "$bin/initdb" ] && [ -x "$bin/pg_ctl" ] && [ -x "$bin/postgres" ]; then
      return 0
    fi
  done
  return 1
}

missing=()
command -v systemd-analyze >/dev/null || missing+=(systemd)
have_postgres || missing+=(postgresql)
command -v node >/dev/null || missing+=(nodejs)
command -v cc >/dev/null || missing+=(gcc)
command -v chromium >/dev/null || missing+=(chromium)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || missing+=(nginx)
[ -f /usr/share/fonts/truetype/dejavu/DejaVuSans.ttf ] || missing+=(fonts-dejavu-core)

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

if [ "${EUID:-$(id -u)}" -ne 0 ]; then
  printf 'ci_system_deps.sh: missing Debian packages: %s (as root: apt-get install -y %s)\n' \
    "${missing[*]}" "${missing[*]}" >&2
  exit 1
fi

log "installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing[@]}"
