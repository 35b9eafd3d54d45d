"""Writes recording-1.3.mcap with the schema-1.3 code (run from a checkout of commit 7ec5ead, the last 1.x):

    git archive 7ec5ead mia_stream | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old python tests/data/make_recording_1_3.py tests/data/recording-1.3.mcap

Two requests ("one", "two"), three steps each: a TensorFrame (hs [2, 1, 8] float32 filled with the step) and a
TokenFrame per step, then a StreamEnd; the recorder writes one part, which is renamed to the given path.
"""

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from mia_stream.consumers.recorder import Recorder
from mia_stream.schemas import SCHEMA_VERSION, StreamEnd, StreamStart, Tensor, TensorFrame, TokenFrame, encode

assert SCHEMA_VERSION[0] == 1, SCHEMA_VERSION
out = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as tmp:
    with Recorder(Path(tmp) / "rec") as rec:
        t = 1_000_000_000
        for rid in ("one", "two"):
            rec.write(encode(StreamStart(rid, "old-producer", 1, num_layers=4, hidden_size=8)), recv_time_ns=t)
        for step in range(3):
            for rid in ("one", "two"):
                hs = np.full((2, 1, 8), step, np.float32)
                t += 1000
                rec.write(encode(TensorFrame(rid, "old-producer", 1, 1 + 2 * step, step, [step], [step + 7],
                                             [Tensor.from_array("hs", hs, layers=[1, 3])])), recv_time_ns=t)
                rec.write(encode(TokenFrame(rid, "old-producer", 1, 2 + 2 * step, step, [step + 8], [step + 1])),
                          recv_time_ns=t)
        for rid in ("one", "two"):
            rec.write(encode(StreamEnd(rid, "old-producer", 1, 7, finish_reason="length")), recv_time_ns=t + 1)
    shutil.copy(Path(tmp) / "rec" / "part-00000.mcap", out)
print(f"wrote {out} (schema {SCHEMA_VERSION})")
