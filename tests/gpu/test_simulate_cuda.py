"""``mtpmeta simulate`` on CUDA: the mirror path's pinned staging, async copies and
device ops feeding a paged KV cache that lives on the GPU. Skipped without CUDA.

Failure stories: a pinned slot rewritten before its copy landed (a forward sees the
next forward's token maps), a device op that reads a stale host copy, a view field
scattered to the wrong rows on the device; each shows up as KV or output that differs
from the dense recomputation.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from mtpmeta import MTPMetadata  # noqa: E402
from mtpmeta.simulate import run_path  # noqa: E402


def test_mirror_path_on_cuda_matches_dense_recomputation():
    """200 steps on the GPU: every check passes and every feature is exercised.
    (Counters are not compared with a CPU run: a draft decision that sits within
    rounding of its threshold may go the other way on another device.)"""
    result = run_path("mirror", steps=200, device="cuda")
    assert result["ok"], result["error"]
    assert result["missing_features"] == []


def test_cuda_cli_quick_run(tmp_path):
    out = tmp_path / "simulate.json"
    proc = subprocess.run([sys.executable, "-m", "mtpmeta", "simulate", "--quick",
                           "--device", "cuda", "--path", "mirror", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["results"][0]["missing_features"] == []


def test_planted_pad_row_bug_fails_on_cuda(monkeypatch):
    """A pad row pointed at a live block on the device is caught there too."""
    original = MTPMetadata.setup_decode_step

    def buggy(self, view):
        shape = original(self, view)
        if shape.padded_token_count > shape.token_count:
            view.token_to_block_idx[shape.token_count] = view.token_to_block_idx[0]
        return shape

    monkeypatch.setattr(MTPMetadata, "setup_decode_step", buggy)
    result = run_path("mirror", steps=40, device="cuda")
    assert not result["ok"]
    assert result["mismatch"]["check"] == "pad token"
