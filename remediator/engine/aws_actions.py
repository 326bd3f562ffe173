"""The AWS actions: mark the instance Unhealthy in its Auto Scaling group (or hand a node no group
replaces to its provisioner), reboot it, put a CloudWatch metric."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from remediator.cluster import Node, NodeCondition, instance_id_from_provider_id
from remediator.engine.model import ActionResult, Context
from remediator.engine.node_actions import NodeActions
from remediator.policy import AwsReboot, CloudWatchMetric
from remediator.repair import karpenter_managed, reboot_step, rebooted_annotation


class AwsActions(NodeActions):
    """AWS actions."""

    async def _aws_unhealthy(  # noqa: PLR0911  one return per outcome: skipped, deferred, handed over, done
        self, ctx: Context, node: Node, *, handover: str = "", why: str = ""
    ) -> ActionResult:
        instance = instance_id_from_provider_id(node.provider_id)
        if instance is None:
            return ActionResult(
                "skipped", f"no EC2 instance id in spec.providerID ({node.provider_id or 'empty'})"
            )
        hold = self.state.budget.holders().get(node.name)
        if hold is not None and "aws_set_unhealthy" in hold.kinds and hold.dry_run == ctx.dry_run:
            return ActionResult("skipped", f"{instance} already marked Unhealthy by accel-health")
        if (held := await self._gates(ctx, "aws_set_unhealthy", node.name)) is not None:
            return held
        details = {"instance_id": instance, **({"escalated": why} if why else {})}
        prefix = f"{why}; " if why else ""
        if handover and karpenter_managed(node):
            return await self._handover(ctx, node, handover, prefix, details)
        if not ctx.dry_run and not await self._aws.set_unhealthy(instance):
            if handover:
                return await self._handover(ctx, node, handover, prefix, details)
            return ActionResult(
                "skipped",
                f"{prefix}{instance} is in no Auto Scaling group (Karpenter or self-managed node): "
                "nothing marked, nothing replaces it; a human decides",
                details=details,
            )
        self._commit(ctx, "aws_set_unhealthy", node.name)
        text = f"{instance} Unhealthy in its Auto Scaling group (no grace period): it gets replaced"
        return self._done(ctx, f"{prefix}marked {text}", would=f"{prefix}would mark {text}", details=details)

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
            await self._cluster.set_condition(node.name, cond)
        self._commit(ctx, "aws_set_unhealthy", node.name)
        text = f"{condition_type}=False for the node's own provisioner (no Auto Scaling group call)"
        return self._done(
            ctx,
            f"{prefix}handed over: set {text}",
            would=f"{prefix}would hand over: set {text}",
            details={**details, "handover_condition": condition_type},
        )

    async def _aws_reboot(self, ctx: Context, node: Node, action: AwsReboot) -> ActionResult:
        instance = instance_id_from_provider_id(node.provider_id)
        if instance is None:
            return ActionResult(
                "skipped", f"no EC2 instance id in spec.providerID ({node.provider_id or 'empty'})"
            )
        step, why = reboot_step(node, action, now=self._clock())
        if step == "replace":
            return await self._aws_unhealthy(ctx, node, handover=action.handover_condition, why=why)
        if step == "wait":
            return ActionResult("skipped", why, details={"instance_id": instance})
        if (held := await self._gates(ctx, "aws_reboot", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._cluster.annotate_node(node.name, rebooted_annotation(node, now=self._clock()))
            await self._aws.reboot(instance)
        self._commit(ctx, "aws_reboot", node.name)
        return self._done(
            ctx,
            f"asked EC2 to reboot {instance} ({why})",
            would=f"would ask EC2 to reboot {instance} ({why})",
            details={"instance_id": instance},
        )

    async def _metric(self, ctx: Context, node: Node, action: CloudWatchMetric) -> ActionResult:
        dims = {"node": node.name, "alertname": ctx.alert.labels.get("alertname", "")}
        instance = instance_id_from_provider_id(node.provider_id)
        if instance:
            dims["InstanceId"] = instance
        if (held := await self._gates(ctx, "cloudwatch_metric", node.name)) is not None:
            return held
        if not ctx.dry_run:
            await self._aws.put_metric(
                namespace=action.namespace, name=action.metric_name, value=1.0, dimensions=dims
            )
        self._commit(ctx, "cloudwatch_metric", node.name)
        text = f"{action.namespace}/{action.metric_name}=1 {dims}"
        return self._done(
            ctx, f"put metric {text}", would=f"would put metric {text}", details={"dimensions": dims}
        )
