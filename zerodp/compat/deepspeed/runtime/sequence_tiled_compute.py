"""`deepspeed.runtime.sequence_tiled_compute`: ALST's tiled compute (zerodp/sequence/tiled.py and
tiled_compute.py). DeepSpeed 0.19.8 defines these in `deepspeed.runtime.sequence_parallel.ulysses_sp`,
which exports the same objects."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.sequence import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = ["SequenceTiledCompute", "TiledFusedLogitsLoss", "TiledMLP", "sequence_tiled_compute"]
__getattr__ = missing_attributes(__name__)
