"""Other frameworks' module paths over zerodp (a skin: nothing in zerodp imports this package).

`zerodp.compat.deepspeed` is what `import deepspeed` gives with ZERODP_AS_DEEPSPEED=1 (see
_zerodp_as_deepspeed.py for the switch and docs/deepspeed.md for the surface).
"""
