"""The desired state: what fires now, per node. From webhook deliveries (kept with an expiry) and
from Alertmanager's API v2 (silenced and inhibited state, real endsAt), and the deliveries the engine
makes up from them (a resolve of an alert no Alertmanager shows any more)."""
