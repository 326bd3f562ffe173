#!/usr/bin/env bash
# Prints the figures README gives for the image `make image` built: its size uncompressed and as a
# registry stores it (gzip layers), what takes the space, and how soon the exporter serves its first
# scrape after `runc run` (five starts, on the fixture node examples/nodes/gpu-node-1). Needs root
# (runc), skopeo, umoci, runc and curl.
set -euo pipefail
cd "$(dirname "$0")/../.."
eval "$(python3 -c 'import tomllib; d = tomllib.load(open("pyproject.toml", "rb")); print("NAME=" + d["tool"]["accel-health"]["image"]["name"], "VERSION=" + d["project"]["version"])')"
IMAGE=${IMAGE:-$NAME}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

skopeo copy --quiet "containers-storage:$IMAGE:$VERSION" "oci:$work/oci:$VERSION"
umoci unpack --image "$work/oci:$VERSION" "$work/bundle" 2>/dev/null
root=$work/bundle/rootfs
site=$(echo "$root"/opt/accel-health/lib/python3*/site-packages)
compressed=$(python3 - "$work/oci" <<'EOF'
import json, sys, pathlib
oci = pathlib.Path(sys.argv[1])
index = json.loads((oci / "index.json").read_text())
blob = lambda d: oci / "blobs" / d["digest"].replace(":", "/")
manifest = json.loads(blob(index["manifests"][0]).read_text())
print(sum(layer["size"] for layer in manifest["layers"]))
EOF
)
mb() { awk -v b="$1" 'BEGIN { printf "%.1f MB", b / 1e6 }'; }
size() { du -sb "$@" | awk '{ s += $1 } END { print s }'; }
echo "image $IMAGE:$VERSION"
echo "  uncompressed: $(mb "$(size "$root")")   compressed (gzip layers): $(mb "$compressed")"
echo "  Python standard library:        $(mb "$(size "$root"/usr/lib/python3*)")"
echo "  other Debian files (libc, ...): $(mb $(( $(size "$root"/usr "$root"/etc "$root"/var) - $(size "$root"/usr/lib/python3*) )))"
for pkg in kubernetes aiohttp pydantic_core pydantic botocore boto3 yaml exporter remediator; do
    printf '  %-31s %s\n' "$pkg:" "$(mb "$(size "$site/$pkg")")"
done

port=19835
config=$work/bundle/config.json
python3 - "$config" "$PWD/examples/nodes/gpu-node-1" "$port" <<'EOF'
import json, sys
path, node, port = sys.argv[1:]
config = json.load(open(path))
config["process"]["args"] = ["accel-health-exporter", f"--listen=127.0.0.1:{port}", "--kmsg=/node/kmsg",
                             "--sysfs-root=/node/sys", "--nvml=auto"]
config["process"]["terminal"] = False
config["root"]["readonly"] = True
config["linux"]["namespaces"] = [n for n in config["linux"]["namespaces"] if n["type"] != "network"]
config["mounts"].append({"destination": "/node", "type": "bind", "source": node, "options": ["rbind", "ro"]})
json.dump(config, open(path, "w"))
EOF
times=()
for i in 1 2 3 4 5; do
    name=accel-health-measure-$$-$i
    start=$(date +%s.%N)
    runc run --bundle "$work/bundle" "$name" >/dev/null 2>&1 &
    until curl -sf -o /dev/null "http://127.0.0.1:$port/metrics"; do sleep 0.01; done
    times+=("$(echo "$(date +%s.%N) - $start" | bc)")
    runc kill "$name" KILL 2>/dev/null || true
    wait || true
    runc delete -f "$name" 2>/dev/null || true
done
echo "  exporter first scrape after runc run (s): ${times[*]}"
