"""Where the remediator finds its Kubernetes credentials: client-go's and controller-runtime's order.

--kubeconfig, else $KUBECONFIG, else the pod's service account (KUBERNETES_SERVICE_HOST/PORT set and
a token mounted), else ~/.kube/config; --in-cluster means the service account and nothing else; when
nothing is there, the error names every source tried.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from remediator.executors.kubernetes import KubernetesCluster


def kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: '{server}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    return path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """A flag file, a $KUBECONFIG file, a service-account mount and a home with ~/.kube/config."""
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_text("-----BEGIN CERTIFICATE-----\n")
    home = tmp_path / "home"
    (home / ".kube").mkdir(parents=True)
    kubeconfig(home / ".kube" / "config", "https://home:6443")
    return {
        "flag": kubeconfig(tmp_path / "flag", "https://flag:6443"),
        "env": kubeconfig(tmp_path / "env", "https://env:6443"),
        "sa": sa,
        "home": home,
    }


async def found(places: dict[str, Path], env: dict[str, str], *, flag: bool = False) -> tuple[str, str]:
    got = await KubernetesCluster.configuration(
        kubeconfig=places["flag"] if flag else None,
        environ={"HOME": str(places["home"]), **env},
        service_account_dir=places["sa"],
    )
    return str(got.configuration.host), got.source


POD = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}


async def test_credentials_follow_client_gos_order(places: dict[str, Path]) -> None:
    env = {"KUBECONFIG": str(places["env"]), **POD}
    assert (await found(places, env, flag=True))[0] == "https://flag:6443"
    assert (await found(places, env))[0] == "https://env:6443"
    host, source = await found(places, POD)
    assert host == "https://10.96.0.1:443"
    assert source.startswith("in-cluster service account")
    assert (await found(places, {}))[0] == "https://home:6443"


async def test_a_kubeconfig_variable_naming_no_file_falls_through_to_the_service_account(
    places: dict[str, Path], tmp_path: Path
) -> None:
    host, _ = await found(places, {"KUBECONFIG": str(tmp_path / "absent"), **POD})
    assert host == "https://10.96.0.1:443"


async def test_a_pod_without_a_mounted_token_is_not_taken_for_in_cluster(places: dict[str, Path]) -> None:
    (places["sa"] / "token").unlink()
    assert (await found(places, POD))[0] == "https://home:6443"


async def test_without_any_credentials_the_error_names_every_source_tried(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot load Kubernetes client configuration") as caught:
        await KubernetesCluster.configuration(
            environ={"HOME": str(tmp_path), "KUBECONFIG": str(tmp_path / "gone")},
            service_account_dir=tmp_path / "sa",
        )
    message = str(caught.value)
    assert "--kubeconfig (not given)" in message
    assert f"$KUBECONFIG (no file at {tmp_path / 'gone'})" in message
    assert "in-cluster service account (KUBERNETES_SERVICE_HOST/KUBERNETES_SERVICE_PORT not set)" in message
    assert f"{tmp_path / '.kube' / 'config'} (no such file)" in message


async def test_in_cluster_means_the_service_account_and_nothing_else(places: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match=r"service account .*Service host/port is not set"):
        await KubernetesCluster.configuration(
            in_cluster=True, environ={"HOME": str(places["home"])}, service_account_dir=places["sa"]
        )


async def test_a_malformed_kubeconfig_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad"
    bad.write_text("just: text\n")
    with pytest.raises(ValueError, match=f"from --kubeconfig {bad}"):
        await KubernetesCluster.configuration(kubeconfig=bad, environ={}, service_account_dir=tmp_path)
