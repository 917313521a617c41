"""planekv.services: the control plane (FastAPI + Redis) and the store service (an HTTP face over
tiering's host and NVMe tiers). Builds on tiering and kvstore.

``planekv control`` / ``planekv store`` (or ``python -m planekv.services.control|store``) run them;
``create_app(settings)`` in each package builds the ASGI app. ``arguments`` holds both services'
flags, ``common`` what their apps share (errors, auth, metrics, uvicorn), ``index`` the block index
in Redis. Importing this package imports no web framework.
"""
