"""`higgs-stream make-checkpoint` and `higgs-stream synth` end to end through `cli.main`, v2 and v3."""

from __future__ import annotations

import sys
import wave
from pathlib import Path

import numpy as np
import pytest
import torch

from higgs_stream import cli
from higgs_stream.engine.engine import Engine, EngineConfig
from higgs_stream.engine.models.registry import load_codec_for, model_arch
from higgs_stream.engine.request import GenerationRequest, SamplingParams

HOP, RATE, K = 960, 24000, 8
TEXT = "Hello world. See you tomorrow."


@pytest.fixture
def main(monkeypatch):
    """cli.main with sys.argv restored afterwards (main rewrites it)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    return cli.main


def files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_wav(path: Path) -> tuple[np.ndarray, int]:
    with wave.open(str(path), "rb") as w:
        assert (w.getnchannels(), w.getsampwidth()) == (1, 2)
        return np.frombuffer(w.readframes(w.getnframes()), dtype="<i2"), w.getframerate()


# -------------------------------------------------------------------------- make-checkpoint
@pytest.mark.parametrize("arch, extra, fixture", [
    ("v2", ["--layout", "original"], "tiny_ckpt_original"),
    ("v3", [], "tiny_v3_ckpt"),
])
def test_make_checkpoint_writes_the_fixture_checkpoint(main, tmp_path, request, capsys, arch, extra, fixture):
    out = tmp_path / arch
    assert main(["make-checkpoint", str(out), "--arch", arch, "--preset", "tiny", *extra, "--seed", "0"]) == 0
    assert f"tiny {arch} checkpoint (seed 0" in capsys.readouterr().out
    assert model_arch(out) == arch
    expected = request.getfixturevalue(fixture)  # written by the library call with the same arguments
    assert files(out) == files(expected)


def test_make_checkpoint_refuses_a_v3_layout(main, tmp_path, capsys):
    assert main(["make-checkpoint", str(tmp_path / "x"), "--arch", "v3", "--layout", "original"]) == 2
    err = capsys.readouterr().err
    assert "error [bad_config]" in err and "one layout" in err and not (tmp_path / "x").exists()


def test_make_checkpoint_where_no_folder_can_be_made_is_one_line(main, tmp_path, capsys):
    """Under a file (or /proc): NotADirectoryError / FileNotFoundError tracebacks before (a probe)."""
    (tmp_path / "f").write_text("a file")
    assert main(["make-checkpoint", str(tmp_path / "f" / "sub"), "--preset", "tiny", "--seed", "0"]) == 2
    err = capsys.readouterr().err
    assert "error [bad_config]: cannot write a checkpoint to" in err and "Traceback" not in err, err


# ------------------------------------------------------------------------------------ synth
@pytest.mark.parametrize("fixture", ["tiny_ckpt", "tiny_ckpt_original", "tiny_v3_ckpt"])
def test_synth_writes_wav_and_codes(main, tmp_path, request, capsys, fixture):
    model = request.getfixturevalue(fixture)
    wav_path, codes_path = tmp_path / "x.wav", tmp_path / "x.npy"
    argv = ["synth", "--model", str(model), "--text", TEXT, "--seed", "1", "--max-frames", "20",
            "--out", str(wav_path), "--codes-out", str(codes_path)]
    assert main(argv) == 0
    codes = np.load(codes_path)  # the codec frames (the delay pattern reverted by the family's writer)
    frames = codes.shape[1]
    assert codes.shape == (K, frames) and codes.dtype == np.int64 and 1 <= frames <= 20
    assert codes.min() >= 0 and codes.max() < 1024  # real codes only: no BOS/EOS reaches the codec
    pcm, rate = read_wav(wav_path)
    assert rate == RATE and pcm.shape == (frames * HOP,)  # duration = frames * 960 / 24000 s
    assert f"{frames * HOP / RATE:.2f} s of audio, {frames} frames" in capsys.readouterr().out

    # the same request through the library gives the same codes and (to 16-bit rounding) the same audio
    engine = Engine.from_pretrained(str(model), config=EngineConfig(max_batch=2, kv_pages=64))
    req = GenerationRequest(text=TEXT, max_frames=20, sampling=SamplingParams(seed=1))
    np.testing.assert_array_equal(engine.generate(req), codes)
    codec = load_codec_for(model)
    ref = codec.decode(torch.from_numpy(codes)[None])[0].numpy()
    assert np.abs(pcm / 32767.0 - np.clip(ref, -1, 1)).max() <= 1.0 / 32767 + 1e-6


def test_synth_layouts_agree_and_v3_differs(main, tmp_path, tiny_ckpt, tiny_ckpt_original, tiny_v3_ckpt):
    cols = {}
    for name, model in (("hf", tiny_ckpt), ("original", tiny_ckpt_original), ("v3", tiny_v3_ckpt)):
        out = tmp_path / f"{name}.npy"
        assert main(["synth", "--model", str(model), "--text", TEXT, "--seed", "1", "--max-frames", "20",
                     "--codes-out", str(out)]) == 0
        cols[name] = np.load(out)
    np.testing.assert_array_equal(cols["hf"], cols["original"])  # same tensors, same seed, same codes
    assert cols["v3"].shape != cols["hf"].shape or (cols["v3"] != cols["hf"]).any()


def test_synth_errors_are_typed(main, tmp_path, tiny_ckpt, tiny_v3_ckpt, capsys):
    out = str(tmp_path / "x.wav")
    cases = [
        (["--model", str(tiny_v3_ckpt), "--codec", str(tiny_ckpt / "audio_tokenizer")], "[bad_config]", "codec bundled"),
        (["--model", str(tiny_v3_ckpt), "--scene", "A loud street."], "[invalid_input]", "no scene"),
        (["--model", str(tmp_path / "missing")], "[checkpoint]", "missing"),
        (["--model", str(tiny_ckpt), "--quantize", "fp8"], "[bad_config]", "compute capability >= 8.9"),
    ]
    for args, code, detail in cases:
        assert main(["synth", *args, "--text", TEXT, "--out", out]) == 2
        err = capsys.readouterr().err
        assert f"error {code}" in err and detail in err, err
    assert not Path(out).exists()


def test_synth_checks_its_device_and_outputs_before_the_model_loads(main, tmp_path, tiny_ckpt, capsys, monkeypatch):
    """A bad --device, an output in a missing folder or a folder, an output that is the reference input: one bad_config
    line, exit 2, nothing loaded or written (tracebacks after the synthesis before, or the input overwritten; a probe)."""
    import higgs_stream.engine.models.registry as registry

    monkeypatch.setattr(registry, "load_codec_for", lambda *a, **k: pytest.fail("the model was loaded"))
    ref = tmp_path / "me.wav"
    ref.write_bytes(b"RIFF")
    base = ["synth", "--model", str(tiny_ckpt), "--text", TEXT]
    cases = [
        (["--device", "banana", "--out", str(tmp_path / "a.wav")], "is not a device"),
        (["--out", str(tmp_path / "missing" / "a.wav")], "does not exist or is not writable"),
        (["--out", str(tmp_path)], "is a folder"),
        (["--out", str(tmp_path / "a.wav"), "--codes-out", str(tmp_path / "missing" / "c.npy")], "--codes-out"),
        (["--out", str(ref), "--ref-audio", str(ref), "--ref-text", "Hi."], "must be different files"),
    ]
    for args, detail in cases:
        assert main([*base, *args]) == 2
        err = capsys.readouterr().err
        assert "error [bad_config]" in err and detail in err, err
    assert not (tmp_path / "a.wav").exists() and ref.read_bytes() == b"RIFF"


@pytest.mark.parametrize("fixture, kv", [("tiny_ckpt", "auto"), ("tiny_v3_ckpt", "auto"), ("tiny_v3_ckpt", "fp8")])
def test_synth_quantize_int8(main, tmp_path, request, fixture, kv):
    """`synth --quantize int8 [--kv-cache-dtype fp8]` writes the codes of the library's engine so built
    (the CPU's RefRunner)."""
    model = request.getfixturevalue(fixture)
    out = tmp_path / "x.npy"
    assert main(["synth", "--model", str(model), "--text", TEXT, "--seed", "1", "--max-frames", "20",
                 "--quantize", "int8", "--kv-cache-dtype", kv, "--codes-out", str(out)]) == 0
    engine = Engine.from_pretrained(str(model), config=EngineConfig(max_batch=2, kv_pages=64, kv_cache_dtype=kv),
                                    quantize="int8")
    req = GenerationRequest(text=TEXT, max_frames=20, sampling=SamplingParams(seed=1))
    np.testing.assert_array_equal(engine.generate(req), np.load(out))
