"""The decision engine: alerts in, decision records out, actions through the Cluster/Aws seams.

A delivery is handled in two passes. First every alert is observed: the node it names (label
configurable) and the first matching policy rule (a rule's node selector looks at that node's labels
as observed; a resolve keeps the rule its alert fired under); firing alerts that would act feed the
storm breaker, resolved ones leave it, and the breaker is evaluated against the eligible nodes. Then
each alert's actions run in order (`on_resolved` ones when the alert resolved), each through, in this order:

1. idempotency: (fingerprint, startsAt, status, action, dry-run) already decided -> nothing new;
2. protected nodes (control plane, opt-out label) and nodes that do not exist -> skipped;
3. the pause switch, then (firing alerts only) the storm breaker -> deferred;
4. ordering: a disruptive action waits while an earlier one of the same alert is incomplete;
5. the target's own state (already cordoned? taint present? cordoned by us and untouched since?);
6. rate limits per action kind, then the disruption budget (disruptive actions only) -> deferred.

A deferred action is not decided: it is listed in `pending` (GET /state, a gauge) and decided again
on the next delivery of the alert.

A live drain runs in the background (`Cluster.drain` may take as long as the policy's timeout, far
longer than Alertmanager waits for a webhook answer): one task per node, owned by the engine. Its
start is recorded as `started`, its end as `done` (every pod gone) or `failed` (deadline passed,
refused, or interrupted), and when it ends the alert's later actions (e.g. aws_set_unhealthy) are
decided at once, through the same gates, without waiting for a resend. A resend, or another alert
for the same node, joins the running drain instead of starting a second one. A drain that ended
because the deadline passed counts as ended (the later actions run); a drain refused because pods
need permission (bare pods, emptyDir data) does not: its later disruptive actions are skipped and a
human decides. An alert that resolves while its drain runs lets the drain finish (a drain is never
reversed) and its later actions are skipped. A drain interrupted by the backend (unreachable, not the
leader) or by shutdown is not decided: the next delivery starts it again, and the executor resumes
it with its original deadline. Dry-run takes exactly the same path and changes nothing: no call
that mutates the cluster or AWS, nothing written. What the engine must remember lives on the nodes it
acts on (remediator/record.py): each write that acts also records, in the same request, which alert
episode it was for and which step; a new leader rebuilds budget holders, ownership, idempotency,
running drains and rate-limit times from the nodes before it is ready. The pause switch and the
breaker's latch, which no node can hold, are one small document written only when they change
(remediator/state.py).

The parts, each handed its collaborators (composition, not a chain of subclasses):

- `model`: settings, results, plans, pending actions, the gates at a glance, running drains;
- `records`: `NodeView`, the nodes and this service's record on each (remediator/record.py);
- `gates`: `Gates` (pause, breaker, order, rate limits, budgets) and `LatchStore` (the gates document);
- `events`: `EventRecorder`, the node's Events;
- `node_actions`, `aws_actions`: `NodeActuator`, `AwsActuator`, each action against its target;
- `evidence`: `EvidenceActuator`, the evidence captured before anything disruptive (remediator/evidence/);
- `drains`: `DrainRunner`, drains in the background;
- `pipeline`: `Reconciler`, one alert's actions in order, through idempotency and the gates;
- `migrate`: an older release's gate-state document moved onto the nodes, once;
- `stored`: the deliveries the engine makes up (Alertmanager's view, a resolve, a resumed drain);
- `core`: the `Engine` the service uses (intake, the rebuild of a new leader, status).
"""

from remediator.engine.core import Engine
from remediator.engine.events import FAILURE_REASONS, NodeEvent, action_event
from remediator.engine.model import AlertPlan, EngineSettings, GateStatus, PendingAction
from remediator.engine.stored import alert_document

__all__ = [
    "FAILURE_REASONS",
    "AlertPlan",
    "Engine",
    "EngineSettings",
    "GateStatus",
    "NodeEvent",
    "PendingAction",
    "action_event",
    "alert_document",
]
