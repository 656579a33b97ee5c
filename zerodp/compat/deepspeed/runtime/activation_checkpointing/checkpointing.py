"""`deepspeed.checkpointing` (= `deepspeed.runtime.activation_checkpointing.checkpointing`): zerodp.checkpointing.

zerodp's checkpoint is torch's non-reentrant one (RNG restored), so `non_reentrant_checkpoint` is the same
function; `configure` takes DeepSpeed's arguments (see zerodp.checkpointing.configure)."""

from zerodp.checkpointing import checkpoint, configure
from zerodp.compat.deepspeed._missing import missing_attributes

non_reentrant_checkpoint = checkpoint

__all__ = ["checkpoint", "configure", "non_reentrant_checkpoint"]
__getattr__ = missing_attributes(__name__)
