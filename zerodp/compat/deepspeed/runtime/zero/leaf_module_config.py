"""`deepspeed.runtime.zero.leaf_module_config`: the `zero_optimization.leaf_module` section and its defaults.

zerodp's defaults are empty lists: where DeepSpeed 0.19.8 lists three transformers MoE block classes
(Mixtral, Qwen2-MoE, Qwen3-MoE) as leaves by default, zerodp recognises mixture-of-experts blocks by
their structure and keeps each whole (zerodp/zero/moe.py), which covers those classes and others; a
class, name or suffix given here replaces that detection, as in DeepSpeed.
"""

from zerodp.compat.deepspeed._missing import missing_attributes
from zerodp.config.schema import LeafModuleConfig as DeepSpeedZeroLeafModuleConfig

DEFAULT_LEAF_MODULE_CLASSES: list[str] = []
DEFAULT_LEAF_MODULE_NAMES: list[str] = []
DEFAULT_LEAF_MODULE_NAME_SUFFIXES: list[str] = []

__all__ = ["DEFAULT_LEAF_MODULE_CLASSES", "DEFAULT_LEAF_MODULE_NAMES", "DEFAULT_LEAF_MODULE_NAME_SUFFIXES",
           "DeepSpeedZeroLeafModuleConfig"]
__getattr__ = missing_attributes(__name__)
