"""`make demo`: watch GPU and Neuron faults travel from the kernel log to a remediation decision.

Runs examples/pipeline.py's real pipeline on loopback, runs `accel-health check` against gpu-node-1's
simulated GPUs and prints its table, writes three faults, prints the timeline and the remediator's
(dry-run) decisions, and stops everything again, also on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from typing import Any

from examples.closed_loop import Step, run_loop
from examples.pipeline import (
    DEMO_FAULTS,
    DEMO_GPUS,
    INTERRUPTED,
    Event,
    Outcome,
    Pipeline,
    PipelineError,
    fault_matches_alert,
    install_sigterm_handler,
    observe,
    scratch_dir,
)

WIDTH = 100


def say(text: str = "") -> None:
    print(text, flush=True)


def _pods(items: Sequence[dict[str, Any]], *, with_reason: bool) -> list[str]:
    lines = []
    for item in items:
        name = f"{item.get('namespace')}/{item.get('name')}"
        if with_reason:
            lines.append(f"{name}: {item.get('reason')}")
        else:
            owner = item.get("owner")
            lines.append(f"{name}" + (f" (owned by {owner})" if owner else ""))
    return lines


def print_decisions(outcome: Outcome) -> None:
    say()
    say("Decisions (DRY RUN: the remediator changed nothing; these are the calls it would make)")
    by_node: dict[str, list[dict[str, Any]]] = {}
    for record in outcome.decisions:
        by_node.setdefault(str(record.get("node")), []).append(record)
    for node, records in by_node.items():
        alerts = sorted({str(r.get("alertname")) for r in records})
        actions = [str(r.get("action")) for r in records]
        say(f"  {node}  <- {', '.join(alerts)}")
        say(f"    actions: {' + '.join(actions)}")
        for record in records:
            dry = "would be done (dry run)" if record.get("dry_run") else "done"
            outcome_text = str(record.get("outcome"))
            line = f"    - {record.get('action')}: {outcome_text}"
            if outcome_text in {"planned", "done"}:
                line += f", {dry}"
            if record.get("gate"):
                line += f", held by gate {record.get('gate')}"
            if record.get("reason"):
                line += f" -- {record.get('reason')}"
            say(line)
            details = record.get("details") or {}
            if record.get("action") == "drain":
                evict = _pods(details.get("evict", []), with_reason=False)
                say(f"        would evict {len(evict)} pod(s):")
                for pod in evict:
                    say(f"          {pod}")
                for key, title in (("skip", "skipped"), ("blocked", "would wait")):
                    entries = _pods(details.get(key, []), with_reason=True)
                    if entries:
                        say(f"        {title} {len(entries)} pod(s):")
                        for pod in entries:
                            say(f"          {pod}")


def print_application_xid(outcome: Outcome) -> None:
    for fault in DEMO_FAULTS:
        if fault.alert_labels:
            continue
        seen = next((e for e in outcome.events if e.kind == "series visible" and fault.query in e.text), None)
        fired = [a for a in outcome.firing if a.get("xid") == "13"]
        say()
        say(f"  {fault.title}:")
        when = f"at +{seen.at:.1f}s" if seen else "NOT SEEN"
        if fired:
            say(f"    counted ({when}) and ALERTED: {fired}")
        else:
            say(f"    counted by the exporter ({when}); no alert fired, so no node action was considered.")
        say("    Application Xids are the job's fault: the rules only warn when one GPU repeats them")
        say("    (5 within an hour), and never ask for a node action.")


def print_checks(pipeline: Pipeline) -> None:
    """Runs ``accel-health check`` on the demo's GPU node, as an operator would, and shows its table."""
    say()
    busy = ", ".join(str(gpu) for gpu in DEMO_GPUS.busy)
    say(f"Active checks on demand (simulated H100s; a training process holds GPU {busy}):")
    command = pipeline.check_command()
    say("  $ accel-health " + " ".join(command[1:]))
    result = pipeline.run_checks()
    for line in (result.stdout + result.stderr).rstrip().splitlines():
        say(f"  {line}".rstrip())
    say(f"  (exit status {result.returncode}; invasive checks never touch a GPU in use)")


def print_closed_loop() -> None:
    say()
    say("Closing the loop (acting for real on the cluster snapshot, in memory): the same fault on")
    say("gpu-node-1 takes it out; before the drain its evidence for the vendor (GPU serials and UUIDs,")
    say("the Xid line) is fetched from the exporter's GET /evidence and stored; its drain starts; it")
    say("reboots; the default post-repair checks (remapped, power) run through the exporter's")
    say("GET /checks; they pass and the node is back in the pool.")

    def show(step: Step) -> None:
        say(f"  +{step.at:6.3f}s  {step.text}")
        for line in step.detail.splitlines():
            say(f"      | {line}".rstrip())

    asyncio.run(run_loop(show))


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    install_sigterm_handler()
    started = time.monotonic()
    say("accel-health demo: kernel log -> exporter -> Prometheus -> Alertmanager -> remediator")
    say("Every part is the real program on 127.0.0.1; the remediator runs in DRY-RUN mode against the")
    say("cluster snapshot in examples/cluster-snapshot.yaml. Nothing outside this machine is touched.")
    say("=" * WIDTH)
    with scratch_dir() as workdir:
        pipeline = Pipeline(workdir=workdir)
        try:
            pipeline.start(
                on_started=lambda name, detail: say(
                    f"  {time.monotonic() - started:5.1f}s  started {name:<22} {detail}"
                )
            )
            say(f"  {time.monotonic() - started:5.1f}s  Prometheus is scraping both exporters")
            print_checks(pipeline)
            say()
            say("Timeline (seconds after the faults were written to the kernel logs)")

            def show(event: Event) -> None:
                say(f"  +{event.at:6.2f}s  {event.kind:<17} {event.text}")

            outcome = observe(pipeline, on_event=show)
            print_decisions(outcome)
            print_application_xid(outcome)
            stray = [a for a in outcome.firing if not any(fault_matches_alert(f, a) for f in DEMO_FAULTS)]
            if stray:
                say()
                say(f"  also firing: {', '.join(sorted({a['alertname'] for a in stray}))}")
            print_closed_loop()
            if INTERRUPTED.is_set():  # a Ctrl-C something swallowed: still a Ctrl-C
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            say("\ninterrupted: stopping every part of the pipeline")
            problems = pipeline.stop()
            for problem in problems:
                say(f"  {problem}")
            return 130
        except PipelineError as error:
            say(f"\nthe pipeline failed: {error}")
            pipeline.stop()
            return 1
        problems = pipeline.stop()
    say("=" * WIDTH)
    for problem in problems:
        say(f"  cleanup problem: {problem}")
    say(
        f"Demo finished in {time.monotonic() - started:.1f}s "
        f"(faults to last decision: {outcome.detection_seconds:.1f}s); "
        "every process stopped and every port released."
    )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
