import numpy as np, torch, tempfile, sys
if len(sys.argv) > 2: torch.backends.mkldnn.enabled = False
from pathlib import Path
from higgs_stream.engine.codec import write_random_codec, load_codec
from higgs_stream.engine.delay import delayed_prompt_audio
from higgs_stream.stream.adapter import Code2WavAdapter, to_s16le
for preset in ("tiny", "full"):
    d = Path(tempfile.mkdtemp()) / preset
    write_random_codec(d, preset=preset, seed=0)
    codec = load_codec(d, device=sys.argv[1], with_encoder=False)
    rng = np.random.default_rng(0)
    for F in (37, 120):
        frames = rng.integers(0, 1024, (8, F))
        cols = delayed_prompt_audio(frames)  # BOS column + delayed codes + EOS
        one = codec.decode(torch.from_numpy(frames)[None])[0].float().cpu().numpy()
        for det in (False, True):
            torch.backends.cudnn.deterministic = det
            ad = Code2WavAdapter(codec, mode="exact"); ch = []
            for i, c in enumerate(cols.T):
                ch += ad.push(c, final=(i == cols.shape[1] - 1))
            st = np.concatenate(ch)
            dd = np.abs(st - one)
            print(preset, F, "cudnn.det", det, "len", st.shape == one.shape, "maxdiff", float(dd.max()), "ndiff", int((dd > 0).sum()), "bytes_equal", to_s16le(st) == to_s16le(one), flush=True)
