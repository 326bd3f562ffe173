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
that mutates the cluster or AWS, no gate-state write. Gate state lives in the cluster (see
remediator/state.py): read at `start()` and again on becoming leader, written after each delivery
that changed it, with a resourceVersion precondition.

The parts, each a layer over the one before it (one concern per module):

- `model`: settings, results, plans, pending actions, the gates at a glance, running drains;
- `stored`: alerts as documents and the deliveries the engine makes up (API view, resume);
- `base`: shared state, decision records, deferrals;
- `state_sync`: the gate state read from and written to the cluster;
- `gates`: pause, breaker, order, rate limits, budget, holds of other causes;
- `events`: the node's Events;
- `node_actions`, `aws_actions`: each action against its target;
- `drains`: drains in the background and what follows them;
- `pipeline`: one alert's actions in order, through idempotency and the gates;
- `intake`: desired state (webhooks, Alertmanager's API) and observed state (nodes);
- `core`: the `Engine` the service uses (sync on leadership, stop, status).
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
