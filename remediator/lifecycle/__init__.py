"""A node's remediation as one lifecycle: the work queue keyed by node and the phases on the node."""
