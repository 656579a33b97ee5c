"""`deepspeed.runtime.engine`: `DeepSpeedEngine` is zerodp's Engine (isinstance checks hold)."""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.engine import Engine as DeepSpeedEngine

__all__ = ["DeepSpeedEngine"]
__getattr__ = missing_attributes(__name__)
