"""Fronts that mirror other libraries' Python APIs over epx, so existing code moves by changing an
import: deep_ep (Buffer) and hybrid_ep (HybridEPBuffer). Both need torch."""

_TORCH = None


def _torch():
    """torch, imported on first use (the fronts import without it) and then kept, with the binding told
    about it once (the binding looks for torch again by itself when a call needs it)."""
    global _TORCH
    if _TORCH is None:
        import torch

        from .. import _epx

        _epx._refresh_torch()
        _TORCH = torch
    return _TORCH
