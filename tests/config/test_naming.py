"""Run names: what TensorBoard's run list, the HParams Trial ID and the trackers show."""

from __future__ import annotations

from saturate.config.naming import MAX_LENGTH, slug


def test_a_name_reads_each_key_by_its_last_part():
    assert slug(["loader.batch_size=32", "trainer.channels_last=True", "precision=bf16"]) == (
        "batch_size-32+channels_last-True+precision-bf16"
    )


def test_keys_that_would_read_the_same_stay_whole():
    assert slug(["optim.lr=0.1", "scheduler.lr=0.01", "model.width=8"]) == "optim.lr-0.1+scheduler.lr-0.01+width-8"


def test_only_the_kept_keys_and_whole_pairs_that_fit():
    assert slug(["loader.batch_size=32", "trainer.max_epochs=3"], keep={"loader.batch_size"}) == "batch_size-32"
    long = [f"model.key{i}={'x' * 20}" for i in range(5)]
    name = slug(long)
    assert len(name) <= MAX_LENGTH and name.count("+") == 2 and name.endswith("x" * 20)
