"""`deepspeed.launcher`: `runner.DEEPSPEED_ENVIRONMENT_NAME` (the launcher itself is `zerodp deepspeed`)."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.launcher import runner

__all__ = ["runner"]
__getattr__ = missing_attributes(__name__)
