"""Qwen3-TTS's 12 Hz tokenizer: config, the causal decoder (one-shot and exact stateful streaming), the
encoder (reference audio -> codes, for the Base variant), loading from the hub layout's
`speech_tokenizer/` folder."""

from higgs_stream.engine.models.qwen3_tts.codec.codec import QwenCodec
from higgs_stream.engine.models.qwen3_tts.codec.config import FULL, MODEL_TYPE, QwenCodecConfig
from higgs_stream.engine.models.qwen3_tts.codec.load import SUBFOLDER, load_qwen_codec
from higgs_stream.engine.models.qwen3_tts.codec.streaming import QwenStreamingDecoder

__all__ = ["FULL", "MODEL_TYPE", "SUBFOLDER", "QwenCodec", "QwenCodecConfig", "QwenStreamingDecoder",
           "load_qwen_codec"]
