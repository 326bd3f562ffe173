"""A stand-in for the exporter's `GET /evidence` over real HTTP (aiohttp on loopback): the document of
the exporter's contract (accel-health.io/evidence/v1), the bearer token checked, requests counted,
and a delay or an error status when a test wants one."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

TOKEN = "checks-token-0123456789"
XID_LINE = "NVRM: Xid (PCI:0000:9d:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
GPU4_SERIAL = "1652823045271"
GPU4_UUID = "GPU-5c1d9e0a-7f3b-4a39-8f2e-6b4d2c1a0f04"


def gpu(index: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": GPU4_UUID if index == 4 else f"GPU-00000000-0000-0000-0000-00000000000{index}",
        "serial": GPU4_SERIAL if index == 4 else f"16528230452{index:02d}",
        "board_part_number": "692-2G520-0200-000",
        "vbios_version": "96.00.89.00.01",
        "inforom_image_version": "G520.0200.00.05",
        "name": "NVIDIA H100 80GB HBM3",
        "pci_bus_id": f"0000:{0x18 + index * 0x10:02x}:00.0" if index != 4 else "0000:9d:00.0",
        "pci_device_id": "0x233010DE",
        "pci_subsystem_id": "0x16C110DE",
    }


def rec(seq: int, line: str, *, t: str = "2025-11-22T20:31:05.118Z") -> dict[str, Any]:
    return {"seq": seq, "monotonic_us": 1_234_567_890 + seq, "time": t, "line": line}


def evidence_doc(node: str, *, gpus: int = 8, padding: int = 0) -> dict[str, Any]:
    """The exporter's document for `node`; `padding` extra Xid 13 lines (about 100 bytes each)."""
    noise = [
        rec(100 + i, f"NVRM: Xid (PCI:0000:18:00): 13, pid={i}, Graphics Exception {'x' * 40}")
        for i in range(padding)
    ]
    return {
        "schema": "accel-health.io/evidence/v1",
        "node": node,
        "boot_id": "3f1e2d4c-8b7a-4c2d-9e1f-0a1b2c3d4e5f",
        "collected_at": "2025-11-22T20:31:08.001Z",
        "exporter_version": "0.1.0",
        "host": {"driver_version": "550.54.15", "cuda_driver_version": "12.4", "kernel": "5.15.0-1063-aws"},
        "gpus": [gpu(i) for i in range(gpus)],
        "neuron_devices": [],
        "hcas": [
            {
                "device": "mlx5_0",
                "board_id": "MT_0000000838",
                "fw_ver": "28.39.1002",
                "node_guid": "a088:c203:00a1:b2c4",
            }
        ],
        "records": [
            {
                "kind": "xid",
                "device": "0000:9d:00",
                "code": "79",
                "seen": 1,
                "dropped": 0,
                "first": [rec(42, XID_LINE)],
                "last": [rec(42, XID_LINE)],
            },
            *(
                [
                    {
                        "kind": "xid",
                        "device": "0000:18:00",
                        "code": "13",
                        "seen": padding,
                        "dropped": 0,
                        "first": noise,
                        "last": [],
                    }
                ]
                if padding
                else []
            ),
        ],
        "checks": [
            {
                "check": "remapped",
                "verdict": "pass",
                "message": "no pending remaps",
                "finished_at": "2025-11-22T19:00:00Z",
            }
        ],
    }


@dataclass
class EvidenceServer:
    """What the server answers, and what it was asked."""

    delay: float = 0.0
    """Seconds before answering."""
    status: int = 200
    """Answer with this status instead of the document (the token is checked first either way)."""
    padding: int = 0
    """Extra record lines in each document."""
    requests: list[str] = field(default_factory=list)
    """The nodes asked for, in order."""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{node}/evidence", self._evidence)
        return app

    async def _evidence(self, request: web.Request) -> web.Response:
        node = request.match_info["node"]
        self.requests.append(node)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "unauthorized"}, status=401)
        if self.delay:
            await asyncio.sleep(self.delay)
        if self.status != 200:
            return web.json_response({"error": "broken"}, status=self.status)
        return web.json_response(evidence_doc(node, padding=self.padding))
