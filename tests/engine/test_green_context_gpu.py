"""engine/green_context.green_stream: kernels on it keep to its SMs; codec graphs captured on it are exact."""

import pytest
import torch
from higgs_stream.engine.codec import StreamingDecoder, codec_from_state_dict
from higgs_stream.engine.codec.config import CodecConfig
from higgs_stream.engine.codec.make import build_reference_model
from higgs_stream.engine.errors import ConfigError
from higgs_stream.engine.green_context import green_stream

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _matmul_seconds(stream: torch.cuda.Stream) -> float:
    a = torch.randn(8192, 8192, device="cuda")
    with torch.cuda.stream(stream):
        stream.wait_stream(torch.cuda.default_stream())
        for _ in range(2):
            a @ a
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            a @ a
        end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def test_a_green_stream_runs_on_a_fraction_of_the_sms():
    total = torch.cuda.get_device_properties(0).multi_processor_count
    green = green_stream(torch.device("cuda"), 16)
    full = torch.cuda.Stream()
    slow, fast = _matmul_seconds(green), _matmul_seconds(full)
    # a compute-bound matmul on 16 of ~132 SMs: several times slower (ideal total/16; 2x is the bound)
    assert slow > 2.0 * fast, f"green {slow * 1e3:.1f} ms vs full {fast * 1e3:.1f} ms on {total} SMs"
    with pytest.raises(ConfigError):
        green_stream(torch.device("cuda"), total)


def test_codec_graphs_captured_on_a_green_stream_equal_the_one_shot_decode():
    cfg = CodecConfig.tiny()
    codec = codec_from_state_dict(build_reference_model(cfg, seed=3).state_dict(), cfg, with_encoder=False, device="cuda")
    green = green_stream(torch.device("cuda"), 16)
    dec = StreamingDecoder(codec, max_slots=4)
    with torch.cuda.stream(green):
        assert dec.capture([4], [8, 18], stream=green) <= 1e-5
        codes = torch.randint(0, 1024, (2, 8, 30), generator=torch.Generator().manual_seed(1))
        slots = [dec.open(), dec.open()]
        out = [[], []]
        for at in range(0, 30, 8):
            n = min(8, 30 - at)
            for i, piece in enumerate(dec.push(slots, codes[:, :, at:at + n], [n, n], [at + n == 30] * 2)):
                out[i].append(piece.clone())
    torch.cuda.synchronize()
    assert dec.replays > 0
    for i in range(2):
        want = codec.decode(codes[i:i + 1])[0]
        got = torch.cat(out[i])
        assert float((got - want).abs().max() / want.abs().max()) <= 1e-5
