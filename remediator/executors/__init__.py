"""Executors: implementations of the Cluster and Aws seams (remediator.cluster).

Only the in-memory snapshot backend exists yet; the Kubernetes (kubernetes.aio) and AWS (boto3)
executors come in later issues and must not import each other.
"""
