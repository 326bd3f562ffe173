"""The demo's closed loop (examples/closed_loop.py) on the cluster snapshot: the node taken out for
the fallen-off-the-bus GPU has its evidence captured from the exporter's GET /evidence before the
drain and the reboot, is drained, rebooted, verified by the exporter's checks over HTTP and back in
the pool, in that order, and the timeline says so, with the evidence report."""

from __future__ import annotations

from examples.closed_loop import run_loop


async def test_the_demo_node_goes_out_reboots_passes_its_checks_and_comes_back() -> None:
    steps = [s.text for s in await run_loop()]
    order = [
        next(i for i, text in enumerate(steps) if marker in text)
        for marker in (
            "cordon -> done",
            "evidence -> done",
            "drain -> started",
            "quarantine -> done",
            "evidence  stored at memory/gpu-node-1/",
            "reboot    (in the snapshot)",
            "alert     resolved",
            "return_to_pool -> done",
        )
    ]
    assert order == sorted(order)
    assert "checks remapped, power passed; uncordoned" in steps[order[-1]]
    assert steps[-1].endswith("AcceleratorHealthy=True (RepairVerified): back in the pool")
    assert "unschedulable=False" in steps[-1]


async def test_the_evidence_report_captured_before_the_reboot_names_the_xid_line_and_gpu_4() -> None:
    steps = await run_loop()
    shown = next(i for i, s in enumerate(steps) if s.detail)
    reboot = next(i for i, s in enumerate(steps) if s.text.startswith("reboot "))
    assert shown < reboot
    report = steps[shown].detail.splitlines()
    assert report[0] == "Evidence for node gpu-node-1"
    assert any("boot id" in line and "7c1e3f0a-5d2b-4e8f-9a61-000000000001" in line for line in report)
    xid = "NVRM: Xid (PCI:0000:9d:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus."
    assert any(line.endswith(xid) for line in report)
    gpu4 = next(line.split() for line in report if "0000:9d:00" in line and "GPU-" in line)
    assert gpu4[:3] == ["4", "1654923000004", "GPU-575a9c5f-780e-558f-99bc-3b0f90f7dbd5"]
    assert [s for s in steps if s.detail] == [steps[shown]]
