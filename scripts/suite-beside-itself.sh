#!/usr/bin/env bash
# `make test` on two fresh clones of this checkout's HEAD at once, RUNS times in a row each (default
# 3): the suite must pass while another copy of it loads the machine (no fixed sleeps, no bounds in
# seconds that a loaded machine misses). Each clone gets ../shared beside it when this checkout has
# one. Prints a line per run; exits 1 when any run failed. Logs stay in the printed folder.
set -u
RUNS=${1:-3}
here="$(cd "$(dirname "$0")/.." && pwd)"
root="$(mktemp -d "${TMPDIR:-/tmp}/accel-health-beside.XXXXXX")"
for d in a b; do
    git clone -q "$here" "$root/$d/main"
    git -C "$root/$d/main" checkout -q "$(git -C "$here" rev-parse HEAD)"
    [ -d "$here/../shared" ] && ln -s "$(cd "$here/../shared" && pwd)" "$root/$d/shared"
done
echo "two clones of $(git -C "$here" rev-parse --short HEAD) in $root, $RUNS runs each"
run() {
    local d=$1 i rc t0
    for i in $(seq 1 "$RUNS"); do
        t0=$SECONDS
        (cd "$root/$d/main" && make test) >"$root/$d-$i.log" 2>&1
        rc=$?
        echo "clone $d, run $i: exit $rc in $((SECONDS - t0)) s: $(grep -E '[0-9]+ passed' "$root/$d-$i.log" | tail -1)" \
            | tee -a "$root/summary"
    done
}
run b &
run a
wait
! grep -q "exit [1-9]" "$root/summary"
