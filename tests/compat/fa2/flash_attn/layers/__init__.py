"""flash_attn.layers: only what FA2's tests import (rotary)."""
