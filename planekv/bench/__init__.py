"""planekv.bench: benchmark harnesses with a public API, used by the ``planekv bench`` command, the scripts in
``benchmarks/`` and the tests. Above the kernels (it times them) and the evaluation package (it reads the frozen
K/V split); nothing below imports it.

- :mod:`.attention`: every decode-attention system in one harness, beside torch SDPA in the same run;
- :mod:`.timing`: CUDA-graph timing and per-kernel timelines;
- :mod:`.traffic`: a step's physical bytes counted from the layout.
"""

from .attention import (
    SHAPES,
    SYSTEMS,
    Row,
    Shape,
    StepData,
    check_against_reference,
    config_with,
    format_table,
    format_timeline,
    parse_settings,
    policy_of,
    run_bench,
    synthetic_step,
)
from .output import rows_to_json
from .timing import time_graphs, timeline, timeline_or_error
from .traffic import readkv_physical, sector_bytes_k, sector_bytes_v

__all__ = ["SHAPES", "SYSTEMS", "Row", "Shape", "StepData", "check_against_reference", "config_with", "format_table",
           "format_timeline", "parse_settings", "policy_of", "readkv_physical", "rows_to_json", "run_bench",
           "sector_bytes_k", "sector_bytes_v", "synthetic_step", "time_graphs", "timeline", "timeline_or_error"]
