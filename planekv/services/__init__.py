"""planekv.services: the control plane (FastAPI + Redis) and the store service (an HTTP face over
tiering's host and NVMe tiers). Builds on tiering."""
