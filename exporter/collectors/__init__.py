"""Collectors: pure functions from reader data to metric families, and the framework that runs them."""
