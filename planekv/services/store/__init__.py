"""The store service: an HTTP face over :class:`planekv.tiering.BlockStore` (DESIGN section 6).

``PUT / GET / HEAD / DELETE /v1/blocks/{key}`` move framed blocks (the frame is the body, byte for
byte), ``POST /v1/blocks:batch-get`` returns several frames concatenated (each frame carries its
own key and length, so the body splits without an index; missing keys are simply absent).
The block index is published to Redis (metadata only) unless ``PLANEKV_STORE__REDIS_INDEX=false``.

Where things are: ``app`` (``create_app``, ``build_store``, ``serve``, ``main``) composes the
``routes``; ``schemas`` holds the response bodies, ``context`` what the routes share (the block
store), ``frame_response`` the zero-copy frame response and ``metrics`` the block store's
Prometheus collector.

Run: ``planekv store`` or ``python -m planekv.services.store``.
"""

from .app import build_store, create_app, main, serve

__all__ = ["build_store", "create_app", "main", "serve"]
