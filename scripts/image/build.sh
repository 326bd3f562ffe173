#!/usr/bin/env bash
# Builds the accel-health container image from Containerfile, offline: nothing is pulled from a
# container registry and pip inside the build reaches no index. `make image` runs it.
#
#   build/image/rootfs.tar        Debian's python3 and what it depends on, nothing else (mmdebstrap)
#   build/image/wheelhouse/       the dependencies' wheels, for the image's Python and architecture
#   build/image/pip.whl           pip, run from its wheel inside the build and never installed
#   build/image/app/              the project's own wheel
#   build/image/tools/            setuptools and wheel, so the project's wheel builds without an index
#
# Each is made again only when what it is made from changed (a digest of the inputs sits beside it),
# so a rebuild after a source change makes the project's wheel and its layer again, nothing more.
# The first build needs Debian's mirror and PyPI; a warm one needs neither.
#
# Usage: scripts/image/build.sh [--if-warm]
#   --if-warm   build only when every cache above is already filled (a rebuild then takes seconds
#               and reaches no network); otherwise say why not and exit 3. `make test` uses it.
# Environment: IMAGE (default: [tool.accel-health.image] name in pyproject.toml), DEBIAN_MIRROR,
#   BUILDAH_ISOLATION (default chroot), STORAGE_DRIVER (buildah's own: set vfs where overlay fails).
set -euo pipefail

cd "$(dirname "$0")/../.."
OUT=build/image
SUITE=bookworm          # Debian 12: python3 is 3.11, the oldest version pyproject.toml accepts
PYTHON_VERSION=3.11     # must be the suite's python3, so the downloaded wheels fit it
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if_warm=false
[ "${1:-}" = "--if-warm" ] && if_warm=true

say() { echo "image: $*" >&2; }
digest() { sha256sum | cut -c1-64; }
# A target is fresh when its recorded digest equals the digest of its inputs now.
fresh() { [ -e "$1" ] && [ -f "$1.digest" ] && [ "$(cat "$1.digest")" = "$2" ]; }
record() { echo "$2" >"$1.digest"; }

# -- what the image is: name, version, revision, licence, source, all from pyproject.toml and git ------
eval "$(python3 - <<'EOF'
import shlex, tomllib
with open("pyproject.toml", "rb") as f:
    data = tomllib.load(f)
project = data["project"]
fields = {
    "NAME": data["tool"]["accel-health"]["image"]["name"],
    "VERSION": project["version"],
    "LICENSES": project["license"],
    "SOURCE": project["urls"]["Source"],
    "REQUIREMENTS": "\n".join(project["dependencies"]) + "\n",
}
for key, value in fields.items():
    print(f"{key}={shlex.quote(value)}")
EOF
)"
IMAGE=${IMAGE:-$NAME}
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || REVISION="$REVISION-dirty"
case "$(uname -m)" in
    x86_64) DEB_ARCH=amd64 WHEEL_ARCH=x86_64 ;;
    aarch64) DEB_ARCH=arm64 WHEEL_ARCH=aarch64 ;;
    *) say "no wheels are downloaded for $(uname -m)"; exit 1 ;;
esac

# -- the inputs of each cache, as digests ------------------------------------------------------------
ROOTFS_OPTS=(
    --variant=extract --include=python3 --architectures="$DEB_ARCH"
    # /usr merged as Debian 12 has it, without the usrmerge package (which brings Perl).
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    # No documentation; the copyright files stay, the licences of what is shipped.
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*'
    # glibc's iconv modules: Python brings its own codecs and nothing here calls iconv(3).
    --dpkgopt='path-exclude=/usr/lib/*/gconv/*'
    # What was installed, one file per package as distroless images keep it, so image scanners
    # (trivy, grype) see the Debian packages: the extract variant runs no dpkg, hence no status file.
    --extract-hook='mkdir -p "$1/var/lib/dpkg/status.d"; for deb in "$1"/var/cache/apt/archives/*.deb; do { dpkg-deb -f "$deb"; echo "Status: install ok installed"; } >"$1/var/lib/dpkg/status.d/$(dpkg-deb -f "$deb" Package)"; done'
    # The home of the image's user (uid 65532, scripts/image/etc/passwd).
    --extract-hook='install -d -m 0755 -o 65532 -g 65532 "$1/home/nonroot"'
)
rootfs_key=$(printf '%s\n' "$SUITE" "$MIRROR" "${ROOTFS_OPTS[@]}" | digest)
wheels_key=$(printf '%s\n' "$PYTHON_VERSION" "$WHEEL_ARCH" "$REQUIREMENTS" | digest)
app_key=$( (cat pyproject.toml; git ls-files -co --exclude-standard exporter remediator | sort | xargs cat) | digest)

if $if_warm; then
    for tool in mmdebstrap buildah; do
        command -v "$tool" >/dev/null || { say "not built: $tool is not installed (make image-tools)"; exit 3; }
    done
    fresh $OUT/rootfs.tar "$rootfs_key" || { say "not built: no root filesystem cached yet (run make image once)"; exit 3; }
    fresh $OUT/wheelhouse "$wheels_key" || { say "not built: the wheelhouse is missing or stale (run make image)"; exit 3; }
    fresh $OUT/tools "$wheels_key" || { say "not built: no build tools cached yet (run make image once)"; exit 3; }
fi
mkdir -p $OUT

# -- the root filesystem: Debian's python3 and its dependencies ------------------------------------
if ! fresh $OUT/rootfs.tar "$rootfs_key"; then
    say "root filesystem from Debian $SUITE (mmdebstrap)"
    mmdebstrap --quiet "${ROOTFS_OPTS[@]}" "$SUITE" $OUT/rootfs.new.tar "$MIRROR"
    rm -rf $OUT/rootfs.tar; mv $OUT/rootfs.new.tar $OUT/rootfs.tar
    record $OUT/rootfs.tar "$rootfs_key"
fi

# -- wheels for the image's Python, downloaded on this machine --------------------------------------
pip_download() {
    python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        --python-version "$PYTHON_VERSION" --implementation cp --abi "cp${PYTHON_VERSION/./}" \
        --platform "manylinux_2_36_$WHEEL_ARCH" --platform "manylinux_2_28_$WHEEL_ARCH" \
        --platform "manylinux_2_17_$WHEEL_ARCH" --platform "manylinux2014_$WHEEL_ARCH" \
        --platform "manylinux_2_5_$WHEEL_ARCH" --platform "manylinux1_$WHEEL_ARCH" "$@"
}
if ! fresh $OUT/wheelhouse "$wheels_key"; then
    say "wheels of the dependencies (pip download)"
    rm -rf $OUT/wheelhouse $OUT/wheelhouse.new
    mkdir -p $OUT/wheelhouse.new
    printf '%s' "$REQUIREMENTS" >$OUT/wheelhouse.new/requirements.txt
    pip_download --dest $OUT/wheelhouse.new -r $OUT/wheelhouse.new/requirements.txt
    mv $OUT/wheelhouse.new $OUT/wheelhouse
    record $OUT/wheelhouse "$wheels_key"
fi
if ! fresh $OUT/tools "$wheels_key"; then
    say "pip, setuptools and wheel (pip download)"
    rm -rf $OUT/tools
    pip_download --dest $OUT/tools pip "setuptools>=68" wheel
    cp $OUT/tools/pip-*.whl $OUT/pip.whl
    record $OUT/tools "$wheels_key"
fi

# -- the project's wheel, built from the sources without an index ---------------------------------
if ! fresh $OUT/app "$app_key"; then
    say "the project's wheel"
    rm -rf $OUT/app
    # Dates inside the wheel from the last commit, so unchanged sources give the same bytes.
    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 315532800) \
        python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --no-index \
        --find-links $OUT/tools --wheel-dir $OUT/app .
    record $OUT/app "$app_key"
fi

# -- the image -------------------------------------------------------------------------------------
say "building $IMAGE:$VERSION (revision $REVISION)"
# The labels go in twice: as build arguments for the Containerfile's LABEL (what podman and docker
# use), and as --label, because buildah's layer cache reuses a LABEL step whose arguments changed.
labels=(
    org.opencontainers.image.version="$VERSION" org.opencontainers.image.revision="$REVISION"
    org.opencontainers.image.source="$SOURCE" org.opencontainers.image.licenses="$LICENSES"
)
buildah bud --quiet --layers --isolation="${BUILDAH_ISOLATION:-chroot}" \
    --build-arg VERSION="$VERSION" --build-arg REVISION="$REVISION" \
    --build-arg SOURCE="$SOURCE" --build-arg LICENSES="$LICENSES" \
    "${labels[@]/#/--label=}" \
    --tag "$IMAGE:$VERSION" --file Containerfile . >/dev/null
say "built $IMAGE:$VERSION"
