"""The README's example of a cache spilling to NVMe and copying its blocks to a store service runs as written,
against the session's store (the README's URL, token and directory swapped for the test's)."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from planekv.services.clients import ControlClient, StoreClient

from .conftest import TOKEN

README = Path(__file__).resolve().parents[2] / "README.md"


def test_the_spill_and_store_example_runs(control, store, tmp_path, capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    first = blocks[0]
    tiering = next(b for b in blocks if "TieredCache(" in b and "tiered_decode_step" in b)
    tiers = next(b for b in blocks if "SpillTier(" in b)
    assert '"http://127.0.0.1:8090"' in tiers and '"/mnt/nvme/planekv"' in tiers and 'token="..."' in tiers
    tiers = (tiers.replace('"http://127.0.0.1:8090"', repr(store.url)).replace('token="..."', f"token={TOKEN!r}")
             .replace('"/mnt/nvme/planekv"', repr(str(tmp_path))))
    scope: dict = {}
    exec(compile(first, "README: the format, a cache and a decode read", "exec"), scope)
    exec(compile(tiering, "README: tiering", "exec"), scope)
    with ControlClient(control.url, TOKEN) as ctl:  # the store keeps blocks of registered formats only
        ctl.register_calibration(scope["calib"].calibration_id, scope["calib"].to_bytes())
        ctl.register_format(scope["spec"].to_dict())
    exec(compile(tiers, "README: spill and store tiers", "exec"), scope)
    tiered = scope["tiered"]
    tiered.host.block_bytes = 4096 + 4 * 2048  # small blocks (a policy's are >= 1 MiB), so that these pages seal some
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(1, 2, 300, 64, generator=g), torch.randn(1, 2, 300, 64, generator=g)
    codec = scope["codec"]
    tiered.append(0, codec.encode_k(k, 0), codec.encode_v(v, 0))  # 4 sealed pages per head: blocks to copy
    tiered.host.remote.flush(30)
    with StoreClient(store.url, TOKEN) as st:
        listed = st.list_blocks(sequence_id=tiered.sequence_ids[0]).blocks
    assert listed and all(b.key.startswith(scope["spec"].format_id) for b in listed)
    tiered.free(0)
    tiered.host.remote.close()
    scope["spill"].close()
