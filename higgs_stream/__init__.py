"""higgs-stream: real-time streaming TTS for Higgs Audio."""
__version__ = "0.1.0"
