"""planekv.evaluation: real-model quality of PlaneKV and the baselines.

Calibration from text (``calibrate``), teacher-forced perplexity (``perplexity``), passkey
retrieval (``passkey``), the flexible reader's K/V split search (``split_search``), reports
(``report``) and the whole run (``suite``). Each job module runs as ``python -m
planekv.evaluation.<job> --out DIR`` (the Ray job entrypoint form). Perplexity and passkey are lists of units
(``units``: journaled, resumable) run in this process or by a registered executor's workers (``executors``).
Builds on ``planekv.models``.
"""

from .common import ALL_SYSTEMS, RATES, SystemRow, default_k_share, system_rows
from .texts import CALIBRATION_TEXT, DEV_TEXT, FILLER_TEXT, TEST_TEXTS, load_text

__all__ = ["ALL_SYSTEMS", "CALIBRATION_TEXT", "DEV_TEXT", "FILLER_TEXT", "RATES", "TEST_TEXTS", "SystemRow",
           "default_k_share", "load_text", "system_rows"]
