"""Each step against its target, through the gates: node actions (condition, cordon, taint and their
reversals), AWS actions (replacement, reboot, CloudWatch), the node's Events, the evidence capture;
and drain planning with kubectl's semantics. They reach the cluster and AWS through the seams of
remediator/cluster.py, carried out by remediator/executors/."""
