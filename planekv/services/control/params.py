"""Path parameters of the control plane's routes (checked against the patterns in schemas)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Path as PathParam

from .schemas import ID16, NAME, SEQ, STORE

HexId = Annotated[str, PathParam(pattern=ID16)]  # a format_id or calibration_id
PolicyName = Annotated[str, PathParam(pattern=NAME)]
SeqId = Annotated[str, PathParam(pattern=SEQ)]
StoreId = Annotated[str, PathParam(pattern=STORE)]
