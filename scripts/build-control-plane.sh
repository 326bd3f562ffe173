#!/usr/bin/env bash
# Builds a real kube-apiserver and kube-controller-manager for the "as deployed" tests, once, from
# Debian's `kubernetes` source package (every Go dependency vendored, so it builds offline), and
# caches them outside the repository:
#
#     ${XDG_CACHE_HOME:-~/.cache}/accel-health/kube/<version>/{kube-apiserver,kube-controller-manager}
#
# etcd comes from Debian's etcd-server package. A user with newer binaries points KUBEBUILDER_ASSETS
# (envtest's convention) at a folder holding etcd, kube-apiserver and kube-controller-manager instead,
# and this script does nothing.
#
# About 11 minutes on 2 cores, the first time; nothing after that. Prints the folder on stdout.
set -euo pipefail

VERSION=1.20.2
# Bumped whenever the build below changes, so that a cache of an older build is not reused.
BUILD=2
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/accel-health/kube/$VERSION-$BUILD"

if [ -n "${KUBEBUILDER_ASSETS:-}" ]; then
    for b in etcd kube-apiserver kube-controller-manager; do
        [ -x "$KUBEBUILDER_ASSETS/$b" ] || { echo "KUBEBUILDER_ASSETS=$KUBEBUILDER_ASSETS has no $b" >&2; exit 1; }
    done
    echo "$KUBEBUILDER_ASSETS"
    exit 0
fi

SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
apt_install() {
    local need=()
    for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
    [ ${#need[@]} -eq 0 ] && return 0
    echo "installing ${need[*]} (Debian packages)" >&2
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

apt_install etcd-server
# Debian's etcd-server starts no daemon where no init runs; the binary is all the tests need.
[ -x "$CACHE/etcd" ] || { mkdir -p "$CACHE"; ln -sf "$(command -v etcd || echo /usr/bin/etcd)" "$CACHE/etcd"; }

if [ -x "$CACHE/kube-apiserver" ] && [ -x "$CACHE/kube-controller-manager" ]; then
    echo "$CACHE"
    exit 0
fi

apt_install golang-go rsync jq dpkg-dev
SRC_LIST=/etc/apt/sources.list.d/accel-health-deb-src.list
if ! grep -rqs '^deb-src .*bookworm main' /etc/apt/sources.list /etc/apt/sources.list.d/ \
   && ! grep -rqs '^Types: .*deb-src' /etc/apt/sources.list.d/; then
    echo "deb-src http://deb.debian.org/debian bookworm main" | $SUDO tee "$SRC_LIST" >/dev/null
    $SUDO apt-get update -qq
fi

WORK="$(mktemp -d "${TMPDIR:-/tmp}/accel-health-kube-build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"
echo "building kube-apiserver and kube-controller-manager $VERSION from Debian's source package (~11 min, once)" >&2
apt-get source --download-only -qq kubernetes >/dev/null
dpkg-source --no-check -x kubernetes_*.dsc src >/dev/null
cd src
# Go >= 1.18 changed reflect.mapiterinit; the vendored modern-go/reflect2 1.0.1 still calls the old
# signature, and the API server then segfaults encoding maps (custom resources, managed fields).
# This is reflect2 1.0.2's fix, applied to the vendored copy (Debian's Go is 1.19).
R2=vendor/github.com/modern-go/reflect2
perl -0pi -e 's/func mapiterinit\(rtype unsafe.Pointer, m unsafe.Pointer\) \*hiter/func mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer, it *hiter)/' $R2/unsafe_link.go
perl -0pi -e 's/type hiter struct \{.*?\n\}/type hiter struct {\n\tkey         unsafe.Pointer\n\tvalue       unsafe.Pointer\n\tt           unsafe.Pointer\n\th           unsafe.Pointer\n\tbuckets     unsafe.Pointer\n\tbptr        unsafe.Pointer\n\toverflow    *[]unsafe.Pointer\n\toldoverflow *[]unsafe.Pointer\n\tstartBucket uintptr\n\toffset      uint8\n\twrapped     bool\n\tB           uint8\n\ti           uint8\n\tbucket      uintptr\n\tcheckBucket uintptr\n}/s' $R2/unsafe_link.go
perl -0pi -e 's/\treturn &UnsafeMapIterator\{\n\t\thiter:      mapiterinit\(type2.rtype, \*\(\*unsafe.Pointer\)\(obj\)\),/\tvar it hiter\n\tmapiterinit(type2.rtype, *(*unsafe.Pointer)(obj), &it)\n\treturn &UnsafeMapIterator{\n\t\thiter:      &it,/' $R2/unsafe_map.go
grep -q 'mapiterinit(rtype unsafe.Pointer, m unsafe.Pointer, it \*hiter)' $R2/unsafe_link.go \
    && grep -q 'hiter:      &it,' $R2/unsafe_map.go && grep -q checkBucket $R2/unsafe_link.go \
    || { echo "patching $R2 for Go >= 1.18 failed" >&2; exit 1; }
export GOPATH="$PWD/.go" CGO_ENABLED=0 GOCACHE="$WORK/gocache"
mkdir -p .go/src/k8s.io
ln -s ../../.. .go/src/k8s.io/kubernetes
# The tree's own build (plain `go build -mod=vendor` fails on 1.20's layout).
make WHAT="cmd/kube-apiserver cmd/kube-controller-manager" >"$WORK/build.log" 2>&1 || {
    tail -40 "$WORK/build.log" >&2
    exit 1
}
mkdir -p "$CACHE"
for b in kube-apiserver kube-controller-manager; do
    install -m 0755 "$(find _output -type f -name "$b" | head -1)" "$CACHE/$b.tmp"
    mv "$CACHE/$b.tmp" "$CACHE/$b"
done
echo "$CACHE"
