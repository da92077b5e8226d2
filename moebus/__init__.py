"""moebus: an inference service for Mixture-of-Experts models whose experts do not all fit in VRAM."""

__version__ = "0.1.0"
