"""The kustomize overlays as an operator applies them: rendered by `kubectl kustomize`, every object
validated against the Kubernetes schema (custom resources structurally, their rules by promtool and
their routing by amtool), and the properties the design relies on asserted one by one."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from exporter.checks.catalog import KNOWN
from exporter.cli import _parser as exporter_parser
from remediator.cli import _serve_parser as remediator_parser
from remediator.policy import AwsReboot, CloudWatchMetric, load_policy, parse_policy
from scripts.render_manifests import REMEDIATOR_RECEIVER, TOKEN_SECRET
from tests.deploy.kube import DEPLOY, OVERLAYS, REPO, containers, find, kubectl_problem, render

pytestmark = pytest.mark.skipif(kubectl_problem() is not None, reason=str(kubectl_problem()))

KUBERNETES_VERSIONS = ("1.27", "1.32")
"""Oldest supported (PDB unhealthyPodEvictionPolicy is on by default from 1.27) and a current one."""
CUSTOM_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule", "AlertmanagerConfig"}
RELABEL_ACTIONS = {"replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep", "lowercase"}
RELABEL_ACTIONS |= {"uppercase", "keepequal", "dropequal"}
MATCH_TYPES = {"=", "!=", "=~", "!~"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict[str, Any]]]:
    return {overlay: render(DEPLOY / "overlays" / overlay) for overlay in OVERLAYS}


def _all(rendered: dict[str, list[dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(overlay, obj) for overlay, objects in rendered.items() for obj in objects]


# -- schema ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_builtin_object_is_valid_against_the_kubernetes_schema(
    rendered: dict[str, list[dict[str, Any]]], version: str
) -> None:
    problems = []
    for overlay, obj in _all(rendered):
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            problems.append(f"{overlay}: {obj['kind']}/{obj['metadata']['name']} at {where}: {exc.message}")
    assert not problems, "\n".join(problems)


def test_every_overlay_renders_the_whole_system(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objects in rendered.values():
        kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
        assert ("DaemonSet", "accel-health-exporter") in kinds
        assert ("Deployment", "accel-health-remediator") in kinds
        assert {k for k, _ in kinds} >= CUSTOM_KINDS | {"PodDisruptionBudget", "NetworkPolicy", "Secret"}
        names = [(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objects]
        assert len(names) == len(set(names)), "duplicate objects"


def test_custom_resources_have_the_fields_the_operator_requires(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for _overlay, obj in _all(rendered):
        kind, spec = obj["kind"], obj.get("spec", {})
        if kind not in CUSTOM_KINDS:
            continue
        assert obj["metadata"]["namespace"] == "accel-health"
        if kind in {"ServiceMonitor", "PodMonitor"}:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert spec["selector"]["matchLabels"]
            endpoints = spec["endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"]
            for endpoint in endpoints:
                assert endpoint["port"]
                # The exporter's fast path at the latency budget's 2 s (alerts/README.md), its slow
                # path at 60 s, the remediator at 10 s.
                expected = {"/metrics/fast": "2s", "/metrics/slow": "60s", "/metrics": "10s"}
                assert endpoint["interval"] == expected[endpoint["path"]]
                for relabel in endpoint.get("relabelings", []):
                    assert relabel.get("action", "replace") in RELABEL_ACTIONS
                    assert re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", relabel["targetLabel"])
        elif kind == "PrometheusRule":
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert spec["groups"]
        else:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1alpha1"
            names = {r["name"] for r in spec["receivers"]}
            routes = [spec["route"], *spec["route"].get("routes", [])]
            assert all(r.get("receiver", spec["route"]["receiver"]) in names for r in routes)
            for route in routes:
                for matcher in route.get("matchers", []):
                    assert set(matcher) == {"name", "value", "matchType"}
                    assert matcher["matchType"] in MATCH_TYPES


# -- what promtool and amtool say -----------------------------------------------------------------


def _tool(name: str) -> str:
    path = shutil.which(name)
    assert path is not None, f"{name} is not installed"
    return path


needs_promtool = pytest.mark.skipif(
    not shutil.which("promtool"), reason="promtool missing (make test installs it)"
)
needs_amtool = pytest.mark.skipif(not shutil.which("amtool"), reason="amtool missing (make test installs it)")


@needs_promtool
def test_promtool_accepts_the_rendered_prometheusrule(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    for overlay, objects in rendered.items():
        rules = tmp_path / f"{overlay}.rules.yaml"
        rules.write_text(
            yaml.safe_dump({"groups": find(objects, "PrometheusRule", "accel-health")["spec"]["groups"]})
        )
        out = subprocess.run(
            [_tool("promtool"), "check", "rules", str(rules)], capture_output=True, text=True, check=False
        )
        assert out.returncode == 0, out.stdout + out.stderr


def _matcher_text(matcher: dict[str, str]) -> str:
    value = matcher["value"].replace("\\", "\\\\").replace('"', '\\"')
    return f'{matcher["name"]}{matcher["matchType"]}"{value}"'


def _route_from_crd(route: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if "receiver" in route:
        out["receiver"] = route["receiver"]
    out["matchers"] = [_matcher_text(m) for m in route.get("matchers", [])]
    for camel, snake in (
        ("groupBy", "group_by"),
        ("groupWait", "group_wait"),
        ("groupInterval", "group_interval"),
    ):
        if camel in route:
            out[snake] = route[camel]
    if "repeatInterval" in route:
        out["repeat_interval"] = route["repeatInterval"]
    if route.get("routes"):
        out["routes"] = [_route_from_crd(r) for r in route["routes"]]
    return out


def alertmanager_yaml_from_crd(crd: dict[str, Any]) -> dict[str, Any]:
    """The configuration the Operator builds from the object, under a root route like the example's:
    the object's route first, with `continue: true` and a namespace matcher, then the cluster's own."""
    spec = crd["spec"]
    namespace_matcher = f'namespace="{crd["metadata"]["namespace"]}"'
    ours = _route_from_crd(spec["route"])
    ours["matchers"].append(namespace_matcher)
    ours["continue"] = True
    receivers: list[dict[str, Any]] = [{"name": "humans"}]
    for receiver in spec["receivers"]:
        hooks = []
        for hook in receiver["webhookConfigs"]:
            auth = hook["httpConfig"]["authorization"]
            assert auth["credentials"] == {"name": TOKEN_SECRET, "key": "token"}
            hooks.append(
                {
                    "url": hook["url"],
                    "send_resolved": hook["sendResolved"],
                    "http_config": {
                        "authorization": {"type": auth["type"], "credentials": "from-the-secret"}
                    },
                }
            )
        receivers.append({"name": receiver["name"], "webhook_configs": hooks})
    inhibit = [
        {
            "source_matchers": [_matcher_text(m) for m in rule["sourceMatch"]] + [namespace_matcher],
            "target_matchers": [_matcher_text(m) for m in rule["targetMatch"]] + [namespace_matcher],
            "equal": rule["equal"],
        }
        for rule in spec.get("inhibitRules", [])
    ]
    return {
        "route": {
            "receiver": "humans",
            "group_by": ["node", "alertname"],
            "routes": [ours, {"receiver": "humans"}],
        },
        "receivers": receivers,
        "inhibit_rules": inhibit,
    }


def _routes_for(config: Path, labels: dict[str, str]) -> set[str]:
    argv = [_tool("amtool"), "config", "routes", "test", f"--config.file={config}"]
    argv += [f"{k}={v}" for k, v in labels.items()]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    assert out.returncode == 0, f"{shlex.join(argv)}: {out.stderr}"
    return set(out.stdout.strip().split(","))


@needs_amtool
def test_amtool_accepts_the_alertmanagerconfig_and_it_routes_like_the_example(
    rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    crd = find(rendered["dry-run"], "AlertmanagerConfig", "accel-health-remediator")
    converted = tmp_path / "from-crd.yaml"
    converted.write_text(yaml.safe_dump(alertmanager_yaml_from_crd(crd), sort_keys=False))
    out = subprocess.run(
        [_tool("amtool"), "check-config", str(converted)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    example = REPO / "examples" / "alertmanager.yaml"
    cases = [
        {"alertname": "AccelGPUFatalXid", "severity": "critical", "remediation": "drain"},
        {"alertname": "AccelNeuronHardwareError", "severity": "critical", "remediation": "replace"},
        {"alertname": "SomeWarning", "severity": "warning", "remediation": "cordon"},
        {"alertname": "AccelExporterDown", "severity": "warning", "remediation": "none"},
    ]
    for case in cases:
        labels = {**case, "node": "gpu-node-1", "namespace": "accel-health"}
        assert _routes_for(converted, labels) == _routes_for(example, labels), labels
    fatal = {**cases[0], "node": "gpu-node-1", "namespace": "accel-health"}
    assert REMEDIATOR_RECEIVER in _routes_for(converted, fatal)


def test_the_webhook_url_names_the_remediator_service(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["dry-run"]
    crd = find(objects, "AlertmanagerConfig", "accel-health-remediator")
    url = crd["spec"]["receivers"][0]["webhookConfigs"][0]["url"]
    service = find(objects, "Service", "accel-health-remediator")
    port = service["spec"]["ports"][0]["port"]
    assert url == f"http://{service['metadata']['name']}.{service['metadata']['namespace']}.svc:{port}/alerts"


# -- the exporter ------------------------------------------------------------------------------------


def test_base_exporter_runs_as_the_images_user_bounded_to_its_two_capabilities_host_paths_read_only() -> None:
    base = render(DEPLOY / "base")
    daemonset = find(base, "DaemonSet", "accel-health-exporter")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    security = container["securityContext"]
    assert (security["runAsUser"], security["runAsGroup"], security["runAsNonRoot"]) == (65532, 65532, True)
    # The two the image's exporter interpreter holds as file capabilities (scripts/image/capabilities.py),
    # which take effect only with privilege escalation allowed (no no_new_privs).
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG", "CHOWN"]}
    assert security["privileged"] is False
    assert security["allowPrivilegeEscalation"] is True
    assert security["readOnlyRootFilesystem"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/kmsg"]["name"]]["hostPath"]["path"] == "/dev/kmsg"
    assert mounts["/dev/kmsg"]["readOnly"] is True
    assert volumes[mounts["/host/sys"]["name"]]["hostPath"]["path"] == "/sys"
    assert mounts["/host/sys"]["readOnly"] is True
    assert pod["automountServiceAccountToken"] is False


def test_overlays_run_the_exporter_privileged_in_a_form_the_api_server_accepts(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for objects in rendered.values():
        for workload, container in containers(objects):
            security = container["securityContext"]
            if workload["metadata"]["name"] == "accel-health-exporter":
                assert security["privileged"] is True
                assert (security["runAsUser"], security["runAsNonRoot"]) == (65532, True)
                # The API server rejects privileged together with allowPrivilegeEscalation: false.
                assert security.get("allowPrivilegeEscalation") is not False
            else:
                assert not security.get("privileged")
                assert security["capabilities"] == {"drop": ["ALL"]}


def test_exporter_targets_accelerator_nodes_and_requests_no_accelerator(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    daemonset = find(rendered["dry-run"], "DaemonSet", "accel-health-exporter")
    pod = daemonset["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    keys = {e["key"] for term in terms for e in term["matchExpressions"]}
    assert {"nvidia.com/gpu.present", "node.kubernetes.io/instance-type"} <= keys
    instance_types = next(
        e["values"]
        for t in terms
        for e in t["matchExpressions"]
        if e["key"] == "node.kubernetes.io/instance-type"
    )
    assert "trn1.32xlarge" in instance_types
    (container,) = pod["containers"]
    resources = container["resources"]
    assert resources == {
        "requests": {"cpu": "20m", "memory": "48Mi"},
        # The active-checks component raises the limit from 128Mi for a CUDA context and copy buffers.
        "limits": {"cpu": "200m", "memory": "768Mi"},
    }
    assert {"operator": "Exists"} in pod["tolerations"]


def test_every_container_runs_the_image_make_image_tags(rendered: dict[str, list[dict[str, Any]]]) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    expected = f"{project['tool']['accel-health']['image']['name']}:{project['project']['version']}"
    images = {c["image"] for objects in rendered.values() for _, c in containers(objects)}
    assert images == {expected}


def test_exporter_arguments_are_ones_the_exporter_accepts(rendered: dict[str, list[dict[str, Any]]]) -> None:
    daemonset = find(rendered["dry-run"], "DaemonSet", "accel-health-exporter")
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    args = exporter_parser().parse_args(container["args"])
    assert args.listen == ("0.0.0.0", 9835)
    assert str(args.state_dir) == "/var/lib/accel-health"
    assert container["ports"][0]["containerPort"] == 9835


def test_every_overlay_enables_active_checks_with_the_token_secret_mounted_optional(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    for overlay, objects in rendered.items():
        pod = find(objects, "DaemonSet", "accel-health-exporter")["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = exporter_parser().parse_args(container["args"])
        assert args.checks == KNOWN, overlay
        assert args.checks_node_pods, overlay
        assert args.checks_schedule == "", overlay  # the defaults: cheap hourly, invasive daily
        mounts = {m["name"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        assert str(args.checks_token_file.parent) == mounts["checks-token"]["mountPath"]
        assert mounts["checks-token"]["readOnly"] is True
        secret = volumes["checks-token"]["secret"]
        assert secret["secretName"] == "accel-health-checks-token"
        # Optional: the exporter (metrics, schedule) runs before the token is set; GET /checks says 503.
        assert secret["optional"] is True
        # uid 65532 reads it through the pod's group; ping's ICMP datagram sockets need that group in
        # the safe sysctl (no capability).
        assert secret["defaultMode"] == 0o440
        assert pod["securityContext"]["fsGroup"] == 65532
        assert pod["securityContext"]["sysctls"] == [
            {"name": "net.ipv4.ping_group_range", "value": "65532 65532"}
        ]
        shipped = find(objects, "Secret", "accel-health-checks-token")
        assert "data" not in shipped
        assert "stringData" not in shipped
        env = {e["name"]: e for e in container["env"]}
        assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
        assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "compute,utility"
        assert pod["automountServiceAccountToken"] is True
        assert "nvidia.com/gpu" not in str(container["resources"])


def test_scrape_config_sets_node_from_the_pod_node_name_and_job_matches_the_rules(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["dry-run"]
    service = find(objects, "Service", "accel-health-exporter")
    rules = (REPO / "alerts" / "exporter.yaml").read_text()
    paths = {}
    for name in ("accel-health-exporter", "accel-health-exporter-fast"):
        monitor = find(objects, "ServiceMonitor", name)
        (endpoint,) = monitor["spec"]["endpoints"]
        paths[name] = endpoint["path"]
        assert {
            "sourceLabels": ["__meta_kubernetes_pod_node_name"],
            "targetLabel": "node",
            "action": "replace",
        } in endpoint["relabelings"]
        assert "jobLabel" not in monitor["spec"]
        assert service["spec"]["selector"] == monitor["spec"]["selector"]["matchLabels"]
        # The Operator names the job after the Service; the fast path renames its own, so the two
        # paths' targets differ. alerts/exporter.yaml selects both job names.
        renamed = [r for r in endpoint["relabelings"] if r.get("targetLabel") == "job"]
        job = renamed[0]["replacement"] if renamed else service["metadata"]["name"]
        assert job == name
        assert job in rules
    assert paths == {"accel-health-exporter": "/metrics/slow", "accel-health-exporter-fast": "/metrics/fast"}


# -- the remediator ----------------------------------------------------------------------------------


def _remediator(objects: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = find(objects, "Deployment", "accel-health-remediator")
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_only_the_dry_run_overlay_passes_dry_run(rendered: dict[str, list[dict[str, Any]]]) -> None:
    assert "--dry-run" in _remediator(rendered["dry-run"])["args"]
    assert "--dry-run" not in _remediator(rendered["enforce"])["args"]
    assert "--dry-run" not in _remediator(rendered["aws"])["args"]


def test_remediator_arguments_are_ones_the_remediator_accepts(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    parser = remediator_parser()
    for overlay, objects in rendered.items():
        container = _remediator(objects)
        parsed = parser.parse_args(container["args"])
        assert parsed.listen == ("0.0.0.0", 9836), overlay
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        assert str(parsed.token_file.parent) in mounts
        assert str(parsed.config.parent) in mounts


def test_remediator_runs_two_replicas_with_readiness_on_leadership(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["enforce"]
    deployment = find(objects, "Deployment", "accel-health-remediator")
    assert deployment["spec"]["replicas"] == 2
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    container = _remediator(objects)
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pdb = find(objects, "PodDisruptionBudget", "accel-health-remediator")
    assert pdb["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    assert pdb["spec"]["selector"] == deployment["spec"]["selector"]
    security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True


def test_the_policy_configmap_is_the_default_policy(rendered: dict[str, list[dict[str, Any]]]) -> None:
    policy = find(rendered["dry-run"], "ConfigMap", "accel-health-remediator-policy")
    assert policy["data"]["policy.yaml"] == (REPO / "remediator" / "default_policy.yaml").read_text()


def test_the_aws_overlay_policy_publishes_a_cloudwatch_metric_for_every_rule_that_acts(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    text = find(rendered["aws"], "ConfigMap", "accel-health-remediator-policy")["data"]["policy.yaml"]
    aws = parse_policy(text, source="aws overlay")
    default = load_policy()
    assert [r.name for r in aws.rules] == [r.name for r in default.rules]
    for ours, base in zip(aws.rules, default.rules, strict=True):
        metrics = [a for a in ours.actions if isinstance(a, CloudWatchMetric)]
        assert len(metrics) == (1 if base.actions else 0), ours.name
        rest = [a for a in ours.actions if not isinstance(a, CloudWatchMetric | AwsReboot)]
        assert rest == list(base.actions), ours.name
    reboots = {r.name: a for r in aws.rules for a in r.actions if isinstance(a, AwsReboot)}
    assert reboots == {"drain": AwsReboot(86400, handover_condition="AcceleratedHardwareReady")}
    drain = next(r for r in aws.rules if r.name == "drain")
    assert drain.actions[-1] == reboots["drain"]  # after the drain, never before


def test_no_token_value_is_shipped(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for objects in rendered.values():
        secret = find(objects, "Secret", TOKEN_SECRET)
        assert "data" not in secret
        assert "stringData" not in secret


EXPECTED_RBAC = {
    ("ClusterRole", "accel-health-remediator"): {
        ("", "nodes"): {"get", "list", "patch", "watch"},
        ("", "nodes/status"): {"patch"},
        ("", "pods"): {"list", "watch"},
        ("", "pods/eviction"): {"create"},
        ("policy", "poddisruptionbudgets"): {"list", "watch"},
        ("apps", "daemonsets"): {"get"},
    },
    ("Role", "accel-health-remediator"): {
        ("coordination.k8s.io", "leases"): {"get", "create", "update", "patch"},
        ("", "configmaps"): {"get", "create", "update"},
    },
    ("Role", "accel-health-remediator-events"): {("", "events"): {"create", "patch"}},
    # The durable quarantine copies (one ConfigMap per node, names not known in advance): no update.
    ("Role", "accel-health-remediator-quarantine"): {("", "configmaps"): {"list", "create", "delete"}},
    # The exporter's only permission (components/active-checks): its node's pods, for --checks-node-pods.
    ("ClusterRole", "accel-health-exporter"): {("", "pods"): {"list"}},
}


def test_rbac_grants_exactly_the_listed_permissions_and_no_wildcards(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["aws"]
    roles = [o for o in objects if o["kind"] in {"Role", "ClusterRole"}]
    assert {(r["kind"], r["metadata"]["name"]) for r in roles} == set(EXPECTED_RBAC)
    for role in roles:
        granted: dict[tuple[str, str], set[str]] = {}
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                assert "*" not in rule.get(field, []), f"wildcard in {role['metadata']['name']}"
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    granted.setdefault((group, resource), set()).update(rule["verbs"])
        assert granted == EXPECTED_RBAC[(role["kind"], role["metadata"]["name"])]
    named = {"leases": ["accel-health-remediator"], "configmaps": ["accel-health-remediator-gates"]}
    for rule in find(objects, "Role", "accel-health-remediator")["rules"]:
        if rule["verbs"] != ["create"]:  # create cannot name the object it makes
            [resource] = rule["resources"]
            assert rule.get("resourceNames") == named[resource], rule
    bindings = [o for o in objects if o["kind"] in {"RoleBinding", "ClusterRoleBinding"}]
    for binding in bindings:
        account = binding["roleRef"]["name"].removesuffix("-events").removesuffix("-quarantine")
        assert account in {"accel-health-remediator", "accel-health-exporter"}
        assert binding["subjects"] == [
            {"kind": "ServiceAccount", "name": account, "namespace": "accel-health"}
        ]
    exporter_sa = find(objects, "ServiceAccount", "accel-health-exporter")
    assert exporter_sa["automountServiceAccountToken"] is True


def test_aws_overlay_annotates_the_service_account_for_iam_and_enables_aws(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    sa = find(rendered["aws"], "ServiceAccount", "accel-health-remediator")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    args = _remediator(rendered["aws"])["args"]
    assert "--aws" in args
    assert any(a.startswith("--cloudwatch-namespace=") for a in args)
    assert (
        "annotations"
        not in find(rendered["enforce"], "ServiceAccount", "accel-health-remediator")["metadata"]
    )


def test_network_policies_admit_alertmanager_and_prometheus_on_the_service_ports(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["dry-run"]
    policy = find(objects, "NetworkPolicy", "accel-health-remediator")
    (ingress,) = policy["spec"]["ingress"]
    sources = {p["podSelector"]["matchLabels"]["app.kubernetes.io/name"] for p in ingress["from"]}
    assert sources == {"alertmanager", "prometheus"}
    assert ingress["ports"] == [{"port": 9836, "protocol": "TCP"}]
    # The exporter's policy, connection by connection: tests/deploy/test_exporter_network_policy.py.


@needs_promtool
def test_the_plain_prometheus_config_is_valid_and_labels_like_the_servicemonitor(tmp_path: Path) -> None:
    source = DEPLOY / "prometheus" / "prometheus.yaml"
    config = yaml.safe_load(source.read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"accel-health-exporter", "accel-health-exporter-fast", "accel-health-remediator"}
    for name in ("accel-health-exporter", "accel-health-exporter-fast"):
        labels = jobs[name]["relabel_configs"]
        assert {"source_labels": ["__meta_kubernetes_pod_node_name"], "target_label": "node"} in labels
    # The two paths, at the ServiceMonitors' intervals.
    fast, slow = jobs["accel-health-exporter-fast"], jobs["accel-health-exporter"]
    assert (fast["metrics_path"], fast["scrape_interval"]) == ("/metrics/fast", "2s")
    assert (slow["metrics_path"], slow["scrape_interval"]) == ("/metrics/slow", "60s")
    assert config["global"]["scrape_interval"] == config["global"]["evaluation_interval"] == "10s"
    # Debian builds Prometheus without Kubernetes service discovery, so promtool here rejects the
    # block: check it by hand and let promtool check everything else, relabeling included.
    for job in config["scrape_configs"]:
        (sd,) = job.pop("kubernetes_sd_configs")
        assert sd == {"role": "pod", "namespaces": {"names": ["accel-health"]}}
        job["static_configs"] = [{"targets": ["127.0.0.1:9835"]}]
    (tmp_path / "rules").mkdir()
    for rules in (REPO / "alerts").glob("*.yaml"):
        (tmp_path / "rules" / rules.name).write_text(rules.read_text())
    copy = tmp_path / "prometheus.yaml"
    copy.write_text(yaml.safe_dump(config))
    out = subprocess.run(
        [_tool("promtool"), "check", "config", str(copy)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rule files found" in out.stdout  # the rules were loaded and checked too
