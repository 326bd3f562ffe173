#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and driver (a GPU node, or a lent test machine): what the fake NVML and
# CUDA of `make test` stand in for, run for real. Needs python3 with pytest, hypothesis, pyyaml,
# aiohttp, nvidia-ml-py and cuda-bindings (no virtualenv of the project: a GPU machine may reach no
# package index); writes its logs to $OUT (default ./gpu-node-check). Steps:
#   1. the gpu-marked tests (real NVML through pynvml, real CUDA through cuda-bindings: pciebw, gpumem,
#      remapped, power, and dcgm where DCGM is installed);
#   2. the exporter as shipped (exporter.cli's main) with --nvml on against the real driver, its
#      fast and slow paths scraped (the accel_gpu_* series of every GPU) and its own collector health;
#   3. the active checks through the exporter's GET /checks, as the repair loop and `accel-health
#      check` ask for them (bearer token), with their figures.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-node-check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

{
    date -u
    nvidia-smi -L
    nvidia-smi --query-gpu=name,driver_version,pci.bus_id,memory.total,pcie.link.gen.max,pcie.link.width.max \
        --format=csv
    "$PY" --version
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"

echo "== 1. gpu-marked tests"
# --noconftest: the suite's shared conftest starts an AWS stand-in these tests do not use.
"$PY" -m pytest -c /dev/null --noconftest -p no:cacheprovider -m gpu -s -q -o addopts= \
    tests/checks/test_real_gpu.py tests/exporter/test_nvml.py 2>&1 | tee "$OUT/gpu-tests.log"

echo "== 2. the exporter with the real NVML"
port=19835
token="$OUT/checks-token"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$token"
kmsg="$OUT/kmsg"
: >"$kmsg"
"$PY" -c 'import sys; from exporter.cli import main; sys.exit(main())' --listen "127.0.0.1:$port" --kmsg "$kmsg" --nvml on --state-dir "$OUT/state" \
    --checks pciebw,gpumem,remapped,power --checks-token-file "$token" --checks-schedule off \
    >"$OUT/exporter.log" 2>&1 &
exporter=$!
trap 'kill $exporter 2>/dev/null; wait $exporter 2>/dev/null' EXIT
for _ in $(seq 1 60); do
    curl -sf "http://127.0.0.1:$port/metrics/slow" >"$OUT/metrics-slow.txt" && break
    sleep 0.5
done
curl -sf "http://127.0.0.1:$port/metrics/fast" >"$OUT/metrics-fast.txt"
for path in fast slow; do
    /usr/bin/time -f "scrape /metrics/$path: %e s" curl -sf -o /dev/null "http://127.0.0.1:$port/metrics/$path"
done 2>&1 | tee "$OUT/scrape-times.txt"
grep -E '^accel_(gpu_info|gpu_count|exporter_collector_up|gpu_power|gpu_temperature|gpu_memory)' \
    "$OUT/metrics-slow.txt" "$OUT/metrics-fast.txt" | head -40

echo "== 3. the active checks through GET /checks"
curl -sf -H "Authorization: Bearer $(cat "$token")" --max-time 600 \
    "http://127.0.0.1:$port/checks?check=remapped,power,pciebw,gpumem" | tee "$OUT/checks.json"
echo
