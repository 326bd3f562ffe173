"""The safety gates every action passes (pure, on an injected clock): the pause switch, the storm
breaker, rate limits, the disruption budgets (global and per rule, with reservations while a write
is in flight), and the one small document that keeps the pause and the breaker's latch."""
