"""``mtpmeta simulate``: a real client of the library, checked against dense math.

Every other test compares mtpmeta with a reference of the same contract, so a mistake
both share goes unseen. Here an engine drives the public API through a serving loop
(arrivals, chunked prefill with the carry, prefix sharing, paused/active compaction,
draft loops eager and graphed, TP-padded commit passes) over a paged KV cache, and
after every forward compares the cache and the attention output with a dense
recomputation. Failure stories: a pad row that writes a live block, a token routed to
a neighbour's block, a commit pass that rewrites a shared prefix block, a carry that
hands the seam a stale hidden, annotations that stay behind when rows move.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from mtpmeta import MTPMetadata
from mtpmeta.__main__ import main as cli_main
from mtpmeta.simulate import (FEATURES, PATHS, Engine, Expectation, Mismatch, SimConfig,
                              run_path)
from mtpmeta.simulate.paged import PagedKVCache

STEPS = 40  # enough for every feature with these seeds, about a second per path
SEED = 0


@pytest.fixture(scope="module")
def runs():
    return {path: run_path(path, steps=STEPS, seed=SEED) for path in PATHS}


@pytest.mark.parametrize("path", PATHS)
def test_every_forward_matches_dense_recomputation(runs, path):
    """On both paths, every live request's paged KV equals its dense recomputation
    after every forward, and every feature of the serving loop was exercised (a run
    that never chunked or never shared a prefix would prove little)."""
    result = runs[path]
    assert result["ok"], result["error"]
    assert result["missing_features"] == []
    checks = result["checks"]
    assert checks["stray write"] == result["stats"]["forwards"]
    assert checks["kv positions"] > 10 * result["stats"]["forwards"]
    assert checks["pad token"] > 0 and checks["attention output"] > 0


def test_direct_and_mirror_paths_run_the_same_serving_loop(runs):
    """Both paths make the same decisions (drafts depend on attention outputs, which
    depend on the KV the library routed), so their counters agree exactly."""
    assert runs["direct"]["stats"] == runs["mirror"]["stats"]


def test_other_seeds_pass_too():
    """A second seed and a bigger draft depth: a different interleaving of arrivals,
    pauses and chunk seams."""
    config = dataclasses.replace(SimConfig(), depths=4, tp=8)
    result = run_path("mirror", steps=30, seed=7, config=config)
    assert result["ok"], result["error"]


def test_quick_cli_covers_every_feature_and_writes_json(tmp_path):
    """``python -m mtpmeta simulate --quick --json PATH``: exit 0, at least 200 steps
    per path, both paths, every feature, and the JSON holds what was printed."""
    out = tmp_path / "simulate.json"
    # Kernels compiled even in CI's JIT-off pass: the in-process runs above cover them
    # as Python; here that would only triple the time of 400 steps.
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_DISABLE_JIT"}
    proc = subprocess.run([sys.executable, "-m", "mtpmeta", "simulate", "--quick",
                           "--json", str(out)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert report["ok"] and report["steps"] >= 200
    assert [r["path"] for r in report["results"]] == list(PATHS)
    for result in report["results"]:
        assert result["stats"]["steps"] >= 200
        assert result["missing_features"] == []
        assert all(result["stats"][name] > 0 for name in FEATURES)
    assert report["summary"] in proc.stdout
    assert "every feature exercised" in proc.stdout


# ----------------------------------------------------------------- planted bugs
def _wrap(name, after=None, before=None):
    """A buggy ``MTPMetadata.<name>``: ``before`` edits the arguments, ``after``
    corrupts what the real method left in the view."""
    original = getattr(MTPMetadata, name)

    def buggy(self, *args, **kwargs):
        if before is not None:
            args, kwargs = before(self, args, kwargs)
        result = original(self, *args, **kwargs)
        return result if after is None else after(self, args, result)

    return buggy


def _pad_row_to_real_block(meta, args, shape):
    view = args[0]
    if shape.padded_token_count > shape.token_count:
        view.token_to_block_idx[shape.token_count] = view.token_to_block_idx[0]
    return shape


def _neighbour_block(meta, args, shape):
    if shape.token_count:
        args[0].token_to_block_idx[shape.token_count - 1] += 1
    return shape


def _whole_annotation_array(meta, args, kwargs):
    # The README's old example: every row's annotation, not the commit pass's rows.
    return args, dict(kwargs, inherited_blocks=meta.request_matched_prefix_blocks)


def _foreign_block_row(meta, args, shape):
    view = args[0]
    if shape.token_count > 1:
        view.mha_block_table[0] = view.mha_block_table[1].clone()
    return shape


PLANTS = {
    # name: (method, wrapper keywords, the check that must fire)
    "pad row writes a live block": (
        "setup_decode_step", dict(after=_pad_row_to_real_block), "pad token"),
    "token routed to the next block id": (
        "setup_commit_pass", dict(after=_neighbour_block), "token map"),
    "inherited redirect uses the whole annotation array": (
        "setup_commit_pass", dict(before=_whole_annotation_array), "token map"),
    "attention reads another request's blocks": (
        "setup_decode_step", dict(after=_foreign_block_row), "paged read"),
    "carry hands the seam a stale hidden": (
        "take_chunk_boundary", dict(after=lambda meta, args, hidden: hidden * 0.5), "kv"),
    "annotations stay behind when rows move": (
        "move_request_rows", dict(before=lambda meta, args, kwargs: (
            (args[0][:0], args[1][:0]), kwargs)), "annotations"),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("plant", sorted(PLANTS))
def test_planted_library_bug_fails_the_run_with_a_description(monkeypatch, capsys,
                                                              plant, path):
    """A library with a planted bug makes ``mtpmeta simulate`` exit 1 and say where:
    the check, the step and forward, and expected against got."""
    method, hooks, check = PLANTS[plant]
    monkeypatch.setattr(MTPMetadata, method, _wrap(method, **hooks))
    status = cli_main(["simulate", "--steps", str(STEPS), "--seed", str(SEED),
                       "--path", path, "--quiet"])
    printed = capsys.readouterr().out
    assert status == 1, printed
    assert f"MISMATCH ({check}) at step " in printed, printed
    assert ", forward " in printed and "expected:" in printed and "got:" in printed
    assert "FAILED on the" in printed


def test_stray_cache_write_is_caught_even_when_the_token_maps_look_right(monkeypatch):
    """Same-looking maps, wrong memory: a KV append that also touches a block the
    forward does not own (here the oldest live block) fails the stray-write check."""
    original = PagedKVCache.write

    def leaky_write(self, view, k, v, rows):
        original(self, view, k, v, rows)
        if rows:
            self.k[0, 0] = self.k[0, 0] + 1.0

    monkeypatch.setattr(PagedKVCache, "write", leaky_write)
    result = run_path("direct", steps=STEPS, seed=SEED)
    assert not result["ok"]
    assert result["mismatch"]["check"] in ("stray write", "kv")
    assert result["mismatch"]["step"] is not None


def test_commit_pass_never_runs_full_with_pad_rows():
    """Under a flood of arrivals the batch fills up to ``R - 1`` active requests and
    no further: ``P < R`` keeps the TP pad in its own trailing request (with ``P == R``
    the absorbing request would read blocks it does not own), and the run stays clean."""
    flood = SimConfig(arrival_rate=3.0, chunk_tokens=48, max_prompt=10, system_prompts=0,
                      pause_rate=0.0)
    engine = Engine(flood, seed=1)
    engine.run(15)
    assert engine.stats["max active requests"] == engine.config.max_requests - 1
    assert engine.stats["commit passes with TP pad"] > 0


def test_cli_refuses_bad_arguments(capsys):
    assert cli_main(["simulate", "--steps", "0"]) == 2
    if not torch.cuda.is_available():
        assert cli_main(["simulate", "--device", "cuda"]) == 2
    assert "simulate" in capsys.readouterr().err


def test_a_write_aimed_at_an_inherited_block_is_flagged():
    """Draft depths have no inherited-block redirect: a scheduler that
    drafted into a shared prefix block would overwrite every sharer's KV. The checker
    refuses any planned write of a block a live request inherited."""
    engine = Engine(SimConfig(), seed=SEED)
    engine.run(STEPS)
    sharer = next(r for r in engine.rows.live() if r.matched)
    block = sharer.blocks[0]
    expect = Expectation("draft depth 1", [(sharer, 3, 0, block)],
                         torch.zeros(1, engine.config.hidden_size), 1,
                         [(sharer, 1, 4)], 1)
    with pytest.raises(Mismatch) as caught:
        engine.checker._check_stray_writes(expect, engine.cache.snapshot(),
                                           engine.rows.live())
    assert caught.value.check == "inherited block" and caught.value.got == block
