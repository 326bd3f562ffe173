"""accel-health as a user installs it, on the real control plane.

`Deployment.start()` renders an overlay of deploy/ with `kubectl kustomize`, applies it server-side,
sets the webhook token as the README says, and lets the kubelet stand-in run what the manifests run:
the exporter DaemonSet on every accelerator node and the two remediator replicas, with their own args,
env, volumes and ServiceAccount, each container the image `make image` builds run by runc with its
securityContext (user, groups, capabilities, read-only root; tests/kube/kubelet.py says what is
played). `Deployment(from_image=False)` runs them from the development virtualenv instead, as root,
for a scenario that needs a debugger-level view of the processes. Real Prometheus runs
deploy/prometheus/prometheus.yaml (pod discovery through the API server, the shipped 10 s intervals,
the rules from alerts/) and real Alertmanager runs the shipped routing (examples/alertmanager.yaml) to
the remediator Service.

The monitoring stack the harness plays is kube-prometheus': Alertmanager `main` in `monitoring`, three
real members gossiping as an HA cluster, each at an address of its own on the pod network, port 9093,
and named in the pods' DNS (their /etc/hosts) as the Operator's governing Service names them,
`alertmanager-main-<i>.alertmanager-operated.monitoring.svc` (and the Service `alertmanager-main` as
member 0), so the remediator reads them with the rendered URLs; their webhooks reach the remediator
from member 0's address. Prometheus runs in a pod network namespace of its own, so its scrapes come
from an address of its own too (except beside `extra_pods`, whose simulated nodes listen on the host's
loopback addresses: there it runs on the host).

Every connection a pod opens or accepts is recorded (tests/kube/connections.py) and, with the address
book of `address_book()`, held against the rendered NetworkPolicies by each scenario module's last
test: the policies must admit everything the shipped components do.

What the harness changes, and only for the 1.20 server or for running outside a cluster:
- PodDisruptionBudgets are applied as policy/v1beta1 and lose `unhealthyPodEvictionPolicy` (1.21+
  fields); the product's own policy/v1 requests go through the skew proxy (tests/kube/network.py).
- The Prometheus Operator's CRDs are installed as schemaless CRDs so its objects apply.
- Prometheus gets the API server's address and an admin token for discovery; Alertmanager's webhook
  URL points at the Service stand-in and its token path at a file; Prometheus's rule path at alerts/;
  Prometheus sends alerts to the three members by address.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import re
import secrets
import shutil
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from examples.pipeline import free_port
from tests.deploy import kube as deploy_kube
from tests.deploy.netpol import Outside, Pod
from tests.image import oci
from tests.kube.connections import AddressBook, ConnectionRecorder, Flow, Peer, disallowed, pod_peer, roles
from tests.kube.controlplane import (
    ControlPlane,
    Process,
    Repeating,
    apply_objects,
    deployment,
    spawn,
    start_control_plane,
    wait_for,
)
from tests.kube.kubelet import MULTUS_NETWORKS, FakeKubelet, KubeletSettings, write_kmsg
from tests.kube.network import Loop, ServiceProxy, SkewProxy
from tests.kube.podnet import PodNetwork
from tests.kube.rest import ApiError, Obj, Rest

REPO = Path(__file__).resolve().parents[2]
NAMESPACE = "accel-health"
REMEDIATOR = "accel-health-remediator"
CHECKS_TOKEN_SECRET = "accel-health-checks-token"
EXPORTER = "accel-health-exporter"
WORK_NS = "training"
GPU_NODE_FIXTURE = REPO / "examples" / "nodes" / "gpu-node-1"
ALERTMANAGER_NAMESPACE = "monitoring"
ALERTMANAGER_NAME = "main"
"""kube-prometheus' Alertmanager object; its StatefulSet and Service are `alertmanager-main`."""
ALERTMANAGER_REPLICAS = 3
ALERTMANAGER_PORT = 9093
PROMETHEUS_POD = Pod(
    "monitoring", {"app.kubernetes.io/name": "prometheus", "prometheus": "k8s"}, {"web": 9090}
)
"""kube-prometheus' Prometheus `k8s` as its NetworkPolicies see it (the harness's Prometheus plays it)."""
ALERTMANAGER_POD = Pod(
    ALERTMANAGER_NAMESPACE,
    {
        "app.kubernetes.io/name": "alertmanager",
        "app.kubernetes.io/instance": ALERTMANAGER_NAME,
        "app.kubernetes.io/component": "alert-router",
        "app.kubernetes.io/part-of": "kube-prometheus",
        "app.kubernetes.io/managed-by": "prometheus-operator",
        "alertmanager": ALERTMANAGER_NAME,
    },
    {"web": ALERTMANAGER_PORT, "mesh-tcp": 9094},
)
"""A member of kube-prometheus' Alertmanager `main`, labelled as the Operator labels its pods."""
API_SERVER = Outside("172.20.0.1")
"""The API server behind the `kubernetes` Service, as a NetworkPolicy sees it (an address outside the
pod network, port 443), which the pods reach through the harness's API server proxy."""
OPERATOR_KINDS = {
    "ServiceMonitor": "servicemonitors",
    "PodMonitor": "podmonitors",
    "PrometheusRule": "prometheusrules",
    "AlertmanagerConfig": "alertmanagerconfigs",
}


@functools.cache
def project_image() -> oci.Unpacked:
    """The image `make image` built, rebuilt if the sources changed (warm caches only, seconds) and
    unpacked; raises oci.ImageUnavailable where it cannot be."""
    reason = oci.problem()
    if reason:
        raise oci.ImageUnavailable(reason)
    oci.build()
    return oci.unpack()


def image_skip_reason() -> str | None:
    try:
        project_image()
    except oci.ImageUnavailable as exc:
        return f"the image: {exc}"
    return None


def render(overlay: str) -> list[Obj]:
    """`kubectl kustomize deploy/overlays/<overlay>`, as objects."""
    return deploy_kube.render(REPO / "deploy" / "overlays" / overlay)


def for_old_server(objects: list[Obj]) -> list[Obj]:
    """The 1.20 server's view of the same objects (see the module docstring)."""
    adapted = []
    for original in objects:
        obj = json.loads(json.dumps(original))
        if obj["kind"] == "PodDisruptionBudget" and obj["apiVersion"] == "policy/v1":
            obj["apiVersion"] = "policy/v1beta1"
            obj["spec"].pop("unhealthyPodEvictionPolicy", None)
        adapted.append(obj)
    return adapted


def operator_crds(objects: list[Obj]) -> list[Obj]:
    crds = []
    for kind in sorted({o["kind"] for o in objects if o["kind"] in OPERATOR_KINDS}):
        group, version = next(o["apiVersion"] for o in objects if o["kind"] == kind).split("/")
        plural = OPERATOR_KINDS[kind]
        crds.append(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": f"{plural}.{group}"},
                "spec": {
                    "group": group,
                    "scope": "Namespaced",
                    "names": {
                        "kind": kind,
                        "plural": plural,
                        "singular": kind.lower(),
                        "listKind": f"{kind}List",
                    },
                    "versions": [
                        {
                            "name": version,
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "x-kubernetes-preserve-unknown-fields": True,
                                }
                            },
                        }
                    ],
                },
            }
        )
    return crds


def is_project_pod(pod: Obj) -> bool:
    return any("accel-health" in c.get("image", "") for c in pod["spec"]["containers"])


@dataclass
class PodDiscovery:
    """Prometheus's `kubernetes_sd_configs` with `role: pod`, played through file_sd: one target per
    container port of every pod with an IP, labelled as Prometheus's own discovery labels it."""

    rest: Rest
    folder: Path
    exporter_networks: tuple[str, ...] = ()
    """Secondary networks the exporter pods are attached to, with the Multus annotation on the
    DaemonSet's pod template, as deploy/README tells a user to patch it in (the ping and iperf checks
    measure them)."""
    extra_pods: list[Obj] = field(default_factory=list)
    """Pods discovered besides the API server's (see Deployment.extra_pods)."""
    _configs: dict[Path, Obj] = field(default_factory=dict)
    _poller: Repeating | None = None

    def watch(self, name: str, sd: Obj) -> Path:
        if sd.get("role") != "pod":
            raise ValueError(f"only role: pod is played by the harness, not {sd.get('role')}")
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / f"{name}.json"
        path.write_text("[]")
        self._configs[path] = sd
        return path

    def start(self) -> None:
        self.sync()
        self._poller = Repeating(self._sync_quietly, 0.5, "pod-discovery")
        self._poller.start()

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.stop()

    def _sync_quietly(self) -> None:
        with contextlib.suppress(OSError, ApiError):
            self.sync()

    def sync(self) -> None:
        pods = self.rest.items("/api/v1/pods") + self.extra_pods
        for path, sd in self._configs.items():
            names = (sd.get("namespaces") or {}).get("names")
            groups = [
                group
                for pod in pods
                if not names or pod["metadata"]["namespace"] in names
                for group in pod_targets(pod)
            ]
            text = json.dumps(groups, sort_keys=True)
            if path.read_text() != text:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(text)
                tmp.replace(path)


def _label_name(key: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", key)


def pod_targets(pod: Obj) -> list[Obj]:
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    ip = status.get("podIP")
    if not ip:
        return []
    common = {
        "__meta_kubernetes_namespace": meta["namespace"],
        "__meta_kubernetes_pod_name": meta["name"],
        "__meta_kubernetes_pod_ip": ip,
        "__meta_kubernetes_pod_node_name": spec.get("nodeName", ""),
        "__meta_kubernetes_pod_host_ip": status.get("hostIP", ""),
        "__meta_kubernetes_pod_uid": meta["uid"],
        "__meta_kubernetes_pod_phase": status.get("phase", ""),
        "__meta_kubernetes_pod_ready": str(is_ready(pod)).lower(),
    }
    for key, value in (meta.get("labels") or {}).items():
        common[f"__meta_kubernetes_pod_label_{_label_name(key)}"] = value
        common[f"__meta_kubernetes_pod_labelpresent_{_label_name(key)}"] = "true"
    for key, value in (meta.get("annotations") or {}).items():
        common[f"__meta_kubernetes_pod_annotation_{_label_name(key)}"] = value
    groups = []
    for container in spec["containers"]:
        for port in container.get("ports") or []:
            labels = common | {
                "__meta_kubernetes_pod_container_name": container["name"],
                "__meta_kubernetes_pod_container_port_name": port.get("name", ""),
                "__meta_kubernetes_pod_container_port_number": str(port["containerPort"]),
                "__meta_kubernetes_pod_container_port_protocol": port.get("protocol", "TCP"),
            }
            groups.append({"targets": [f"{ip}:{port['containerPort']}"], "labels": labels})
    return groups


@dataclass
class Deployment:
    workdir: Path
    overlay: str = "enforce"
    gpu_nodes: int = 3
    cpu_nodes: int = 2
    kubelet_settings: KubeletSettings = field(default_factory=KubeletSettings)
    policy_override: dict[str, Any] | None = None
    """Merged into the rendered policy ConfigMap's policy (benchmarks only; tests run it as shipped)."""
    plane: ControlPlane | None = None
    kubelet: FakeKubelet | None = None
    network: PodNetwork | None = None
    loop: Loop | None = None
    skew: SkewProxy | None = None
    service: ServiceProxy | None = None
    processes: list[Process] = field(default_factory=list)
    token: str = field(default_factory=lambda: secrets.token_hex(32))
    checks_token: str = field(default_factory=lambda: secrets.token_hex(32))
    """What the operator patches into `accel-health-checks-token` (where the overlay ships that Secret):
    the exporters' /checks and /evidence ask for it, the remediator's repair checks and evidence step
    send it."""
    objects: list[Obj] = field(default_factory=list)
    prometheus_port: int = 0
    alertmanagers: list[str] = field(default_factory=list)
    """Base URLs of the Alertmanager members (http://ADDRESS:9093), as the harness reaches them."""
    discovery: PodDiscovery | None = None
    from_image: bool = True
    """The project's containers run from the image (runc); False: from the virtualenv, as root."""
    recorder: ConnectionRecorder | None = None
    """Every connection the pods open or accept (see connections_seen)."""
    prometheus_address: str = "127.0.0.1"
    """Where Prometheus's web port is (its pod address, once started in a pod namespace)."""
    exporter_networks: tuple[str, ...] = ()
    """Secondary networks the exporter pods are attached to, with the Multus annotation on the
    DaemonSet's pod template, as deploy/README tells a user to patch it in (the ping and iperf checks
    measure them)."""
    extra_pods: list[Obj] = field(default_factory=list)
    """Pods Prometheus discovers besides the cluster's, as pod discovery would list them (benchmarks:
    a simulated fleet's exporters, bench/fleet.py). They are not in the API server."""

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.network = PodNetwork()
        self.network.create()
        self.recorder = ConnectionRecorder(self.network.conntrack_tables)
        self.recorder.start()
        self.plane = start_control_plane(self.workdir / "control-plane", extra_ips=(self.network.host_ip,))
        self.loop = Loop()
        pki = self.plane.pki
        self.skew = SkewProxy(
            upstream=self.plane.server,
            ca_file=pki.ca_cert,
            cert_file=pki.serving_cert,
            key_file=pki.serving_key,
            host=self.network.host_ip,
        )
        self.loop.run(self.skew.start())
        self.kubelet = FakeKubelet(
            plane=self.plane,
            workdir=self.workdir,
            settings=self.kubelet_settings,
            network=self.network,
            runs_process=is_project_pod,
            image=project_image() if self.from_image else None,
        )
        self.kubelet.api_port_for_pods = self.skew.port
        self._add_nodes()
        self._start_alertmanagers()  # before any pod starts: their /etc/hosts names the members
        self.kubelet.start()
        self.apply()
        self._start_prometheus()

    def stop(self) -> None:
        if self.recorder is not None:
            self.recorder.stop()
        if self.discovery is not None:
            self.discovery.stop()
        for proc in reversed(self.processes):
            proc.stop()
        if self.kubelet is not None:
            self.kubelet.stop()
        if self.loop is not None:
            if self.service is not None:
                self.loop.run(self.service.stop())
            if self.skew is not None:
                self.loop.run(self.skew.stop())
            self.loop.close()
        if self.plane is not None:
            self.plane.stop()
        if self.network is not None:
            self.network.destroy()

    def __enter__(self) -> Deployment:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the cluster -----------------------------------------------------------------------------

    @property
    def admin(self) -> Rest:
        assert self.plane is not None
        return self.plane.admin

    def _add_nodes(self) -> None:
        assert self.kubelet is not None
        self.kubelet.add_node(
            "control-plane-1",
            labels={"node-role.kubernetes.io/control-plane": "", "node-role.kubernetes.io/master": ""},
            taints=[{"key": "node-role.kubernetes.io/master", "effect": "NoSchedule"}],
        )
        for i in range(1, self.cpu_nodes + 1):
            self.kubelet.add_node(f"cpu-node-{i}")
        for i in range(1, self.gpu_nodes + 1):
            name = f"gpu-node-{i}"
            self.kubelet.add_node(
                name,
                labels={"nvidia.com/gpu.present": "true", "node.kubernetes.io/instance-type": "p5.48xlarge"},
                capacity={"nvidia.com/gpu": "8"},
                provider_id=f"aws:///us-west-2a/i-0{i:016x}",
            )
            root = self.kubelet.nodes[name]
            shutil.copyfile(GPU_NODE_FIXTURE / "kmsg", root / "dev" / "kmsg")
            (root / "sys").symlink_to(GPU_NODE_FIXTURE / "sys")

    def apply(self, overlay: str | None = None) -> None:
        """Render and apply an overlay server-side, then set the token (docs/install.md)."""
        assert self.plane is not None
        self.overlay = overlay or self.overlay
        rendered = render(self.overlay)
        self.objects = rendered
        objects = for_old_server(rendered)
        if self.policy_override:
            for obj in objects:
                if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] == f"{REMEDIATOR}-policy":
                    policy = yaml.safe_load(obj["data"]["policy.yaml"])
                    _merge(policy, self.policy_override)
                    obj["data"]["policy.yaml"] = yaml.safe_dump(policy)
        if self.exporter_networks:
            for obj in objects:
                if obj["kind"] == "DaemonSet" and obj["metadata"]["name"] == EXPORTER:
                    template = obj["spec"]["template"]["metadata"]
                    template.setdefault("annotations", {})[MULTUS_NETWORKS] = ",".join(self.exporter_networks)
        crds = operator_crds(objects)
        if crds:
            self.plane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(crds))
            wait_for(
                "the operator CRDs to be served",
                lambda: all(self._crd_established(c["metadata"]["name"]) for c in crds),
                timeout=30,
            )
        self.plane.kubectl(
            "apply",
            "--server-side",
            "--field-manager=accel-health-test",
            "--force-conflicts",
            "-f",
            "-",
            stdin=yaml.safe_dump_all(objects),
        )
        self.admin.merge_patch(
            f"/api/v1/namespaces/{NAMESPACE}/secrets/{REMEDIATOR}-token",
            {"data": {"token": base64.b64encode(self.token.encode()).decode()}},
        )
        if any(o["kind"] == "Secret" and o["metadata"]["name"] == CHECKS_TOKEN_SECRET for o in rendered):
            self.admin.merge_patch(
                f"/api/v1/namespaces/{NAMESPACE}/secrets/{CHECKS_TOKEN_SECRET}",
                {"data": {"token": base64.b64encode(self.checks_token.encode()).decode()}},
            )

    def _crd_established(self, name: str) -> bool:
        crd = self.admin.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        return any(
            c["type"] == "Established" and c["status"] == "True"
            for c in crd.get("status", {}).get("conditions", [])
        )

    # -- monitoring -------------------------------------------------------------------------------

    def _start_alertmanagers(self) -> None:
        """kube-prometheus' Alertmanager: ALERTMANAGER_REPLICAS members in one gossip cluster, each on
        an address of its own on the pod network, named in the pods' DNS as the Operator names them."""
        assert self.loop is not None
        assert self.network is not None
        assert self.kubelet is not None
        addresses = [self.network.add_host_address() for _ in range(ALERTMANAGER_REPLICAS)]
        # The webhooks reach the remediator from member 0's address, as from the member's pod.
        self.service = ServiceProxy(
            rest=self.admin, namespace=NAMESPACE, name=REMEDIATOR, target_port=9836, source=addresses[0]
        )
        self.loop.run(self.service.start())
        token_file = self.workdir / "webhook-token"
        token_file.write_text(self.token)
        am = yaml.safe_load((REPO / "examples" / "alertmanager.yaml").read_text())
        for receiver in am.get("receivers", []):
            for hook in receiver.get("webhook_configs", []):
                hook["url"] = f"http://127.0.0.1:{self.service.port}/alerts"
                hook["http_config"]["authorization"]["credentials_file"] = str(token_file)
        (self.workdir / "alertmanager.yaml").write_text(yaml.safe_dump(am))
        statefulset, ns = f"alertmanager-{ALERTMANAGER_NAME}", ALERTMANAGER_NAMESPACE
        for i, address in enumerate(addresses):
            for domain in (
                f"alertmanager-operated.{ns}.svc",
                f"alertmanager-operated.{ns}.svc.cluster.local",
            ):
                self.kubelet.hosts[f"{statefulset}-{i}.{domain}"] = address
        for domain in (f"{ns}.svc", f"{ns}.svc.cluster.local"):
            self.kubelet.hosts[f"{statefulset}.{domain}"] = addresses[0]
        for i, address in enumerate(addresses):
            peers = [f"--cluster.peer={a}:9094" for a in addresses if a != address]
            self.processes.append(
                spawn(
                    f"alertmanager-{i}",
                    [
                        "prometheus-alertmanager",
                        f"--config.file={self.workdir / 'alertmanager.yaml'}",
                        f"--storage.path={self.workdir / f'am-data-{i}'}",
                        f"--web.listen-address={address}:{ALERTMANAGER_PORT}",
                        f"--cluster.listen-address={address}:9094",
                        f"--cluster.advertise-address={address}:9094",
                        *peers,
                    ],
                    log_dir=self.workdir,
                )
            )
            self.alertmanagers.append(f"http://{address}:{ALERTMANAGER_PORT}")

    def _start_prometheus(self) -> None:
        assert self.plane is not None
        admin_token = self.workdir / "prometheus-token"
        admin_token.write_text(self.plane.admin_token)
        prom = yaml.safe_load((REPO / "deploy" / "prometheus" / "prometheus.yaml").read_text())
        prom["rule_files"] = [str(REPO / "alerts" / "*.yaml")]
        targets = [urllib.parse.urlsplit(u).netloc for u in self.alertmanagers]
        prom["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": targets}]}]}
        # Debian's Prometheus is built without Kubernetes discovery: the harness discovers the pods
        # itself and hands Prometheus the same targets and __meta_kubernetes_* labels through file_sd,
        # so the shipped relabel_configs run unchanged.
        self.discovery = PodDiscovery(
            rest=self.admin, folder=self.workdir / "file-sd", extra_pods=self.extra_pods
        )
        for index, job in enumerate(prom["scrape_configs"]):
            sds = job.pop("kubernetes_sd_configs", [])
            if sds:
                files = [str(self.discovery.watch(f"{index}-{n}", sd)) for n, sd in enumerate(sds)]
                job["file_sd_configs"] = [{"files": files, "refresh_interval": "1s"}]
        self.discovery.start()
        (self.workdir / "prometheus.yml").write_text(yaml.safe_dump(prom))
        in_pod: list[str] = []
        if self.extra_pods:
            self.prometheus_port = free_port()
        else:
            assert self.network is not None
            netns, self.prometheus_address = self.network.add_pod()
            self.prometheus_port = 9090
            in_pod = ["ip", "netns", "exec", netns]
        self.processes.append(
            spawn(
                "prometheus",
                [
                    *in_pod,
                    "prometheus",
                    f"--config.file={self.workdir / 'prometheus.yml'}",
                    f"--storage.tsdb.path={self.workdir / 'prom-data'}",
                    f"--web.listen-address={self.prometheus_address}:{self.prometheus_port}",
                ],
                log_dir=self.workdir,
            )
        )

    @property
    def prometheus_host(self) -> str:
        """ADDRESS:PORT of Prometheus's web interface."""
        return f"{self.prometheus_address}:{self.prometheus_port}"

    # -- observing ----------------------------------------------------------------------------------

    def query(self, promql: str) -> list[dict[str, Any]]:
        url = f"http://{self.prometheus_host}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(url, timeout=5) as resp:
            result: list[dict[str, Any]] = json.loads(resp.read())["data"]["result"]
            return result

    def alertmanager_api(self, member: int, method: str, path: str, body: Any = None) -> Any:
        """One member's API v2 (path under /api/v2), as Prometheus or an operator calls it."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(  # noqa: S310 -- http to the harness's own member
            f"{self.alertmanagers[member]}/api/v2{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310
            text = resp.read()
        return json.loads(text) if text.strip() else None

    def alertmanagers_clustered(self) -> bool:
        """Every member up and seeing all the others (gossip settled enough for silences to spread)."""
        try:
            statuses = [self.alertmanager_api(i, "GET", "/status") for i in range(len(self.alertmanagers))]
        except OSError:
            return False
        return all(
            st["cluster"]["status"] == "ready" and len(st["cluster"].get("peers") or []) == len(statuses)
            for st in statuses
        )

    def firing(self) -> list[dict[str, str]]:
        url = f"http://{self.prometheus_host}/api/v1/alerts"
        with urllib.request.urlopen(url, timeout=5) as resp:
            alerts = json.loads(resp.read())["data"]["alerts"]
        return [a["labels"] | {"activeAt": a.get("activeAt", "")} for a in alerts if a["state"] == "firing"]

    def pods(self, namespace: str = NAMESPACE, selector: str | None = None) -> list[Obj]:
        query = {"labelSelector": selector} if selector else {}
        return self.admin.items(f"/api/v1/namespaces/{namespace}/pods", **query)

    def remediator_pods(self) -> list[Obj]:
        return self.pods(selector=f"app.kubernetes.io/name={REMEDIATOR}")

    def remediator_get(self, pod: Obj, path: str, *, method: str = "GET", body: Any = None) -> Any:
        ip = pod["status"]["podIP"]
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(f"http://{ip}:9836{path}", data=data, method=method)
        request.add_header("Authorization", f"Bearer {self.token}")
        with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310
            return json.loads(resp.read()) if path != "/metrics" else resp.read().decode()

    def remediator_metric(self, pod: Obj, name: str, labels: dict[str, str]) -> float | None:
        """One sample of a pod's /metrics; None when absent."""
        for family in text_string_to_metric_families(self.remediator_get(pod, "/metrics")):
            for sample in family.samples:
                if sample.name == name and sample.labels == labels:
                    return float(sample.value)
        return None

    def leader(self) -> Obj | None:
        lease = self.admin.get(f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases/{REMEDIATOR}")
        holder = (lease.get("spec") or {}).get("holderIdentity") or ""
        for pod in self.remediator_pods():
            if holder.startswith(pod["metadata"]["name"]) and not pod["metadata"].get("deletionTimestamp"):
                return pod
        return None

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Exporters scraped on every GPU node (and every extra exporter pod), one remediator leading,
        the Alertmanager members clustered."""

        def ready() -> bool:
            for proc in self.processes:
                if proc.popen.poll() is not None:
                    raise RuntimeError(f"{proc.name} exited\n{proc.tail()}")
            try:
                up = self.query(f'up{{job="{EXPORTER}"}} == 1')
            except OSError:
                return False
            endpoints = self.service.endpoints() if self.service else []
            exporters = self.gpu_nodes + sum(
                (p["metadata"].get("labels") or {}).get("app.kubernetes.io/name") == EXPORTER
                for p in self.extra_pods
            )
            return len(up) == exporters and len(endpoints) == 1 and self.alertmanagers_clustered()

        try:
            wait_for("exporters scraped and a leading remediator", ready, timeout=timeout, interval=0.5)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.logs()}") from None

    def write_fault(self, node: str, message: str) -> None:
        assert self.kubelet is not None
        write_kmsg(self.kubelet.nodes[node], message)

    def node(self, name: str) -> Obj:
        node: Obj = self.admin.get(f"/api/v1/nodes/{name}")
        return node

    def events(self, node: str) -> list[Obj]:
        return [
            e
            for e in self.admin.items("/api/v1/namespaces/default/events")
            if e["involvedObject"].get("kind") == "Node" and e["involvedObject"].get("name") == node
        ]

    def logs(self) -> str:
        parts = [p.tail(40) for p in self.processes]
        if self.kubelet is not None:
            parts += [r.process.tail(40) for r in self.kubelet.running.values()]
            parts.append("kubelet stand-in errors: " + "; ".join(self.kubelet.errors[-10:]))
        return "\n".join(parts)

    def address_book(self) -> AddressBook:
        """Who each address of the pod network is, as a cluster's NetworkPolicy sees it: the pods the
        kubelet stand-in started, Prometheus and the Alertmanager members as kube-prometheus' pods,
        the API server proxy as the API server on 443, the host as the pods' node."""
        assert self.network is not None
        assert self.kubelet is not None
        assert self.skew is not None
        book = AddressBook(nodes={self.network.host_ip})
        for ip, pod in list(self.kubelet.addresses.items()):
            book.pods[ip] = pod_peer(pod)
        prometheus = f"{PROMETHEUS_POD.namespace}/prometheus-k8s-0"
        book.pods[self.prometheus_address] = Peer(prometheus, "monitoring/prometheus", PROMETHEUS_POD)
        for i, url in enumerate(self.alertmanagers):
            member = f"{ALERTMANAGER_NAMESPACE}/alertmanager-{ALERTMANAGER_NAME}-{i}"
            book.pods[urllib.parse.urlsplit(url).hostname or ""] = Peer(
                member, "monitoring/alertmanager", ALERTMANAGER_POD
            )
        book.services[(self.network.host_ip, self.skew.port)] = (
            Peer("API server", "API server", API_SERVER),
            443,
        )
        return book

    def connections_seen(self) -> list[Flow]:
        """Every connection recorded so far (read afresh now), between the peers the addresses are."""
        assert self.recorder is not None
        return self.address_book().flows(self.recorder.poll())

    def remediator_logs(self) -> str:
        assert self.kubelet is not None
        return "\n".join(
            p.read_text(errors="replace")
            for p in sorted(self.workdir.glob(f"pod-{NAMESPACE}-{REMEDIATOR}-*.log"))
        )


def add_training(d: Deployment, *, replicas: int, mirror_pods_on: tuple[str, ...] = ()) -> None:
    """A training Deployment on the GPU nodes under a PDB (one pod down at a time), and mirror pods
    (what the kubelet makes of static pods) on the named nodes; returns once every trainer is Ready."""
    labels = {"app": "trainer"}
    apply_objects(
        d.admin,
        [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": WORK_NS}},
            deployment(
                "trainer", WORK_NS, node_selector={"nvidia.com/gpu.present": "true"}, replicas=replicas
            ),
            {
                "apiVersion": "policy/v1beta1",
                "kind": "PodDisruptionBudget",
                "metadata": {"name": "trainer", "namespace": WORK_NS},
                "spec": {"maxUnavailable": 1, "selector": {"matchLabels": labels}},
            },
        ],
    )
    for node in mirror_pods_on:
        # What the kubelet makes of a static pod: a mirror pod the API cannot evict.
        d.admin.create(
            "/api/v1/namespaces/kube-system/pods",
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"node-local-dns-{node}",
                    "namespace": "kube-system",
                    "annotations": {
                        "kubernetes.io/config.mirror": "static",
                        "kubernetes.io/config.source": "file",
                    },
                },
                "spec": {"nodeName": node, "containers": [{"name": "dns", "image": "dns:1"}]},
            },
        )
    wait_for(
        f"{replicas} trainers ready",
        lambda: sum(is_ready(p) for p in d.pods(WORK_NS)) == replicas,
        timeout=60,
    )


ALWAYS_CONNECTED = {
    ("monitoring/prometheus", f"{NAMESPACE}/{EXPORTER}", 9835, "TCP"),
    ("monitoring/prometheus", f"{NAMESPACE}/{REMEDIATOR}", 9836, "TCP"),
    (f"{NAMESPACE}/{REMEDIATOR}", "API server", 443, "TCP"),
    (f"{NAMESPACE}/{REMEDIATOR}", "monitoring/alertmanager", ALERTMANAGER_PORT, "TCP"),
}
"""(source, destination, port, protocol) that every scenario makes without a fault: Prometheus's
scrapes, the remediator's API calls and its reads of Alertmanager (every 30 s)."""


def check_network_policies(
    d: Deployment, *, expected: set[tuple[str, str, int, str]], timeout: float = 90.0
) -> list[Flow]:
    """Every connection the pods made so far, once the recorder has seen each `expected` one (so that
    a recorder that records nothing fails instead of passing); raises AssertionError listing each
    one the rendered NetworkPolicies (`d.objects`, as applied) would drop. Returns the connections."""
    assert d.network is not None
    if d.network.track_problem:
        raise AssertionError(f"the pods' connections cannot be recorded: {d.network.track_problem}")
    flows: list[Flow] = []

    def seen_all() -> bool:
        nonlocal flows
        flows = d.connections_seen()
        return expected <= roles(flows)

    try:
        wait_for("the expected connections recorded", seen_all, timeout=timeout, interval=1.0)
    except TimeoutError as exc:
        missing = "\n".join(map(str, sorted(expected - roles(flows))))
        seen = "\n".join(map(str, flows))
        raise AssertionError(f"{exc}; never seen:\n{missing}\nseen:\n{seen}") from None
    refused = disallowed(d.objects, flows)
    assert not refused, "\n".join(refused)
    return flows


def is_ready(pod: Obj) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _merge(into: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def wait_until(what: str, check: Any, *, timeout: float, interval: float = 0.2) -> float:
    """wait_for that returns the seconds it took."""
    t0 = time.monotonic()
    wait_for(what, check, timeout=timeout, interval=interval)
    return time.monotonic() - t0
