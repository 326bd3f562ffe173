"""The fleet simulator (bench/fleet.py) serves what the shipped scrape configuration scrapes.

Real Prometheus runs deploy/prometheus/prometheus.yaml (pod discovery played through file_sd, the
shipped relabeling, the rules of alerts/) against 20 simulated nodes and one real exporter on the
simulated gpu-node-1 (the one the bodies were captured from). Scrape intervals longer than 2 s are
shortened to 2 s so a slow job's first scrape comes within the test; paths, jobs and relabeling are as
shipped. Also: the jobs are read from the configuration, not assumed (a fast/slow split is found).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))  # the simulator is a benchmark's module (bench/ is no package)

from fleet import (  # noqa: E402  after sys.path
    FAULT_COUNTERS,
    Exposition,
    FleetServer,
    Prometheus,
    RealExporter,
    ScrapeJob,
    capture,
    exporter_job_regex,
    exporter_jobs,
    exporter_pod,
    exporter_template,
    load_config,
    prometheus_config,
    sample_count,
    target_labels,
    write_file_sd,
)

from tests.kube.controlplane import wait_for  # noqa: E402

NODES = 20
REAL_NODE = "gpu-node-1"
GPUS = 8

pytestmark = pytest.mark.skipif(
    not (shutil.which("prometheus") and shutil.which("kubectl")),
    reason="needs prometheus and kubectl (make test installs them: scripts/install-tools.sh)",
)


@dataclass(frozen=True)
class Scraped:
    prometheus: Prometheus
    jobs: list[ScrapeJob]
    sim_nodes: list[str]
    real_series: int
    """Samples the real exporter serves on the scraped paths, all together."""


@pytest.fixture(scope="module")
def scraped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    workdir = tmp_path_factory.mktemp("fleet")
    config, template = load_config(), exporter_template()
    jobs = exporter_jobs(config, template)
    ports = frozenset().union(*(j.port_names for j in jobs))
    with RealExporter(workdir / "exporter") as real:
        captured = {j.metrics_path: real.get(j.metrics_path) for j in jobs}
        bodies = {path: Exposition.parse(body) for path, body in captured.items()}
        with FleetServer(bodies, NODES) as server:
            pods = [
                *server.pods(template, jobs),
                exporter_pod(template, node=REAL_NODE, ip="127.0.0.1", port=real.port, ports=ports),
            ]
            sd = write_file_sd(workdir / "sd", config, pods)
            prom_config = prometheus_config(config, sd_files=sd, max_interval=2.0)
            with Prometheus(workdir / "prometheus", prom_config) as prometheus:
                regex = exporter_job_regex(jobs)
                wait_for(
                    "every target of every exporter job scraped",
                    lambda: prometheus.value(f'count(up{{job=~"{regex}"}})') == len(jobs) * (NODES + 1),
                    timeout=25,
                    interval=0.25,
                )
                yield Scraped(
                    prometheus=prometheus,
                    jobs=jobs,
                    sim_nodes=[n.name for n in server.fleet],
                    real_series=sum(sample_count(body) for body in captured.values()),
                )


def test_every_target_of_every_exporter_job_is_up(scraped: Scraped) -> None:
    regex = exporter_job_regex(scraped.jobs)
    up = scraped.prometheus.query(f'up{{job=~"{regex}"}}')
    assert {(r["metric"]["job"], r["metric"]["node"]) for r in up if r["value"][1] == "1"} == {
        (job.name, node) for job in scraped.jobs for node in [*scraped.sim_nodes, REAL_NODE]
    }


def test_each_node_has_as_many_series_as_the_real_exporter_serves(scraped: Scraped) -> None:
    regex = exporter_job_regex(scraped.jobs)
    # Scraped series only: the rules' recorded series (`accel:...`) keep the job label of what they
    # record, and exist once their group has run.
    scraped_only = f'{{job=~"{regex}",__name__!~"up|scrape_.+|.+:.+"}}'
    per_node = scraped.prometheus.by("node", f"count by (node) ({scraped_only})")
    assert scraped.real_series > 400  # 8 GPUs, 8 InfiniBand ports: about 490 series
    assert per_node == dict.fromkeys([*scraped.sim_nodes, REAL_NODE], float(scraped.real_series))


def test_every_series_names_its_node(scraped: Scraped) -> None:
    regex = exporter_job_regex(scraped.jobs)
    nodes = scraped.prometheus.by("node", f'count by (node) ({{job=~"{regex}"}})')
    assert set(nodes) == {*scraped.sim_nodes, REAL_NODE}
    assert scraped.prometheus.query(f'{{job=~"{regex}",node=""}}') == []


def test_the_simulators_relabeling_agrees_with_prometheus(scraped: Scraped) -> None:
    config = load_config()
    targets = scraped.prometheus.active_targets()
    by_job = {j.name: j for j in scraped.jobs}
    compared = 0
    for target in targets:
        if target["scrapePool"] not in by_job:
            continue
        job = config["scrape_configs"][by_job[target["scrapePool"]].index]
        group = {"targets": [target["discoveredLabels"]["__address__"]], "labels": target["discoveredLabels"]}
        ours = target_labels(config, job, group)
        assert ours is not None
        assert {k: v for k, v in ours.items() if not k.startswith("__")} == target["labels"]
        compared += 1
    assert compared == len(scraped.jobs) * (NODES + 1)


def test_each_node_has_gpus_of_its_own(scraped: Scraped) -> None:
    uuids = scraped.prometheus.query("count by (uuid, node) (accel_gpu_info)")
    by_node: dict[str, set[str]] = {}
    for r in uuids:
        by_node.setdefault(r["metric"]["node"], set()).add(r["metric"]["uuid"])
    assert {node: len(found) for node, found in by_node.items()} == dict.fromkeys(
        [*scraped.sim_nodes, REAL_NODE], GPUS
    )
    everyone = [uuid for found in by_node.values() for uuid in found]
    assert len(set(everyone)) == len(everyone) == GPUS * (NODES + 1)
    assert all(uuid.startswith("GPU-") and len(uuid) == 40 for uuid in everyone)


def test_a_fast_and_a_slow_job_are_read_from_the_configuration() -> None:
    config, template = load_config(), exporter_template()
    assert [(j.name, j.metrics_path, j.interval, j.timeout) for j in exporter_jobs(config, template)] == [
        ("accel-health-exporter-fast", "/metrics/fast", 2.0, 1.0),
        ("accel-health-exporter", "/metrics/slow", 60.0, 10.0),
    ]
    # A configuration under review: the slow path every 30 s instead.
    review = config | {
        "scrape_configs": [
            j | {"scrape_interval": "30s"} if j["job_name"] == "accel-health-exporter" else j
            for j in config["scrape_configs"]
        ]
    }
    assert [j.interval for j in exporter_jobs(review, template)] == [2.0, 30.0]


def test_identities_differ_per_node_and_are_the_same_on_every_path() -> None:
    fast = Exposition.parse(b'a{gpu="0",uuid="GPU-8e8df7ef-d2bf"} 1\nb{serial="1654922002345",x="y"} 0\n')
    slow = Exposition.parse(b'c{uuid="GPU-8e8df7ef-d2bf",model="H100"} 2\n')
    one, two = fast.for_node("node-a"), fast.for_node("node-b")
    assert one != two
    assert one == fast.for_node("node-a")
    uuid = one.split(b'uuid="')[1].split(b'"')[0]
    assert uuid in slow.for_node("node-a")
    assert uuid.startswith(b"GPU-")
    assert len(uuid) == len(b"GPU-8e8df7ef-d2bf")
    serial = one.split(b'serial="')[1].split(b'"')[0]
    assert serial.isdigit()
    assert len(serial) == 13
    assert serial != b"1654922002345"
    assert b'x="y"' in one
    assert b'model="H100"' in slow.for_node("node-a")


def test_a_faulted_capture_serves_every_ports_rises_fast_and_every_tenth_node_serves_it(
    tmp_path: Path,
) -> None:
    bodies = capture(["/metrics/fast"], workdir=tmp_path / "healthy")
    faulted = capture(["/metrics/fast"], workdir=tmp_path / "faulted", faulted=True)
    rises = b"accel_infiniband_port_events_seen_total{"
    assert bodies["/metrics/fast"].count(rises) == 0
    assert faulted["/metrics/fast"].count(rises) == 8 * len(FAULT_COUNTERS)  # 8 ports
    server = FleetServer(
        {"/metrics/fast": Exposition.parse(bodies["/metrics/fast"])},
        100,
        faulted={"/metrics/fast": Exposition.parse(faulted["/metrics/fast"])},
        faulty=0.1,
    )
    chosen = [index for index in range(100) if server.is_faulty(index)]
    assert len(chosen) == 10
    assert sum(1 for index in chosen if index < 50) == 5  # spread, not bunched at one end
