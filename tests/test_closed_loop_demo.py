"""The demo's closed loop (examples/closed_loop.py) on the cluster snapshot: the node taken out for
the fallen-off-the-bus GPU is drained, rebooted, verified by the exporter's checks over HTTP and back
in the pool, in that order, and the timeline says so."""

from __future__ import annotations

from examples.closed_loop import run_loop


async def test_the_demo_node_goes_out_reboots_passes_its_checks_and_comes_back() -> None:
    steps = [s.text for s in await run_loop()]
    order = [
        next(i for i, text in enumerate(steps) if marker in text)
        for marker in (
            "cordon -> done",
            "drain -> started",
            "quarantine -> done",
            "reboot    (in the snapshot)",
            "alert     resolved",
            "return_to_pool -> done",
        )
    ]
    assert order == sorted(order)
    assert "checks remapped, power passed; uncordoned" in steps[order[-1]]
    assert steps[-1].endswith("AcceleratorHealthy=True (RepairVerified): back in the pool")
    assert "unschedulable=False" in steps[-1]
