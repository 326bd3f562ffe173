"""What comes in: the HTTP service (Alertmanager's webhook, auth, the operator endpoints) and the
webhook payload's model (bad input is a 4xx naming the field)."""
