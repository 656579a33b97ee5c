"""`deepspeed.runtime.sequence_parallel`: Ulysses sequence parallelism (ALST) on zerodp.sequence."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.runtime.sequence_parallel import parallel_state_sp, ulysses_sp

__all__ = ["parallel_state_sp", "ulysses_sp"]
__getattr__ = missing_attributes(__name__)
