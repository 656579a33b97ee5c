"""`deepspeed.launcher.runner`: the name of DeepSpeed's per-job environment file (accelerate writes it)."""

import os

from zerodp.compat.deepspeed._missing import missing_attributes

DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")

__all__ = ["DEEPSPEED_ENVIRONMENT_NAME"]
__getattr__ = missing_attributes(__name__)
