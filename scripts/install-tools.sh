#!/usr/bin/env bash
# Installs what `make test` runs besides Python, from Debian, only where missing: Prometheus, promtool,
# Alertmanager and amtool, ping and iperf3, and kubectl (which renders deploy/ with its built-in kustomize);
# and, pinned, into a cache: VictoriaMetrics' binaries (scripts/install-victoria-metrics.sh) and
# Prometheus 2.53 LTS beside bookworm's 2.42 (scripts/install-prometheus-lts.sh).
set -euo pipefail
bash "$(dirname "$0")/install-victoria-metrics.sh" >/dev/null
bash "$(dirname "$0")/install-prometheus-lts.sh" >/dev/null
need=()
command -v prometheus >/dev/null && command -v promtool >/dev/null || need+=(prometheus)
command -v prometheus-alertmanager >/dev/null && command -v amtool >/dev/null || need+=(prometheus-alertmanager)
# Debian's kubectl (kubernetes-client) is old: it embeds kustomize v2, which cannot render components,
# so tests/deploy skip with that reason. A kubectl >= 1.21 (any current one) renders everything.
command -v kubectl >/dev/null || need+=(kubernetes-client)
# The ping and iperf checks' tests run the real tools in network namespaces.
command -v ping >/dev/null || need+=(iputils-ping)
command -v iperf3 >/dev/null || need+=(iperf3)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing ${need[*]} (Debian packages)" >&2
$SUDO apt-get update -qq
# The packages try to start their services; where no init system runs that is refused harmlessly.
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
