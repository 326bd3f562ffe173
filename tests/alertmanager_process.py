"""A real Alertmanager (Debian's prometheus-alertmanager) on loopback, for tests.

Started with gossip off (`--cluster.listen-address=`), a scratch data directory and a config that
routes everything to one webhook receiver (or to a null receiver). Alerts are posted and silences set
through its API v2, as Prometheus and an operator would.
"""

from __future__ import annotations

import datetime
import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from examples.pipeline import free_port

BINARY = "prometheus-alertmanager"


def available() -> bool:
    return shutil.which(BINARY) is not None


def rfc3339(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).isoformat().replace("+00:00", "Z")


class Alertmanager:
    """One Alertmanager process; `url` is its base URL."""

    def __init__(self, *, workdir: Path, webhook_url: str | None = None, token: str | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        receiver: dict[str, Any] = {"name": "accel-health-remediator"}
        if webhook_url is not None:
            hook: dict[str, Any] = {"url": webhook_url, "send_resolved": True, "max_alerts": 0}
            if token is not None:
                hook["http_config"] = {"authorization": {"credentials": token}}
            receiver["webhook_configs"] = [hook]
        config = {
            "route": {
                "receiver": "accel-health-remediator",
                "group_by": ["node"],
                "group_wait": "0s",
                "group_interval": "1s",
                "repeat_interval": "4h",
            },
            "receivers": [receiver],
        }
        (workdir / "alertmanager.yml").write_text(json.dumps(config))
        self._log = (workdir / "alertmanager.log").open("wb")
        self._proc = subprocess.Popen(
            [
                BINARY,
                f"--config.file={workdir / 'alertmanager.yml'}",
                f"--storage.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--cluster.listen-address=",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited: {(self.workdir / 'alertmanager.log').read_text()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=1) as response:  # noqa: S310  http to loopback
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError("alertmanager not ready after 20 s")

    def stop(self) -> None:
        self._proc.terminate()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._log.close()

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(  # noqa: S310  http to loopback
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=5) as response:  # noqa: S310  http to loopback
            text = response.read()
        return json.loads(text) if text.strip() else None

    def post_alerts(self, *alerts: dict[str, Any]) -> None:
        """POST /api/v2/alerts, as Prometheus does."""
        self._request("POST", "/api/v2/alerts", list(alerts))

    def alerts(self) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._request("GET", "/api/v2/alerts")
        return found

    def silence(self, *, matchers: dict[str, str], minutes: float = 60) -> str:
        """POST /api/v2/silences with equality matchers; the silence id."""
        now = time.time()
        body = {
            "matchers": [
                {"name": k, "value": v, "isRegex": False, "isEqual": True} for k, v in matchers.items()
            ],
            "startsAt": rfc3339(now - 1),
            "endsAt": rfc3339(now + minutes * 60),
            "createdBy": "tests",
            "comment": "leave this node alone",
        }
        answer: dict[str, str] = self._request("POST", "/api/v2/silences", body)
        return answer["silenceID"]

    def expire_silence(self, silence_id: str) -> None:
        self._request("DELETE", f"/api/v2/silence/{silence_id}")


def fired(
    node: str, *, name: str = "AccelGPUFatalXid", starts_at: float, ends_in: float = 3600
) -> dict[str, Any]:
    """An alert as Prometheus posts it (startsAt fixed, endsAt ahead)."""
    return {
        "labels": {"alertname": name, "node": node},
        "annotations": {"summary": f"{name} on {node}"},
        "startsAt": rfc3339(starts_at),
        "endsAt": rfc3339(time.time() + ends_in),
        "generatorURL": "http://prometheus/graph",
    }


def ended(alert: dict[str, Any]) -> dict[str, Any]:
    """The same alert, resolved now (endsAt in the past)."""
    return {**alert, "endsAt": rfc3339(time.time() - 1)}
