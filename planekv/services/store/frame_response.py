"""Sending stored frames as they are: no copy, and the read leases released once sent."""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from ...tiering import Lease


class FrameResponse(Response):
    """One or more frames sent as they are (no copy), releasing the read leases once sent."""

    def __init__(self, frames: list[bytes], leases: list[Lease], headers: dict[str, str], media_type: str) -> None:
        self.frames, self.leases = frames, leases
        headers = {**headers, "content-length": str(sum(len(f) for f in frames))}
        super().__init__(content=None, headers=headers, media_type=media_type)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            if scope["method"] == "HEAD":
                await send({"type": "http.response.body", "body": b""})
                return
            last = len(self.frames) - 1
            for i, frame in enumerate(self.frames):
                await send({"type": "http.response.body", "body": frame, "more_body": i < last})
            if last < 0:
                await send({"type": "http.response.body", "body": b""})
        finally:
            for lease in self.leases:
                lease.release()
