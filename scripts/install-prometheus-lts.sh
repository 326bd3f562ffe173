#!/usr/bin/env bash
# Installs Prometheus 2.53, the long-term-support release most fleets run (prometheus and promtool),
# from Debian's `prometheus` and `promtool` packages, once, into a cache outside the repository, and
# prints their folder:
#
#     ${XDG_CACHE_HOME:-~/.cache}/accel-health/prometheus-<version>/usr/bin
#
# `make test` runs every promtool test of alerts/ under it beside bookworm's 2.42 (the `rules` target)
# and the main end-to-end test on it too (tests/test_e2e.py). The version is pinned and both packages'
# SHA-256 checked, so a different release would not change what is tested unnoticed. Bookworm ships
# 2.42; the packages come from trixie, fetched with a private apt sources list and state: the machine's
# own apt configuration is not touched, and no package is installed. Trixie's binaries are Go binaries
# linked only against libc (libc6 >= 2.34; bookworm has 2.36), so they run on bookworm. A user with
# other binaries points PROMETHEUS_LTS_BIN at a folder holding prometheus and promtool, and this
# script does nothing. `--installed` only prints the folder, and fails where nothing is installed yet
# (tests use it to skip).
set -euo pipefail

VERSION=2.53.3+ds1-2
# The two binary packages built from Debian's prometheus source: prometheus (the server) and promtool.
SHA256_prometheus=58c3e6a86c56cb3bfd71032fa48d65945d526441a212f5815dfe5ed9cb787ecc
SHA256_promtool=ff27654eacc95abd846d344e91fe4ba3b4f0588a50d606ed1d2f09ad3408722f
SUITE=trixie
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/accel-health/prometheus-$VERSION"
BIN="$CACHE/usr/bin"

if [ -n "${PROMETHEUS_LTS_BIN:-}" ]; then
    for b in prometheus promtool; do
        [ -x "$PROMETHEUS_LTS_BIN/$b" ] || { echo "PROMETHEUS_LTS_BIN=$PROMETHEUS_LTS_BIN has no $b" >&2; exit 1; }
    done
    echo "$PROMETHEUS_LTS_BIN"
    exit 0
fi

if [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ]; then
    echo "$BIN"
    exit 0
fi
if [ "${1:-}" = "--installed" ]; then
    echo "prometheus $VERSION is not installed: run \`make tools\`" >&2
    exit 1
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/accel-health-prometheus.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
# shellcheck source=scripts/private-apt.sh
. "$(dirname "$0")/private-apt.sh"
private_apt "$SUITE" "$WORK" "prometheus and promtool $VERSION"
(cd "$WORK" && apt-get -qq "${apt_private[@]}" download "prometheus=$VERSION" "promtool=$VERSION" >&2) || {
    echo "prometheus $VERSION is no longer in Debian $SUITE: pin the version it has (VERSION and the" >&2
    echo "SHA256_* in $0) and run \`make rules\` and tests/test_e2e.py to see what the new release changes" >&2
    exit 1
}
for package in prometheus promtool; do
    deb="$(ls "$WORK/${package}"_*.deb)"
    sha="SHA256_$package"
    echo "${!sha}  $deb" | sha256sum --check --quiet >&2 || {
        echo "$package $VERSION: SHA-256 of $deb is not the pinned ${!sha}" >&2
        exit 1
    }
done
# Two checkouts setting up at once unpack one after the other; the second finds it done.
mkdir -p "$(dirname "$CACHE")"
exec 9>"$CACHE.lock"
flock 9
if [ -x "$BIN/prometheus" ] && [ -x "$BIN/promtool" ]; then
    echo "$BIN"
    exit 0
fi
rm -rf "$CACHE.partial"
for package in prometheus promtool; do
    dpkg-deb -x "$WORK/${package}_"*.deb "$CACHE.partial"
done
for b in prometheus promtool; do
    "$CACHE.partial/usr/bin/$b" --version >/dev/null 2>&1 || {
        echo "prometheus $VERSION: $b does not run here (it needs libc6 >= 2.34)" >&2
        exit 1
    }
done
rm -rf "$CACHE"
mv "$CACHE.partial" "$CACHE"
echo "$BIN"
