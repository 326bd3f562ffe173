"""The AWS actions: mark the instance Unhealthy in its Auto Scaling group (or hand a node no group
replaces to its provisioner), reboot it, put a CloudWatch metric.

An AWS call and the node write that records it cannot be one request, so the intent is written first
(the node's record says the step was asked for, in the write that also carries what happened before
it), then the call is made. A leader that finds an intent it did not see done itself (a fail-over
between the two) reads the instance's state before it calls again: an instance already Unhealthy, or
gone from its group, is not marked twice."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from remediator.actuators.nodes import done
from remediator.cluster import Aws, Node, NodeCondition, NodeWrites, instance_id_from_provider_id
from remediator.gates.gates import Gates
from remediator.lifecycle.model import ActionResult, Context
from remediator.lifecycle.repair import karpenter_managed, reboot_step, rebooted_annotation, rebooted_boot_id
from remediator.policy import AwsReboot, CloudWatchMetric

OFF = (
    "AWS calls are off (the remediator runs without --aws): {what}; the aws overlay "
    "(deploy/overlays/aws) turns them on"
)


class AwsActuator:
    """Auto Scaling, EC2 and CloudWatch actions, through the gates."""

    def __init__(self, *, aws: Aws, nodes: NodeWrites, gates: Gates, clock: Callable[[], float]) -> None:
        self._aws = aws
        self._cluster = nodes
        self._gates = gates
        self._clock = clock
        self._confirmed: set[tuple[str, str]] = set()
        """(node, boot id) whose reboot call this process saw succeed."""
        self._failed: set[tuple[str, str]] = set()
        """(node, boot id) whose reboot call this process saw fail (asked again at once)."""

    async def unhealthy(  # noqa: PLR0911  one return per outcome: skipped, deferred, handed over, done
        self, ctx: Context, node: Node, *, handover: str = "", why: str = ""
    ) -> ActionResult:
        instance = instance_id_from_provider_id(node.provider_id)
        if instance is None:
            return ActionResult(
                "skipped", f"no EC2 instance id in spec.providerID ({node.provider_id or 'empty'})"
            )
        asked = bool(ctx.intent >> ctx.index & 1)  # this episode asked before (a fail-over since)
        hold = self._gates.budget.holders().get(node.name)
        if (
            not asked
            and hold is not None
            and "aws_set_unhealthy" in hold.kinds
            and hold.dry_run == ctx.dry_run
        ):
            return ActionResult("skipped", f"{instance} already marked Unhealthy by accel-health")
        details = {"instance_id": instance, **({"escalated": why} if why else {})}
        prefix = f"{why}; " if why else ""
        if asked and handover and _handed_over(node, handover):
            return self._marked(
                ctx, node, prefix, details, f"{handover}=False already set (asked for before)", told=True
            )
        if not asked and (held := self._gates.check(ctx, "aws_set_unhealthy", node.name)) is not None:
            return held
        if handover and karpenter_managed(node):
            return await self._handover(ctx, node, handover, prefix, details)
        if not self._aws.enabled:
            words = "would skip: " if ctx.dry_run else ""
            return ActionResult(
                "skipped", words + OFF.format(what="nothing marked, nothing replaces the node")
            )
        if ctx.dry_run:
            return self._marked(ctx, node, prefix, details)
        state = await self._aws.health(instance)
        if state is None:
            if handover:
                return await self._handover(ctx, node, handover, prefix, details)
            return ActionResult(
                "skipped",
                f"{prefix}{instance} is in no Auto Scaling group (Karpenter or self-managed node): "
                "nothing marked, nothing replaces it; a human decides",
                details=details,
            )
        if state != "Healthy" and asked:
            return self._marked(
                ctx, node, prefix, details, f"already {state} (asked for before a fail-over)", told=True
            )
        if state != "Healthy":
            return ActionResult(
                "skipped", f"{instance} is already {state} in its Auto Scaling group (not by accel-health)"
            )
        # The intent first: a fail-over after this write reads the instance's state before calling.
        await self._cluster.annotate_node(
            node.name, {}, record=ctx.record("aws_set_unhealthy", self._clock())
        )
        if not await self._aws.set_unhealthy(instance) and handover:
            return await self._handover(ctx, node, handover, prefix, details)
        return self._marked(ctx, node, prefix, details)

    def _marked(
        self,
        ctx: Context,
        node: Node,
        prefix: str,
        details: Mapping[str, Any],
        how: str = "",
        *,
        told: bool = False,
    ) -> ActionResult:
        """`told`: asked for before (an earlier leader), whose Event told of it then."""
        self._gates.commit(ctx, "aws_set_unhealthy", node.name)
        details = {**details, "resumed": True} if told else details
        instance = details["instance_id"]
        text = f"{instance} Unhealthy in its Auto Scaling group (no grace period): it gets replaced"
        suffix = f" ({how})" if how else ""
        return done(
            ctx, f"{prefix}marked {text}{suffix}", would=f"{prefix}would mark {text}", details=details
        )

    async def _handover(
        self, ctx: Context, node: Node, condition_type: str, prefix: str, details: Mapping[str, Any]
    ) -> ActionResult:
        """A node no Auto Scaling group replaces: the condition its own provisioner's repair acts on."""
        alertname = ctx.alert.labels.get("alertname", "AcceleratorFault")
        cond = NodeCondition(
            type=condition_type,
            status="False",
            reason=alertname,
            message=(
                f"accelerator fault ({alertname}): accel-health hands the node to its provisioner's repair"
            ),
        )
        if not ctx.dry_run:
            await self._cluster.set_condition(
                node.name, cond, record=ctx.record("aws_set_unhealthy", self._clock())
            )
        self._gates.commit(ctx, "aws_set_unhealthy", node.name)
        text = f"{condition_type}=False for the node's own provisioner (no Auto Scaling group call)"
        return done(
            ctx,
            f"{prefix}handed over: set {text}",
            would=f"{prefix}would hand over: set {text}",
            details={**details, "handover_condition": condition_type},
        )

    async def reboot(  # noqa: PLR0911  one return per outcome: skipped, waits, escalated, deferred, done
        self, ctx: Context, node: Node, action: AwsReboot
    ) -> ActionResult:
        """Reboot the instance through EC2: the intent (the `rebooted` annotation, with the step in
        the node's record) is written first, then the call is made. A step whose intent is recorded
        but whose call this process did not see succeed (it failed, or another leader made it) is
        looked at again: a new boot id means the reboot happened; the same one means it is asked for
        again (a second request of a reboot costs nothing; a reboot never asked for strands the node)."""
        instance = instance_id_from_provider_id(node.provider_id)
        if instance is None:
            return ActionResult(
                "skipped", f"no EC2 instance id in spec.providerID ({node.provider_id or 'empty'})"
            )
        asked = bool(ctx.intent >> ctx.index & 1)
        if asked:
            return await self._reboot_again(ctx, node, instance, action)
        step, why = reboot_step(node, action, now=self._clock())
        if step == "replace":
            return await self.unhealthy(ctx, node, handover=action.handover_condition, why=why)
        if step == "wait":
            return ActionResult("skipped", why, details={"instance_id": instance})
        if not self._aws.enabled:
            words = "would skip: " if ctx.dry_run else ""
            return ActionResult("skipped", words + OFF.format(what=f"{instance} not rebooted"))
        if (held := self._gates.check(ctx, "aws_reboot", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.annotate_node(
                node.name,
                rebooted_annotation(node, now=self._clock()),
                record=ctx.record("aws_reboot", self._clock()),
            )
            await self._call_reboot(node, instance)
        self._gates.commit(ctx, "aws_reboot", node.name)
        return done(
            ctx,
            f"asked EC2 to reboot {instance} ({why})",
            would=f"would ask EC2 to reboot {instance} ({why})",
            details={"instance_id": instance},
        )

    async def _call_reboot(self, node: Node, instance: str) -> None:
        key = (node.name, node.boot_id)
        try:
            await self._aws.reboot(instance)
        except BaseException:
            self._failed.add(key)
            raise
        self._failed.discard(key)
        self._confirmed.add(key)

    async def _reboot_again(self, ctx: Context, node: Node, instance: str, action: AwsReboot) -> ActionResult:
        """The node's record says the reboot was asked for; this process did not see the call go
        through. Read the state (the boot id the intent recorded), then call again or not: a call
        this process saw fail is made again; one an earlier leader made (or died before making: it
        cannot tell) is waited for until the node could have booted (REBOOT_PATIENCE_SECONDS, as a
        new episode waits), so that a fail-over does not reboot the node a second time."""
        details = {"instance_id": instance}
        if (node.name, node.boot_id) in self._confirmed:
            return ActionResult("skipped", f"reboot of {instance} asked for already", details=details)
        recorded = rebooted_boot_id(node)
        if recorded is not None and recorded != node.boot_id:
            self._gates.commit(ctx, "aws_reboot", node.name, rate=False)
            return done(
                ctx,
                f"{instance} rebooted (asked for before; a new boot id since)",
                would="",
                details={**details, "resumed": True},  # the Event of the call told of it
            )
        if (node.name, node.boot_id) not in self._failed:
            step, why = reboot_step(node, action, now=self._clock())
            if step == "wait":
                self._gates.commit(ctx, "aws_reboot", node.name, rate=False)
                return ActionResult(
                    "skipped",
                    f"{why} (asked for before a fail-over): waiting for it to boot, not rebooted again",
                    details=details,
                )
        if not self._aws.enabled:
            return ActionResult("skipped", OFF.format(what=f"{instance} not rebooted"))
        await self._call_reboot(node, instance)  # the intent is on the node already
        self._gates.commit(ctx, "aws_reboot", node.name, rate=False)
        return done(
            ctx,
            f"asked EC2 to reboot {instance} again: the reboot was asked for before and the node has "
            "not booted since (the earlier call failed, or its outcome is unknown after a fail-over)",
            would="",
            details=details,
        )

    async def metric(self, ctx: Context, node: Node, action: CloudWatchMetric) -> ActionResult:
        dims = {"node": node.name, "alertname": ctx.alert.labels.get("alertname", "")}
        instance = instance_id_from_provider_id(node.provider_id)
        if instance:
            dims["InstanceId"] = instance
        if not self._aws.enabled:
            words = "would skip: " if ctx.dry_run else ""
            return ActionResult("skipped", words + OFF.format(what="no metric published"))
        if (held := self._gates.check(ctx, "cloudwatch_metric", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._aws.put_metric(
                namespace=action.namespace, name=action.metric_name, value=1.0, dimensions=dims
            )
        self._gates.commit(ctx, "cloudwatch_metric", node.name)
        text = f"{action.namespace}/{action.metric_name}=1 {dims}"
        return done(ctx, f"put metric {text}", would=f"would put metric {text}", details={"dimensions": dims})


def _handed_over(node: Node, condition_type: str) -> bool:
    return any(c.type == condition_type and c.status == "False" for c in node.conditions)
