#!/usr/bin/env bash
# Installs VictoriaMetrics' binaries (victoria-metrics, vmagent, vmalert, vmalert-tool) from Debian's
# `victoria-metrics` package, once, into a cache outside the repository, and prints their folder:
#
#     ${XDG_CACHE_HOME:-~/.cache}/accel-health/victoria-metrics-<version>/usr/bin
#
# The version is pinned, and the package's SHA-256 checked: `make test` compares every promtool test
# of alerts/ under vmalert-tool (scripts/compare_rule_engines.py) and runs the end-to-end test on
# VictoriaMetrics, so a different release would change what is compared. Bookworm ships 1.79, which
# predates `keep_firing_for`; the package comes from trixie (its static binaries run on bookworm),
# fetched with a private apt sources list and state: the machine's own apt configuration is not
# touched, and no package is installed. A user with other binaries points VICTORIA_METRICS_BIN at a
# folder holding victoria-metrics, vmalert and vmalert-tool, and this script does nothing.
# `--installed` only prints the folder, and fails where nothing is installed yet (tests use it to skip).
set -euo pipefail

VERSION=1.112.0+ds1-2
SHA256=1d3717f1a8ab5bf690271095dd286730f6fb0761cc8c09c0fc8f529c9838f346
SUITE=trixie
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/accel-health/victoria-metrics-$VERSION"
BIN="$CACHE/usr/bin"

if [ -n "${VICTORIA_METRICS_BIN:-}" ]; then
    for b in victoria-metrics vmalert vmalert-tool; do
        [ -x "$VICTORIA_METRICS_BIN/$b" ] || { echo "VICTORIA_METRICS_BIN=$VICTORIA_METRICS_BIN has no $b" >&2; exit 1; }
    done
    echo "$VICTORIA_METRICS_BIN"
    exit 0
fi

if [ -x "$BIN/victoria-metrics" ] && [ -x "$BIN/vmalert" ] && [ -x "$BIN/vmalert-tool" ]; then
    echo "$BIN"
    exit 0
fi
if [ "${1:-}" = "--installed" ]; then
    echo "victoria-metrics $VERSION is not installed: run \`make tools\`" >&2
    exit 1
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/accel-health-vm.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# shellcheck source=scripts/private-apt.sh
. "$(dirname "$0")/private-apt.sh"
private_apt "$SUITE" "$WORK" "victoria-metrics $VERSION"
(cd "$WORK" && apt-get -qq "${apt_private[@]}" download "victoria-metrics=$VERSION" >&2) || {
    echo "victoria-metrics $VERSION is no longer in Debian $SUITE: pin the version it has (VERSION and" >&2
    echo "SHA256 in $0) and run \`make rules-engines\` to see what the new release changes" >&2
    exit 1
}
deb="$(ls "$WORK"/victoria-metrics_*.deb)"
echo "$SHA256  $deb" | sha256sum --check --quiet >&2 || {
    echo "victoria-metrics $VERSION: SHA-256 of $deb is not the pinned $SHA256" >&2
    exit 1
}
mkdir -p "$(dirname "$CACHE")"
rm -rf "$CACHE.partial"
dpkg-deb -x "$deb" "$CACHE.partial"
for b in victoria-metrics vmalert vmalert-tool; do
    "$CACHE.partial/usr/bin/$b" -help >/dev/null 2>&1 || {
        echo "victoria-metrics $VERSION: $b does not run here" >&2
        exit 1
    }
done
rm -rf "$CACHE"
mv "$CACHE.partial" "$CACHE"
echo "$BIN"
