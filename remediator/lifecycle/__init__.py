"""A node's remediation as one lifecycle, from the first fault back to the pool (docs/remediator.md "A node's
lifecycle"): healthy -> held -> evidence -> draining -> repair -> verifying -> returned, or escalated /
released to a human. One owner, one reconcile per node at a time, the node's record on the node.

Alerts come in (remediator/intake/), desired state is what fires now (remediator/desired/); for
each alert the steps of its policy rule run in order, each through, in this order:

1. idempotency: (fingerprint, startsAt, status, action, dry-run) already decided -> nothing new;
2. protected nodes (control plane, opt-out label) and nodes that do not exist -> skipped;
3. the pause switch, then (firing alerts only) the storm breaker -> deferred;
4. ordering: a disruptive action waits while an earlier one of the same alert is incomplete;
5. the target's own state (already cordoned? taint present? cordoned by us and untouched since?);
6. rate limits per action kind, then the disruption budget (disruptive actions only) -> deferred
   (remediator/gates/).

A deferred action is listed in `pending` (GET /state, a gauge) and decided again on the next
delivery of the alert. Dry-run takes exactly the same path and changes nothing.

The parts, each handed its collaborators (composition, not a chain of subclasses):

- `engine`: the `Engine` the service uses: intake of desired state, a new leader's rebuild, status;
- `queue`: the work queue keyed by node (one reconcile per node at a time, nodes in parallel);
- `steps`: `Reconciler`, one alert's steps in order, through idempotency and the gates;
- `drains`: `DrainRunner`, drains in the background, stopped by a human's uncordon;
- `node`: `NodeLifecycle`, the background reconcile of one node (a human's release, a drain nobody
  runs, a record nothing needs);
- `repair`, `repairservice`: the way back (recognise a repair, verify, return to the pool);
- `phases`: the phases and what moves a node between them;
- `record`: what this service keeps on a node (the record, ownership and drain annotations);
- `view`: `NodeView`, the nodes as observed and this service's record on each;
- `status`, `holds`: where each node is, read from the nodes alone (`accel-health status`);
- `model`: settings, results, plans, pending actions, the gates at a glance, running drains;
- `migrate`: an older release's gate-state document moved onto the nodes, once.

The actions themselves are remediator/actuators/ (nodes, AWS, Events, evidence); the backends that
carry them out are remediator/executors/ (Kubernetes, AWS, the in-memory snapshot).
"""
