"""GPU benchmark of the full-size talker with random weights: `python -m higgs_stream.bench --help`.

    cli.py      arguments, the sections in order, the summary table (its docstring is the --help text)
    model.py    the random full-size Higgs v2 model, its engine, the utterance every stream says
    parity.py   greedy codes of the graphed batched engine vs the eager batch-1 engine
    decode.py   decode step time vs batch size beside the weight-read floor, its kernels, transformers' baseline
    codec.py    codec decode time per shape, and settings the pipeline does not use
    stream.py   the streaming pipeline in this process under N streams, and its A/B variants
    trace.py    where a traced streaming run's time went
    measure.py  timing primitives (shared with bench_quant and bench_codec) and the log line

The names below were importable from the single-file `higgs_stream/bench.py`; they still are.
"""

from higgs_stream.bench.cli import main, summarize
from higgs_stream.bench.codec import codec_timings, codec_variants
from higgs_stream.bench.decode import (
    copy_bandwidth,
    decode_sweep,
    profile_decode,
    transformers_baseline,
)
from higgs_stream.bench.measure import log
from higgs_stream.bench.model import FRAMES, TEXT, TOP_K
from higgs_stream.bench.parity import greedy_batch_parity
from higgs_stream.bench.stream import SAMPLE_RATE, ab_variants, stream_bench
from higgs_stream.bench.trace import steps_beside_calls, trace_summary

__all__ = ["FRAMES", "SAMPLE_RATE", "TEXT", "TOP_K", "ab_variants", "codec_timings", "codec_variants",
           "copy_bandwidth", "decode_sweep", "greedy_batch_parity", "log", "main", "profile_decode",
           "steps_beside_calls", "stream_bench", "summarize", "trace_summary", "transformers_baseline"]
