"""`deepspeed.moe`: zerodp has no mixture-of-experts layers; `utils` keeps scripts that split groups working."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.compat.deepspeed.moe import utils

__all__ = ["utils"]
__getattr__ = missing_attributes(__name__)
