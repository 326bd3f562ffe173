"""Executors: implementations of the Cluster and Aws seams (remediator.cluster).

`snapshot` acts on an in-memory cluster (demo, what-if); `kubernetes` on a real API server through
kubernetes.aio; `aws` on Auto Scaling and CloudWatch through boto3. They do not import each other.
"""
