"""Evidence for the vendor before a node leaves (issue 26): what failed, on which serial, and the lines
that said so.

A reboot clears the kernel ring buffer and a replaced instance takes its disks with it, so the policy's
`evidence` step (remediator/policy.py `CaptureEvidence`, shipped before the drain of a fatal fault and
so before `aws_reboot` and `aws_set_unhealthy`) captures, once per alert episode:

- the node's own evidence, `GET http://<exporter pod IP>:9835/evidence` with the checks token (device
  identity: GPU serial, UUID, part number, VBIOS, driver and CUDA versions; the fault records with
  their kernel and wall-clock times, bounded; the latest active checks), schema
  `accel-health.io/evidence/v1`;
- what this service knows: the alerts firing on the node and their labels, its decisions for the node,
  a timeline, the Node's name, uid, providerID, boot id and a few labels.

The parts, each handed its collaborators:

- `bundle`: the capture document (pure): built, bounded in size, named;
- `fetch`: `ExporterEvidence`, the HTTP fetch with the bearer token;
- `store`: `ConfigMapEvidenceStore` (the cluster: one immutable ConfigMap per capture in the
  remediator's namespace, bounded per node and in total, with a retention), `S3EvidenceStore` (a
  bucket, `--evidence-bucket`) and `MemoryEvidenceStore` (a cluster snapshot, tests);
- `report`: the text report `accel-health evidence NODE` prints;
- `cli`: that command.

The engine's step itself is remediator/actuators/evidence.py.
"""
