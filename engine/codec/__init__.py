"""Higgs Audio v2 codec ("audio tokenizer"): Code2Wav decode (one-shot and exact incremental), reference-audio
encode, loaders, writers."""

from higgs_stream.engine.codec.audio_io import (
                                            load_reference_audio,
                                            prepare_waveform,
                                            probe_reference_audio,
                                            validate_waveform,
)
from higgs_stream.engine.codec.codec import Codec
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.codec.geometry import CodecGeometry
from higgs_stream.engine.codec.load import (
                                            DEFAULT_HUB_ID,
                                            codec_from_state_dict,
                                            load_codec,
                                            original_names,
)
from higgs_stream.engine.codec.make import write_random_codec
from higgs_stream.engine.codec.streaming import (
                                            StepAudio,
                                            StreamingDecoder,
                                            lookahead_samples,
)

__all__ = [
                                            "DEFAULT_HUB_ID",
                                            "Codec",
                                            "CodecConfig",
                                            "CodecGeometry",
                                            "StepAudio",
                                            "StreamingDecoder",
                                            "codec_from_state_dict",
                                            "load_codec",
                                            "load_reference_audio",
                                            "lookahead_samples",
                                            "original_names",
                                            "prepare_waveform",
                                            "probe_reference_audio",
                                            "validate_waveform",
                                            "write_random_codec",
]
