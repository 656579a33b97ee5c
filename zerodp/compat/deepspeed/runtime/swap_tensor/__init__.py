"""`deepspeed.runtime.swap_tensor`: `MIN_SWAPPABLE_BYTES`, DeepSpeed's value (1 MiB), for code that sizes
tensors by it. It is DeepSpeed's NVMe swapper's threshold; zerodp's NVMe offload (zerodp.offload) swaps
what its config says, whatever the size, so the constant changes nothing in zerodp."""

from zerodp.compat.deepspeed._missing import missing_attributes

MIN_SWAPPABLE_BYTES = 1024**2

__all__ = ["MIN_SWAPPABLE_BYTES"]
__getattr__ = missing_attributes(__name__)
