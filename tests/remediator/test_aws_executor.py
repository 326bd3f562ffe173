"""The AWS executor against moto's server, with a fault-injecting HTTP proxy in front of it.

moto runs as a real HTTP server on 127.0.0.1 (reset between tests); the executor talks to it with
real boto3 clients. For throttling and ResourceContention the requests go through a small aiohttp
proxy that answers chosen operations with the error AWS would send, a set number of times, and
forwards everything else: botocore's retry modes are exercised over HTTP, nothing is patched.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import boto3
import pytest
from aiohttp import web

from remediator.cluster import BackendUnavailable, Node
from remediator.executors.aws import AwsExecutor, AwsRefused, AwsSettings, MetricDatum
from remediator.executors.snapshot import SnapshotCluster
from remediator.intake.payload import WebhookPayload, parse_payload
from remediator.lifecycle.engine import Engine
from remediator.lifecycle.model import EngineSettings
from remediator.policy import parse_policy

REGION = "us-west-2"
CREDENTIALS = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "aws_session_token": "t"}


def session() -> boto3.Session:
    return boto3.Session(region_name=REGION, **CREDENTIALS)


def aws_client(url: str, service: str) -> Any:
    return session().client(service, endpoint_url=url)


def make_group(url: str, *, name: str = "gpu-nodes", size: int = 2) -> list[str]:
    """An Auto Scaling group of `size` instances in moto; their ids."""
    ec2, asg = aws_client(url, "ec2"), aws_client(url, "autoscaling")
    ec2.create_launch_template(
        LaunchTemplateName=name, LaunchTemplateData={"ImageId": "ami-12c6146b", "InstanceType": "p5.48xlarge"}
    )
    asg.create_auto_scaling_group(
        AutoScalingGroupName=name,
        MinSize=size,
        MaxSize=size,
        DesiredCapacity=size,
        LaunchTemplate={"LaunchTemplateName": name},
        AvailabilityZones=[f"{REGION}a"],
    )
    found = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])["AutoScalingGroups"][0]
    return [i["InstanceId"] for i in found["Instances"]]


def health(url: str, instance_id: str) -> str:
    found = aws_client(url, "autoscaling").describe_auto_scaling_instances(InstanceIds=[instance_id])
    status: str = found["AutoScalingInstances"][0]["HealthStatus"]
    return status


def executor(url: str, **settings: Any) -> AwsExecutor:
    calls: list[tuple[str, str]] = []
    ex = AwsExecutor(
        settings=AwsSettings(region=REGION, endpoint_url=url, **settings),
        session=session(),
        on_call=lambda op, outcome: calls.append((op, outcome)),
    )
    ex.calls = calls  # type: ignore[attr-defined]  # test-only record of on_call
    return ex


# -- a fault-injecting proxy -----------------------------------------------------------------------

QUERY_ERROR = (
    '<ErrorResponse xmlns="https://autoscaling.amazonaws.com/doc/2011-01-01/"><Error><Type>{kind}</Type>'
    "<Code>{code}</Code><Message>{message}</Message></Error><RequestId>r-1</RequestId></ErrorResponse>"
)


@dataclass
class FaultProxy:
    """Forwards to moto, except that the next faults[operation] requests get an injected error."""

    target: str
    faults: dict[str, list[tuple[int, str]]] = field(default_factory=dict)
    seen: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        form = dict(pair.split("=", 1) for pair in body.decode().split("&") if "=" in pair)
        target = request.headers.get("X-Amz-Target", "")  # the JSON protocol names it here
        operation = form.get("Action") or target.rsplit(".", 1)[-1] or request.path.rsplit("/", 1)[-1]
        self.seen.append(operation)
        pending = self.faults.get(operation) or []
        if pending:
            status, code = pending.pop(0)
            kind = "Receiver" if status >= 500 else "Sender"
            if "Action" in form:
                text = QUERY_ERROR.format(kind=kind, code=code, message=f"injected {code}")
                return web.Response(status=status, text=text, content_type="text/xml")
            return web.Response(status=status)
        # aiohttp has already decompressed a gzipped body (botocore compresses large PutMetricData).
        drop = ("host", "content-length", "content-encoding")
        headers = {k: v for k, v in request.headers.items() if k.lower() not in drop}
        async with (
            aiohttp.ClientSession() as upstream,
            upstream.request(
                request.method, self.target + request.path_qs, data=body, headers=headers
            ) as resp,
        ):
            data = await resp.read()
            keep = {
                k: v for k, v in resp.headers.items() if k.lower() in ("content-type", "x-amzn-requestid")
            }
            return web.Response(status=resp.status, body=data, headers=keep)


@pytest.fixture
async def proxy(moto: str) -> AsyncIterator[FaultProxy]:
    fault_proxy = FaultProxy(target=moto)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", fault_proxy.handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    fault_proxy.url = f"http://127.0.0.1:{port}"
    try:
        yield fault_proxy
    finally:
        await runner.cleanup()


# -- Auto Scaling --------------------------------------------------------------------------------


async def test_an_instance_in_a_group_is_marked_unhealthy(moto: str) -> None:
    first, second = make_group(moto)
    ex = executor(moto)
    await ex.set_unhealthy(first)
    assert health(moto, first) == "Unhealthy"
    assert health(moto, second) == "Healthy"
    assert ex.calls == [("DescribeAutoScalingInstances", "ok"), ("SetInstanceHealth", "ok")]  # type: ignore[attr-defined]


async def test_an_instance_in_no_group_is_reported_not_marked(moto: str) -> None:
    make_group(moto)
    ex = executor(moto)
    await ex.set_unhealthy("i-0123456789abcdef0")
    assert ex.not_in_group == ["i-0123456789abcdef0"]
    assert ("SetInstanceHealth", "NotInAutoScalingGroup") in ex.calls  # type: ignore[attr-defined]
    assert ("SetInstanceHealth", "ok") not in ex.calls  # type: ignore[attr-defined]


async def test_an_instance_is_rebooted_and_an_unknown_one_is_a_refusal(moto: str) -> None:
    [instance] = make_group(moto, size=1)
    ex = executor(moto)
    await ex.reboot(instance)
    state = aws_client(moto, "ec2").describe_instances(InstanceIds=[instance])
    assert state["Reservations"][0]["Instances"][0]["State"]["Name"] == "running"  # same instance
    with pytest.raises(AwsRefused, match="InvalidInstanceID"):
        await ex.reboot("i-0123456789abcdef0")
    assert ex.calls == [("RebootInstances", "ok"), ("RebootInstances", "InvalidInstanceID.NotFound")]  # type: ignore[attr-defined]


async def test_an_access_denied_is_a_refusal_not_an_outage(proxy: FaultProxy) -> None:
    [instance, _] = make_group(proxy.target)
    proxy.faults["SetInstanceHealth"] = [(403, "AccessDenied")]
    ex = executor(proxy.url)
    with pytest.raises(AwsRefused, match="AccessDenied"):
        await ex.set_unhealthy(instance)
    assert proxy.seen.count("SetInstanceHealth") == 1  # not retried


async def test_through_the_engine_a_refusal_is_recorded_failed_and_answered_200(proxy: FaultProxy) -> None:
    [instance, _] = make_group(proxy.target)
    proxy.faults["SetInstanceHealth"] = [(400, "ValidationError")]
    engine = engine_with(executor(proxy.url), instance)
    await engine.handle(replace_alert())  # returns: the webhook answers 200, no redelivery loop
    record = engine.log.records()[-1]
    assert (record.action, record.outcome) == ("aws_set_unhealthy", "failed")
    assert "ValidationError" in record.reason


async def test_a_node_in_no_auto_scaling_group_is_not_said_to_be_replaced_and_gives_its_budget_back(
    moto: str,
) -> None:
    make_group(moto)
    engine = engine_with(executor(moto), "i-0123456789abcdef0")  # a Karpenter node
    await engine.handle(replace_alert())
    record = engine.log.records()[-1]
    assert (record.action, record.outcome) == ("aws_set_unhealthy", "skipped")
    assert "no Auto Scaling group" in record.reason
    assert "replaced" not in record.reason.replace("nothing replaces it", "")
    assert engine.budget.holders()["n1"].kinds == {"cordon"}
    cluster = engine_cluster(engine)
    await cluster.uncordon("n1")  # a human puts it back into service
    await engine.handle(replace_alert("n2"))  # the next delivery reconciles the budget
    assert "n1" not in engine.budget.holders()


def engine_with(aws: AwsExecutor, instance: str) -> Engine:
    nodes = [
        Node(name=n, provider_id=f"aws:///{REGION}a/{instance}", accelerators=("nvidia.com/gpu",))
        for n in ("n1", "n2", "n3", "n4")
    ]
    return Engine(
        policy=parse_policy(
            "safety: {max_disrupted_nodes: 1}\nrules:\n  - {name: r, actions: [cordon, aws_set_unhealthy]}\n"
        ),
        cluster=SnapshotCluster(nodes=nodes, pods=[], pdbs=[]),
        aws=aws,
        settings=EngineSettings(),
        clock=time.time,
    )


def engine_cluster(engine: Engine) -> SnapshotCluster:
    cluster = engine._cluster
    assert isinstance(cluster, SnapshotCluster)
    return cluster


def replace_alert(node: str = "n1") -> WebhookPayload:
    alert = {"labels": {"alertname": "AccelGPUFatalXid", "node": node}, "startsAt": "2025-11-22T20:00:00Z"}
    return parse_payload({"version": "4", "alerts": [alert]})


async def test_membership_is_looked_up_fifty_ids_at_a_time(proxy: FaultProxy) -> None:
    ids = make_group(proxy.target, size=3)
    unknown = [f"i-{n:017x}" for n in range(120)]
    ex = executor(proxy.url)
    groups = await ex.groups_of([*unknown, *ids])
    assert groups == dict.fromkeys(ids, "gpu-nodes")
    assert proxy.seen.count("DescribeAutoScalingInstances") == 3  # 123 ids: 50 + 50 + 23


async def test_throttling_and_resource_contention_are_retried_by_botocore(proxy: FaultProxy) -> None:
    [instance, _] = make_group(proxy.target)
    proxy.faults["SetInstanceHealth"] = [(400, "Throttling"), (500, "ResourceContention")]
    ex = executor(proxy.url, retry_mode="standard", max_attempts=4)
    await ex.set_unhealthy(instance)
    assert health(proxy.target, instance) == "Unhealthy"
    assert proxy.seen.count("SetInstanceHealth") == 3


async def test_adaptive_mode_retries_throttling_too(proxy: FaultProxy) -> None:
    [instance, _] = make_group(proxy.target)
    proxy.faults["DescribeAutoScalingInstances"] = [(400, "Throttling")]
    ex = executor(proxy.url, retry_mode="adaptive", max_attempts=3)
    await ex.set_unhealthy(instance)
    assert health(proxy.target, instance) == "Unhealthy"


async def test_throttling_past_the_attempts_becomes_backend_unavailable(proxy: FaultProxy) -> None:
    [instance, _] = make_group(proxy.target)
    proxy.faults["SetInstanceHealth"] = [(400, "Throttling")] * 2
    ex = executor(proxy.url, max_attempts=2)
    with pytest.raises(BackendUnavailable, match="Throttling"):
        await ex.set_unhealthy(instance)
    assert health(proxy.target, instance) == "Healthy"


async def test_an_unreachable_endpoint_becomes_backend_unavailable() -> None:
    ex = executor("http://127.0.0.1:9", max_attempts=1, connect_timeout_seconds=1)
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="DescribeAutoScalingInstances"):
        await ex.set_unhealthy("i-0123456789abcdef0")
    assert time.monotonic() - started < 5


# -- CloudWatch ----------------------------------------------------------------------------------


async def test_a_metric_is_put_with_its_dimensions_and_the_configured_extras(moto: str) -> None:
    ex = executor(moto, extra_dimensions={"Cluster": "prod-a"})
    await ex.put_metric(
        namespace="AccelHealth", name="NodeFaults", value=1.0, dimensions={"node": "gpu-1", "alertname": ""}
    )
    [metric] = aws_client(moto, "cloudwatch").list_metrics(Namespace="AccelHealth")["Metrics"]
    assert metric["MetricName"] == "NodeFaults"
    assert sorted((d["Name"], d["Value"]) for d in metric["Dimensions"]) == [
        ("Cluster", "prod-a"),
        ("node", "gpu-1"),
    ]


async def test_many_metrics_are_batched_a_thousand_per_request(proxy: FaultProxy) -> None:
    ex = executor(proxy.url)
    data = [MetricDatum("NodeFaults", 1.0, {"node": f"gpu-{n}"}) for n in range(2500)]
    assert await ex.put_metrics(namespace="AccelHealth", data=data) == 3
    assert proxy.seen.count("PutMetricData") == 3
    listed = (
        aws_client(proxy.target, "cloudwatch").get_paginator("list_metrics").paginate(Namespace="AccelHealth")
    )
    assert sum(len(page["Metrics"]) for page in listed) == 2500


async def test_a_throttled_put_is_retried(proxy: FaultProxy) -> None:
    proxy.faults["PutMetricData"] = [(503, "ServiceUnavailable")]
    ex = executor(proxy.url)
    await ex.put_metric(namespace="AccelHealth", name="NodeFaults", value=1.0, dimensions={"node": "gpu-1"})
    assert proxy.seen.count("PutMetricData") == 2
    assert aws_client(proxy.target, "cloudwatch").list_metrics(Namespace="AccelHealth")["Metrics"]


async def test_more_than_thirty_dimensions_are_refused_before_any_call(moto: str) -> None:
    ex = executor(moto)
    dims = {f"d{n}": "x" for n in range(31)}
    with pytest.raises(ValueError, match="31 dimensions"):
        await ex.put_metric(namespace="AccelHealth", name="NodeFaults", value=1.0, dimensions=dims)
