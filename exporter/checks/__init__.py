"""Active health checks: measurements the hardware has to pass, not only faults it reports.

Every check is a small module behind one interface (:class:`exporter.checks.base.Check`): a name,
whether it loads the GPU (``invasive``), and ``run`` returning a :class:`~exporter.checks.base.CheckResult`
with per-device values and a verdict. :mod:`exporter.checks.runner` runs them on demand (the exporter's
``GET /checks``) and on a schedule, never two on one GPU at once, invasive ones only on idle GPUs, each
within a deadline; :mod:`exporter.checks.metrics` publishes the results as raw series, and the
thresholds that page people live in ``alerts/active-checks.yaml``.
"""
