#!/usr/bin/env bash
# Installs Prometheus, promtool, Alertmanager and amtool from Debian when any is missing.
set -euo pipefail
need=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null && command -v amtool >/dev/null || need+=(prometheus-alertmanager)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing ${need[*]} (Debian packages)" >&2
$SUDO apt-get update -qq
# The packages try to start their services; where no init system runs that is refused harmlessly.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
