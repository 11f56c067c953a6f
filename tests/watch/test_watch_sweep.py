"""The watch's sweep over model types (``benchmarks/watch_sweep.py``) tells a watched run that
trains as the plain one from one refused, and a type it does not run; it runs image and audio
classifiers on their own inputs."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("datasets")

import watch_sweep  # noqa: E402  (benchmarks/ is on sys.path: conftest.py)


def test_a_family_served_trains_alike_and_one_of_another_loss_is_refused():
    gpt2 = watch_sweep.run_one("gpt2")
    assert gpt2["status"] == "same" and gpt2["apart"] <= watch_sweep.SAME * gpt2["scale"]
    bart = watch_sweep.run_one("bart")  # its causal LM's labels are unshifted
    assert bart["status"] == "refused" and "BartForCausalLM's own" in bart["note"]
    big_bird = watch_sweep.run_one("big_bird")  # switches to full attention in its first forward
    assert big_bird["status"] == "refused" and "another forward" in big_bird["note"]
    assert watch_sweep.run_one("clip_vision_model")["status"] == "skipped"
    resnet = watch_sweep.run_one("resnet")  # an image classifier of batch statistics
    assert resnet["status"] == "refused" and "a batch norm on the batch's own" in resnet["note"]
    assert watch_sweep.run_one("wav2vec2")["status"] == "same"  # SpecAugment's numpy masks
    table = watch_sweep._table({"gpt2": gpt2, "bart": bart})
    assert "refused 1, same 1" in table and "| gpt2 | AutoModelForCausalLM | same |" in table
