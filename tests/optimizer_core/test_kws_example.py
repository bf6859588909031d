"""The keyword-spotting example: a deterministic ~68 k-parameter model that learns its synthetic
task in seconds and exports to ONNX with a dynamic batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from graphtrim.examples.kws import (
    N_CLASSES,
    N_FRAMES,
    N_MELS,
    accuracy,
    kws_net,
    make_kws_data,
    parameter_count,
    train_kws,
)
from graphtrim.examples.models import export


def test_importing_the_example_does_not_import_torch():
    code = (
        "import json, sys, graphtrim.examples.kws; "
        "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "torch" not in set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_model_size_and_seeded_init():
    import torch

    from graphtrim.examples.kws import KwsNet

    a, b, c = kws_net(0), kws_net(0), KwsNet(1)
    assert isinstance(a, KwsNet) and isinstance(a, torch.nn.Module)
    assert 60_000 <= parameter_count(a) <= 75_000
    pa, pb, pc = (dict(m.state_dict()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["conv1.weight"], pc["conv1.weight"])
    # the global RNG is left as it was
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    kws_net(5)
    assert torch.equal(torch.rand(3), expected)
    with torch.no_grad():
        out = a.eval()(torch.zeros(2, N_MELS, N_FRAMES))
    assert tuple(out.shape) == (2, N_CLASSES)


def test_data_is_deterministic_and_covers_the_classes():
    x, y = make_kws_data(300, 7)
    x2, y2 = make_kws_data(300, 7)
    assert x.dtype == np.float32 and x.shape == (300, N_MELS, N_FRAMES)
    assert y.dtype == np.int64 and y.shape == (300,)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    assert set(y.tolist()) == set(range(N_CLASSES))
    assert not np.array_equal(make_kws_data(300, 8)[0], x)


def test_trains_above_chance_and_exports_with_a_dynamic_batch(tmp_path: Path):
    import torch

    x, y = make_kws_data(1000, 0)
    xe, ye = make_kws_data(300, 1)
    model = kws_net(0)
    before = accuracy(model, xe, ye)
    train_kws(model, x, y)
    after = accuracy(model, xe, ye)
    assert after >= 0.6, (before, after)  # chance: 1/12
    assert after > before + 0.3

    path = export(
        model, torch.from_numpy(xe[:2]), tmp_path / "kws.onnx", dynamo=True, input_name="x"
    )
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    assert not list(tmp_path.glob("*.data"))  # one file
    batch = proto.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.HasField("dim_value")

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    with torch.no_grad():
        for n in (1, 5, 37):
            got = sess.run(None, {"x": xe[:n]})[0]
            want = model(torch.from_numpy(xe[:n])).numpy()
            assert got.shape == (n, N_CLASSES)
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    logits = sess.run(None, {"x": xe})[0]
    assert float((logits.argmax(-1) == ye).mean()) == pytest.approx(after, abs=0.01)
