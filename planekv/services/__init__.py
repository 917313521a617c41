"""planekv.services: the control plane (FastAPI + Redis) and the store service (an HTTP face over
tiering's host and NVMe tiers). Builds on tiering.

``planekv control`` / ``planekv store`` (or ``python -m planekv.services.control|store``) run them;
``create_app(settings)`` in each module builds the ASGI app. Importing this package imports no web
framework.
"""
