"""planekv.kvstore: the ground layer. Format identity, codec, plane layout and cache objects, the
depth allocator, the torch reference reader, baselines and accounting. Imports nothing else of
PlaneKV."""

from . import reference
from .accounting import (
    Capacity,
    capacity,
    capacity_for,
    dense_bytes,
    history_reads,
    logical_read_bits,
    rate,
    two_stage_workspace_bytes,
    write_amortization,
)
from .allocate import greedy_allocate, ladder, threshold_allocate
from .calibration import Calibration, CalibrationBuilder, calibrate
from .codebook import CODEBOOKS, GaussianTree, NestedCodebook, UniformLinearTree, lloyd_max_levels, make_codebook
from .codec import Codec
from .errors import BudgetError, CacheFull, CalibrationError, FormatMismatch, PlaneKVError
from .format import FormatSpec
from .planes import PlaneKVCache, pack_k_page, pack_v_page, v_planes
from .policy import ReadPolicy
from .residency import Residency
from .stats import ReadStats
from .transform import HadamardSign, block_sizes, hadamard_matrix

__all__ = [
    "block_sizes", "BudgetError", "CacheFull", "calibrate", "Calibration", "CalibrationBuilder",
    "CalibrationError", "Capacity", "capacity", "capacity_for", "CODEBOOKS", "Codec", "dense_bytes",
    "FormatMismatch", "FormatSpec", "GaussianTree", "greedy_allocate", "hadamard_matrix", "HadamardSign",
    "history_reads", "ladder", "lloyd_max_levels", "logical_read_bits", "make_codebook", "NestedCodebook",
    "pack_k_page", "pack_v_page", "v_planes", "PlaneKVCache", "PlaneKVError", "rate", "ReadPolicy", "ReadStats",
    "Residency",
    "reference", "threshold_allocate", "two_stage_workspace_bytes", "UniformLinearTree", "write_amortization",
]
