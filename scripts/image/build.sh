#!/usr/bin/env bash
# Builds the accel-health container image from Containerfile, offline: nothing is pulled from a
# container registry and pip inside the build reaches no index. `make image` runs it.
#
# In ~/.cache/accel-health/image/ (per user, like the control plane; ACCEL_HEALTH_CACHE moves it):
#   rootfs.tar      Debian's python3, ping and iperf3 (the active checks' tools) and what they depend
#                   on, nothing else (mmdebstrap)
#   wheelhouse/     the dependencies' wheels for the image's Python and architecture: the versions and
#                   hashes uv.lock holds for the project with its `checks` extra (`uv export`)
#   pip.whl         pip, run from its wheel inside the build and never installed
#   tools/          setuptools and wheel, so the project's wheel builds without an index
# In build/image/ (the build context): links to the first three, and app/, the project's own wheel.
#
# Each is made again only when what it is made from changed (a digest of the inputs sits beside it),
# so a rebuild after a source change makes the project's wheel and its layer again, nothing more.
# The first build needs Debian's mirror and PyPI; a warm one needs neither. uv comes from the
# development environment (`make setup`), or UV=PATH.
#
# Usage: scripts/image/build.sh [--if-warm]
#   --if-warm   build only when every cache above is already filled (a rebuild then takes seconds
#               and reaches no network); otherwise say why not and exit 3. `make test` uses it.
# Environment: IMAGE (default: [tool.accel-health.image] name in pyproject.toml), DEBIAN_MIRROR,
#   BUILDAH_ISOLATION (default chroot), STORAGE_DRIVER (buildah's own: set vfs where overlay fails).
set -euo pipefail

cd "$(dirname "$0")/../.."
OUT=build/image
# The downloads (root filesystem, wheels, build tools) are kept per user, as the control plane is, so a
# fresh clone on the same machine builds warm; build/image/ holds links to them, in the build context.
CACHE=${ACCEL_HEALTH_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/accel-health}/image
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
}
for key, value in fields.items():
    print(f"{key}={shlex.quote(value)}")
EOF
)"
IMAGE=${IMAGE:-$NAME}
UV=${UV:-.venv/bin/uv}
[ -x "$UV" ] || command -v "$UV" >/dev/null || { say "uv is not installed: run make setup (or set UV)"; exit 3; }
# What the image installs: uv.lock's versions and hashes of the dependencies and the `checks` extra
# (cuda-bindings, for pciebw and gpumem), nothing of the test extra. --frozen: the lock as committed.
REQUIREMENTS=$("$UV" export --quiet --frozen --no-emit-project --no-dev --extra checks --no-header \
    --no-annotate --format requirements-txt)
REVISION=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || REVISION="$REVISION-dirty"
case "$(uname -m)" in
    x86_64) DEB_ARCH=amd64 WHEEL_ARCH=x86_64 ;;
    aarch64) DEB_ARCH=arm64 WHEEL_ARCH=aarch64 ;;
    *) say "no wheels are downloaded for $(uname -m)"; exit 1 ;;
esac

# -- the inputs of each cache, as digests ------------------------------------------------------------
# Packages apt brings that nothing in the image runs or loads; their files are removed after the
# extraction, and image scanners do not see them listed. Only the maintainer scripts of iperf3 and
# iputils-ping use the first line (iperf3's daemon user, setcap), and the extract variant runs no
# maintainer script; the others serve only modules of the interpreter that nothing here imports
# (sqlite3, dbm.ndbm, readline, curses, nis), whose extension modules go with them. The last line:
# the package manager python3-minimal depends on, with tar and the libraries only those two link;
# nothing installs a package into a read-only root filesystem.
UNUSED_DEBS=(
    adduser passwd debconf init-system-helpers libcap2-bin libpam0g libpam-modules libpam-modules-bin
    libaudit1 libaudit-common libcap-ng0 libsemanage2 libsemanage-common libsepol2
    libsqlite3-0 libdb5.3 libreadline8 readline-common libncursesw6 libtinfo6 libnsl2 libtirpc3
    libtirpc-common libgssapi-krb5-2 libkrb5-3 libk5crypto3 libkrb5support0 libcom-err2 libkeyutils1
    dpkg tar libacl1 libselinux1 libpcre2-8-0 libmd0 libzstd1
)
UNUSED_MODULES=(_sqlite3 _dbm readline _curses _curses_panel nis)
ROOTFS_OPTS=(
    # ping and iperf3: the active checks `ping` and `iperf` (exporter/checks/network.py) run them;
    # libstdc++6: the `checks` extra's cuda-bindings (pciebw, gpumem) links it.
    --variant=extract --include=python3,iputils-ping,iperf3,libstdc++6 --architectures="$DEB_ARCH"
    # /usr merged as Debian 12 has it, without the usrmerge package (which brings Perl).
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr
    # No documentation; the copyright files stay, the licences of what is shipped.
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/lintian/*'
    # glibc's iconv modules: Python brings its own codecs and nothing here calls iconv(3).
    --dpkgopt='path-exclude=/usr/lib/*/gconv/*'
    # libstdc++'s pretty printers for gdb.
    --dpkgopt='path-exclude=/usr/share/gcc/*' --dpkgopt='path-exclude=/usr/share/gdb/*'
    --extract-hook='rm -rf "$1/usr/share/gcc" "$1/usr/share/gdb"'
    # help()'s topics and CPython's own tests and test modules: no shell, no interpreter prompt, nothing
    # imports them.
    --dpkgopt='path-exclude=/usr/lib/python3*/pydoc_data/*' --dpkgopt='path-exclude=/usr/lib/python3*/test/*'
    --dpkgopt='path-exclude=/usr/lib/python3*/lib-dynload/_test*'
    --dpkgopt='path-exclude=/usr/lib/python3*/lib-dynload/_ctypes_test*'
    --dpkgopt='path-exclude=/usr/lib/python3*/lib-dynload/_xxtestfuzz*'
    --dpkgopt='path-exclude=/usr/lib/python3*/lib-dynload/xxlimited*'
    # Packages only the maintainer scripts of iperf3 and iputils-ping need (its daemon's user, setcap),
    # which the extract variant never runs: their files are removed, and they are not listed below.
    --extract-hook='for pkg in '"${UNUSED_DEBS[*]}"'; do for deb in "$1"/var/cache/apt/archives/"$pkg"_*.deb; do dpkg-deb --fsys-tarfile "$deb" | tar -t | while read -r f; do if [ -L "$1/$f" ] || [ -f "$1/$f" ]; then rm -f "$1/$f"; fi; done; rm -f "$deb"; done; done'
    # What was installed, one file per package as distroless images keep it, so image scanners
    # (trivy, grype) see the Debian packages: the extract variant runs no dpkg, hence no status file.
    --extract-hook='mkdir -p "$1/var/lib/dpkg/status.d"; for deb in "$1"/var/cache/apt/archives/*.deb; do { dpkg-deb -f "$deb"; echo "Status: install ok installed"; } >"$1/var/lib/dpkg/status.d/$(dpkg-deb -f "$deb" Package)"; done'
    # The home of the image's user (uid 65532, scripts/image/etc/passwd).
    --extract-hook='install -d -m 0755 -o 65532 -g 65532 "$1/home/nonroot"'
)
for module in "${UNUSED_MODULES[@]}"; do
    ROOTFS_OPTS+=(--dpkgopt="path-exclude=/usr/lib/python3*/lib-dynload/$module.*")
done
rootfs_key=$(printf '%s\n' "$SUITE" "$MIRROR" "${ROOTFS_OPTS[@]}" | digest)
wheels_key=$(printf '%s\n' "$PYTHON_VERSION" "$WHEEL_ARCH" "$REQUIREMENTS" | digest)
app_key=$( (cat pyproject.toml; git ls-files -co --exclude-standard exporter remediator | sort | xargs cat) | digest)

if $if_warm; then
    for tool in mmdebstrap buildah; do
        command -v "$tool" >/dev/null || { say "not built: $tool is not installed (make image-tools)"; exit 3; }
    done
    fresh $CACHE/rootfs.tar "$rootfs_key" || { say "not built: no root filesystem cached yet (run make image once)"; exit 3; }
    fresh $CACHE/wheelhouse "$wheels_key" || { say "not built: the wheelhouse is missing or stale (run make image)"; exit 3; }
    fresh $CACHE/tools "$wheels_key" || { say "not built: no build tools cached yet (run make image once)"; exit 3; }
fi
mkdir -p $OUT $CACHE

# -- the root filesystem: Debian's python3 and its dependencies ------------------------------------
if ! fresh $CACHE/rootfs.tar "$rootfs_key"; then
    say "root filesystem from Debian $SUITE (mmdebstrap)"
    mmdebstrap --quiet "${ROOTFS_OPTS[@]}" "$SUITE" $CACHE/rootfs.new.tar "$MIRROR"
    rm -rf $CACHE/rootfs.tar; mv $CACHE/rootfs.new.tar $CACHE/rootfs.tar
    record $CACHE/rootfs.tar "$rootfs_key"
fi

# -- wheels for the image's Python, downloaded on this machine --------------------------------------
pip_download() {
    python3 -m pip download --quiet --disable-pip-version-check --only-binary=:all: \
        --python-version "$PYTHON_VERSION" --implementation cp --abi "cp${PYTHON_VERSION/./}" \
        --platform "manylinux_2_36_$WHEEL_ARCH" --platform "manylinux_2_28_$WHEEL_ARCH" \
        --platform "manylinux_2_17_$WHEEL_ARCH" --platform "manylinux2014_$WHEEL_ARCH" \
        --platform "manylinux_2_5_$WHEEL_ARCH" --platform "manylinux1_$WHEEL_ARCH" "$@"
}
if ! fresh $CACHE/wheelhouse "$wheels_key"; then
    say "wheels of the dependencies (pip download)"
    rm -rf $CACHE/wheelhouse $CACHE/wheelhouse.new
    mkdir -p $CACHE/wheelhouse.new
    printf '%s' "$REQUIREMENTS" >$CACHE/wheelhouse.new/requirements.txt
    pip_download --dest $CACHE/wheelhouse.new -r $CACHE/wheelhouse.new/requirements.txt
    mv $CACHE/wheelhouse.new $CACHE/wheelhouse
    record $CACHE/wheelhouse "$wheels_key"
fi
if ! fresh $CACHE/tools "$wheels_key"; then
    say "pip, setuptools and wheel (pip download)"
    rm -rf $CACHE/tools
    pip_download --dest $CACHE/tools pip "setuptools>=68" wheel
    cp $CACHE/tools/pip-*.whl $CACHE/pip.whl
    record $CACHE/tools "$wheels_key"
fi

# The cached inputs, linked into the build context (copied where links cannot be made).
rm -rf $OUT/rootfs.tar $OUT/wheelhouse $OUT/pip.whl
cp -al $CACHE/rootfs.tar $CACHE/wheelhouse $CACHE/pip.whl $OUT/ 2>/dev/null \
    || cp -a $CACHE/rootfs.tar $CACHE/wheelhouse $CACHE/pip.whl $OUT/

# -- the project's wheel, built from the sources without an index ---------------------------------
if ! fresh $OUT/app "$app_key"; then
    say "the project's wheel"
    rm -rf $OUT/app
    # Dates inside the wheel from the last commit, so unchanged sources give the same bytes.
    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct 2>/dev/null || echo 315532800) \
        python3 -m pip wheel --quiet --disable-pip-version-check --no-deps --no-index \
        --find-links $CACHE/tools --wheel-dir $OUT/app .
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
