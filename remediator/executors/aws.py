"""The AWS executor: `remediator.cluster.Aws` over boto3 (Auto Scaling, EC2 and CloudWatch).

Calls are rare (a few per remediated node), so they run in a worker thread (`asyncio.to_thread`)
rather than through an asyncio AWS client. Retries are botocore's own: the `standard` mode (bounded
exponential backoff with jitter, retry quota) or `adaptive` (the same plus client-side rate
limiting after throttling); both retry throttling codes (`Throttling`, `ThrottlingException`,
`RequestLimitExceeded`, …) and 5xx answers such as Auto Scaling's `ResourceContention` (HTTP 500).
When they are spent, or the endpoint cannot be reached, `BackendUnavailable` is raised: the webhook
answers 503 and Alertmanager redelivers later. A refusal that retrying cannot fix (AccessDenied,
ValidationError, any other 4xx but throttling) raises `AwsRefused`: the engine records the action
as failed, and the delivery is answered 200 (no retry loop).

- `set_unhealthy` first checks membership with DescribeAutoScalingInstances (an instance that is in
  no Auto Scaling group cannot be marked: False is returned, and the engine records that nothing
  will replace it; a Karpenter or self-managed node), then calls
  SetInstanceHealth(Unhealthy) with `ShouldRespectGracePeriod` as configured (default False: a node
  with a broken accelerator is replaced even during the group's health-check grace period).
- `reboot` calls EC2 RebootInstances (the graceful step before a replacement: same instance, a new
  boot id; the remediator's repair loop then verifies the node and returns it to the pool).
- `put_metric` / `put_metrics` call PutMetricData, split into requests within the API's limits
  (1000 data points, 30 dimensions each, well under 1 MB per request).

Least-privilege IAM policy: deploy/README.md ("AWS permissions").
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import boto3
import botocore.config
import botocore.exceptions

from remediator.cluster import BackendUnavailable

logger = logging.getLogger("remediator.aws")

THROTTLING_CODES = frozenset(
    {"Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequestsException", "SlowDown"}
)
"""4xx codes that are worth retrying later (botocore retried them already)."""


class AwsRefused(RuntimeError):
    """AWS refused the call and retrying will not help (AccessDenied, ValidationError, ...)."""


DESCRIBE_BATCH = 50
"""DescribeAutoScalingInstances takes at most 50 instance ids."""
METRICS_PER_REQUEST = 1000
"""PutMetricData takes at most 1000 data points per request."""
MAX_DIMENSIONS = 30
"""A metric has at most 30 dimensions."""
REQUEST_BYTES_BUDGET = 900_000
"""PutMetricData requests stay under 1 MB; this leaves room for the envelope."""


DESCRIBED_SECONDS = 10.0
"""How long the group `health` found for an instance is used by the `set_unhealthy` that follows."""


@dataclass(frozen=True)
class AwsSettings:
    """How the AWS executor calls AWS."""

    region: str | None = None
    """AWS region; None takes it from the environment / instance metadata, like the AWS CLI."""
    endpoint_url: str | None = None
    """Override the service endpoint (VPC endpoints, or a local test server)."""
    retry_mode: Literal["standard", "adaptive"] = "standard"
    """botocore retry mode; `adaptive` also rate-limits the client after throttling."""
    max_attempts: int = 5
    """Attempts per call, first one included (botocore's total_max_attempts)."""
    connect_timeout_seconds: float = 5.0
    """TCP connect timeout per attempt."""
    read_timeout_seconds: float = 10.0
    """Read timeout per attempt."""
    respect_grace_period: bool = False
    """SetInstanceHealth's ShouldRespectGracePeriod. False: replace at once, even during the group's
    health-check grace period (a broken accelerator does not heal by waiting)."""
    namespace: str | None = None
    """CloudWatch namespace for every metric, overriding the policy's; None keeps the policy's."""
    extra_dimensions: Mapping[str, str] = field(default_factory=dict)
    """Dimensions added to every metric (e.g. {"Cluster": "prod-a"}); the caller's win on a clash."""


@dataclass(frozen=True)
class MetricDatum:
    """One PutMetricData data point."""

    name: str
    """MetricName."""
    value: float
    """Value."""
    dimensions: Mapping[str, str] = field(default_factory=dict)
    """Dimensions (at most 30)."""
    unit: str = "Count"
    """CloudWatch unit."""
    timestamp: datetime.datetime | None = None
    """When; None means now (set by CloudWatch)."""


class AwsExecutor:
    """remediator.cluster.Aws over boto3. `session` defaults to a new boto3.Session()."""

    def __init__(
        self,
        *,
        settings: AwsSettings | None = None,
        session: boto3.Session | None = None,
        on_call: Callable[[str, str], None] | None = None,
    ) -> None:
        self.settings = settings or AwsSettings()
        s = self.settings
        config = botocore.config.Config(
            region_name=s.region,
            retries={"mode": s.retry_mode, "total_max_attempts": s.max_attempts},
            connect_timeout=s.connect_timeout_seconds,
            read_timeout=s.read_timeout_seconds,
        )
        session = session or boto3.Session()
        self._autoscaling = session.client("autoscaling", endpoint_url=s.endpoint_url, config=config)
        self._cloudwatch = session.client("cloudwatch", endpoint_url=s.endpoint_url, config=config)
        self._ec2 = session.client("ec2", endpoint_url=s.endpoint_url, config=config)
        self._on_call = on_call
        self._described: dict[str, tuple[float, str]] = {}  # instance -> (when, its group), from health()
        self.not_in_group: list[str] = []
        """Instances that set_unhealthy found in no Auto Scaling group (newest last)."""

    async def _call(self, what: str, fn: Callable[..., Any], **kwargs: Any) -> Any:
        try:
            result = await asyncio.to_thread(fn, **kwargs)
        except botocore.exceptions.ClientError as exc:
            err = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(err.get("Code") or status)
            self._observe(what, code)
            text = f"AWS {what}: {err.get('Code', 'error')} (HTTP {status}): {err.get('Message', exc)}"
            if isinstance(status, int) and 400 <= status < 500 and code not in THROTTLING_CODES:
                raise AwsRefused(text) from exc
            raise BackendUnavailable(text) from exc
        except (botocore.exceptions.BotoCoreError, OSError) as exc:
            self._observe(what, type(exc).__name__)
            raise BackendUnavailable(f"AWS {what}: {exc}") from exc
        self._observe(what, "ok")
        return result

    def _observe(self, operation: str, outcome: str) -> None:
        if self._on_call is not None:
            self._on_call(operation, outcome)

    # -- Auto Scaling ----------------------------------------------------------------------------

    async def groups_of(self, instance_ids: Sequence[str]) -> dict[str, str]:
        """instance id -> Auto Scaling group name, for the instances that are in one (<=50 ids a call)."""
        found: dict[str, str] = {}
        ids = list(dict.fromkeys(instance_ids))
        for start in range(0, len(ids), DESCRIBE_BATCH):
            batch = ids[start : start + DESCRIBE_BATCH]
            token: str | None = None
            while True:
                kwargs: dict[str, Any] = {"InstanceIds": batch}
                if token:
                    kwargs["NextToken"] = token
                page = await self._call(
                    "DescribeAutoScalingInstances",
                    self._autoscaling.describe_auto_scaling_instances,
                    **kwargs,
                )
                for inst in page.get("AutoScalingInstances", []):
                    found[inst["InstanceId"]] = inst["AutoScalingGroupName"]
                token = page.get("NextToken")
                if not token:
                    break
        return found

    enabled = True
    """This seam calls AWS."""

    async def health(self, instance_id: str) -> str | None:
        """The instance's HealthStatus in its Auto Scaling group, or None when it is in no group. The
        group found is kept a few seconds, for the `set_unhealthy` that follows (one Describe, not two)."""
        page = await self._call(
            "DescribeAutoScalingInstances",
            self._autoscaling.describe_auto_scaling_instances,
            InstanceIds=[instance_id],
        )
        for inst in page.get("AutoScalingInstances", []):
            if inst.get("InstanceId") == instance_id:
                self._described[instance_id] = (time.monotonic(), str(inst["AutoScalingGroupName"]))
                return str(inst.get("HealthStatus", "Healthy"))
        self._described.pop(instance_id, None)
        return None

    async def set_unhealthy(self, instance_id: str) -> bool:
        """Mark the instance Unhealthy in its Auto Scaling group, which then replaces it. False when it
        is in no group (Karpenter, self-managed): nothing was marked and nothing will replace it."""
        seen = self._described.pop(instance_id, None)
        if seen is not None and time.monotonic() - seen[0] < DESCRIBED_SECONDS:
            groups = {instance_id: seen[1]}
        else:
            groups = await self.groups_of([instance_id])
        if instance_id not in groups:
            logger.warning("%s is in no Auto Scaling group; it cannot be marked Unhealthy", instance_id)
            self.not_in_group.append(instance_id)
            self._observe("SetInstanceHealth", "NotInAutoScalingGroup")
            return False
        await self._call(
            "SetInstanceHealth",
            self._autoscaling.set_instance_health,
            InstanceId=instance_id,
            HealthStatus="Unhealthy",
            ShouldRespectGracePeriod=self.settings.respect_grace_period,
        )
        logger.info("marked %s Unhealthy in Auto Scaling group %s", instance_id, groups[instance_id])
        return True

    # -- EC2 -------------------------------------------------------------------------------------

    async def reboot(self, instance_id: str) -> None:
        """RebootInstances of one instance; AwsRefused when EC2 refuses (unknown instance, no right)."""
        await self._call("RebootInstances", self._ec2.reboot_instances, InstanceIds=[instance_id])
        logger.info("asked EC2 to reboot %s", instance_id)

    # -- CloudWatch ------------------------------------------------------------------------------

    async def put_metric(
        self, *, namespace: str, name: str, value: float, dimensions: Mapping[str, str]
    ) -> None:
        """PutMetricData of one value."""
        await self.put_metrics(namespace=namespace, data=[MetricDatum(name, value, dimensions)])

    async def put_metrics(self, *, namespace: str, data: Sequence[MetricDatum]) -> int:
        """PutMetricData of many values, split within the API's limits; returns the requests made."""
        batches: list[list[dict[str, Any]]] = [[]]
        size = 0
        for datum in data:
            entry = self._datum(datum)
            cost = len(repr(entry))  # generous upper bound of the encoded size
            if len(batches[-1]) >= METRICS_PER_REQUEST or size + cost > REQUEST_BYTES_BUDGET:
                batches.append([])
                size = 0
            batches[-1].append(entry)
            size += cost
        requests = 0
        namespace = self.settings.namespace or namespace
        for batch in batches:
            if batch:
                await self._call(
                    "PutMetricData", self._cloudwatch.put_metric_data, Namespace=namespace, MetricData=batch
                )
                requests += 1
        return requests

    def _datum(self, datum: MetricDatum) -> dict[str, Any]:
        dims = {**self.settings.extra_dimensions, **datum.dimensions}
        if len(dims) > MAX_DIMENSIONS:
            raise ValueError(
                f"metric {datum.name}: {len(dims)} dimensions, CloudWatch allows {MAX_DIMENSIONS}"
            )
        entry: dict[str, Any] = {
            "MetricName": datum.name,
            "Value": float(datum.value),
            "Unit": datum.unit,
            "Dimensions": [{"Name": k, "Value": v} for k, v in dims.items() if v],
        }
        if datum.timestamp is not None:
            entry["Timestamp"] = datum.timestamp
        return entry
