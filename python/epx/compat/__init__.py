"""Fronts that mirror other libraries' Python APIs over epx, so existing code moves by changing an
import: deep_ep (Buffer) and hybrid_ep (HybridEPBuffer). Both need torch."""
