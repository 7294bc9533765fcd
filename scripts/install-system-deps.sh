#!/usr/bin/env bash
# Installs the system packages the e2e tests need (Debian's prometheus: server + promtool).
set -euo pipefail
if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" != "0" ]; then
  echo "prometheus/promtool missing and not root: install Debian's 'prometheus' package" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The Debian package starts a system service where systemd runs; tests start their own server.
command -v promtool >/dev/null
