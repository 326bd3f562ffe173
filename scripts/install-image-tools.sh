#!/usr/bin/env bash
# Installs what `make image` and `make image-test` run, from Debian, only where missing: mmdebstrap
# (the base root filesystem from Debian packages), buildah (builds the Containerfile), umoci and runc
# (unpack and run the built image in the smoke test) and skopeo (copies the image to a registry).
set -euo pipefail
need=()
for tool in mmdebstrap buildah umoci runc skopeo; do
    command -v "$tool" >/dev/null || need+=("$tool")
done
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO="sudo"
echo "installing ${need[*]} (Debian packages)" >&2
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
