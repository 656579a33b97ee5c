"""`deepspeed.runtime.sequence_tiled_compute`: ALST's tiled compute; `TiledMLP` is zerodp.sequence's.
`sequence_tiled_compute` / `SequenceTiledCompute` and `TiledFusedLogitsLoss` are not built yet."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.sequence import TiledMLP

__all__ = ["TiledMLP"]
__getattr__ = missing_attributes(__name__)
