"""deploy/ repeats no source by hand: the checked-in renderings of alerts/*.yaml, the example
Alertmanager routing, the dashboards, the default policy and the image named in pyproject.toml equal a
fresh rendering, and the renderer picks up every rule file and refuses routing or image names it cannot
express."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from scripts.render_manifests import (
    REPO,
    RenderError,
    alertmanager_config,
    dashboard_configmaps,
    dashboard_files,
    image_component,
    parse_matcher,
    prometheus_rule,
    render_all,
    rule_files,
    stale_files,
)


def test_checked_in_renderings_equal_a_fresh_rendering() -> None:
    stale = stale_files(render_all())
    assert not stale, "stale, run `make manifests`: " + ", ".join(str(p.relative_to(REPO)) for p in stale)


def test_prometheusrule_holds_every_group_of_every_rule_file() -> None:
    files = rule_files()
    assert {p.name for p in files} >= {"gpu-xid.yaml", "neuron.yaml", "infiniband.yaml", "exporter.yaml"}
    expected = [g for p in files for g in yaml.safe_load(p.read_text())["groups"]]
    assert prometheus_rule(files)["spec"]["groups"] == expected


def test_a_new_rule_file_is_included_without_touching_the_renderer(tmp_path: Path) -> None:
    extra = tmp_path / "zz-new.yaml"
    extra.write_text(
        "groups:\n  - name: accel-new\n    rules:\n      - alert: New\n        expr: vector(1)\n"
    )
    groups = prometheus_rule([*rule_files(), extra])["spec"]["groups"]
    assert groups[-1]["name"] == "accel-new"


def test_a_rule_file_without_groups_is_refused(tmp_path: Path) -> None:
    bad = tmp_path / "x.yaml"
    bad.write_text("groups: []\n")
    with pytest.raises(RenderError, match="no rule groups"):
        prometheus_rule([bad])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('remediation=~"drain|cordon"', {"name": "remediation", "value": "drain|cordon", "matchType": "=~"}),
        ('severity!="critical"', {"name": "severity", "value": "critical", "matchType": "!="}),
        ('a="say \\"hi\\""', {"name": "a", "value": 'say "hi"', "matchType": "="}),
    ],
)
def test_matchers_become_structured_matchers(text: str, expected: dict[str, str]) -> None:
    assert parse_matcher(text) == expected


@pytest.mark.parametrize("text", ["severity=critical", '=~"x"', 'a~"b"'])
def test_matchers_it_cannot_read_are_refused(text: str) -> None:
    with pytest.raises(RenderError):
        parse_matcher(text)


def test_deprecated_match_routes_are_refused() -> None:
    example = {
        "route": {"receiver": "x", "routes": [{"receiver": "accel-health-remediator", "match": {"a": "b"}}]},
        "receivers": [{"name": "accel-health-remediator"}],
    }
    with pytest.raises(RenderError, match="deprecated"):
        alertmanager_config(example)


def test_common_matchers_move_to_the_parent_route() -> None:
    example = yaml.safe_load((REPO / "examples" / "alertmanager.yaml").read_text())
    route = alertmanager_config(example)["spec"]["route"]
    assert [m["name"] for m in route["matchers"]] == ["remediation"]
    assert [[m["name"] for m in r["matchers"]] for r in route["routes"]] == [["severity"], ["severity"]]


def test_every_dashboard_gets_a_configmap_the_grafana_sidecar_picks_up() -> None:
    maps = dashboard_configmaps(dashboard_files())
    assert len(maps) == len(dashboard_files()) >= 2
    for cm in maps:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        ((name, text),) = cm["data"].items()
        assert (REPO / "dashboards" / name).read_text() == text


def test_the_image_component_names_the_pyproject_image_with_the_package_version(tmp_path: Path) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text(
        '[project]\nname = "x"\nversion = "1.2.3"\n\n'
        '[tool.accel-health.image]\nname = "registry.example.com/team/accel-health"\n'
    )
    (image,) = image_component(pyproject)["images"]
    assert image == {
        "name": "accel-health",
        "newName": "registry.example.com/team/accel-health",
        "newTag": "1.2.3",
    }


@pytest.mark.parametrize(
    ("table", "message"),
    [
        ("", r"\[tool.accel-health.image\] name"),
        ('[tool.accel-health.image]\nname = "ghcr.io/a/b:latest"\n', "without a tag"),
    ],
)
def test_an_image_name_that_cannot_be_tagged_is_refused(tmp_path: Path, table: str, message: str) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project]\nname = "x"\nversion = "1.2.3"\n\n' + table)
    with pytest.raises(RenderError, match=message):
        image_component(pyproject)
