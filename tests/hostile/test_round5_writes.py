"""What a run writes outside its loggers, and what the command answers before a run starts:
a refused run changes nothing of the run it was refused for, a planted link is replaced and
never written through, a hostile command line or config file is refused in one line, and a
value read from the environment never lands in a record."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TINY, run_cli

SECRET = "hunter2-not-for-records"


def one_line_refusal(done) -> str:
    """The refusal's line: non-zero exit, no traceback, one `error:` line."""
    assert done.returncode != 0, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr
    return errors[0]


def test_a_refused_run_leaves_the_finished_runs_files_and_never_writes_through_a_planted_link(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (run / "report.md").symlink_to(victim)
    (run / ".hydra").mkdir()
    (run / ".hydra" / "overrides.yaml").symlink_to(victim)
    first = run_cli(*TINY, "model.width=8", f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    assert victim.read_text() == "precious\n"
    assert not (run / "report.md").is_symlink() and "Bottleneck" in (run / "report.md").read_text()
    assert "model.width=8" in (run / ".hydra" / "overrides.yaml").read_text()
    saved = {p.name: p.read_bytes() for p in (run / ".hydra").glob("*.yaml")}
    assert set(saved) == {"config.yaml", "hydra.yaml", "overrides.yaml"}

    refused = run_cli(*TINY, "optim.optimizer.lr=0.5", f"hydra.run.dir={run}", cwd=tmp_path)
    assert "holds the checkpoints of an earlier run" in one_line_refusal(refused)
    assert {p.name: p.read_bytes() for p in (run / ".hydra").glob("*.yaml")} == saved


def test_a_job_failing_its_config_still_saves_what_it_was_given(tmp_path):
    run = tmp_path / "run"
    done = run_cli(*TINY, "checkpoint.top_k=-1", f"hydra.run.dir={run}", cwd=tmp_path)
    one_line_refusal(done)
    assert "checkpoint.top_k=-1" in done.stderr and (run / "metrics.json").is_file()
    assert "checkpoint.top_k=-1" in (run / ".hydra" / "overrides.yaml").read_text()


@pytest.mark.parametrize(
    ("argument", "says"),
    [
        ("+deep=" + "[" * 5000 + "]" * 5000, "+deep: nested deeper than"),
        ("+model.deep=" + "{a:" * 3000 + "1" + "}" * 3000, "+model.deep: nested deeper than"),
        ("+tune.extra=[" + ",".join(["1"] * 60000) + "]", "+tune.extra: a list or dict of more than"),
        ("hydra.run.dir=${oc.env:SATURATE_TEST_UNSET_VARIABLE}", "SATURATE_TEST_UNSET_VARIABLE"),
    ],
    ids=["deep-list", "deep-dict", "huge-list", "unset-env-run-dir"],
)
def test_a_hostile_command_line_is_refused_in_one_line(tmp_path, argument, says):
    done = run_cli(*TINY, argument, cwd=tmp_path, timeout=120)
    line = one_line_refusal(done)
    assert says in line and len(line) < 400, line


def user_conf(tmp_path: Path, group: str, name: str, text: str) -> str:
    folder = tmp_path / "conf" / group
    folder.mkdir(parents=True)
    (folder / f"{name}.yaml").write_text(text)
    return f"hydra.searchpath=[file://{tmp_path / 'conf'}]"


def test_a_config_file_with_a_python_tag_is_refused_in_one_line_naming_it(tmp_path):
    marker = tmp_path / "ran"
    text = f'# @package _global_\ntrainer:\n  max_epochs: !!python/object/apply:os.system ["touch {marker}"]\n'
    searchpath = user_conf(tmp_path, "experiment", "evil", text)
    done = run_cli(*TINY, searchpath, "experiment=evil", "hydra.run.dir=run", cwd=tmp_path, timeout=120)
    line = one_line_refusal(done)
    assert "evil.yaml" in line and "python/object/apply" in line, line
    assert not marker.exists()


def test_a_yaml_alias_bomb_in_a_config_file_is_refused_before_composing(tmp_path):
    lines = ["_target_: saturate.data.digits.load_digits", 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 9)]
    searchpath = user_conf(tmp_path, "data", "bomb", "\n".join([*lines, "bomb: *a8"]) + "\n")
    done = run_cli(*TINY, searchpath, "data=bomb", "hydra.run.dir=run", cwd=tmp_path, timeout=120)
    line = one_line_refusal(done)
    assert "bomb.yaml" in line and "alias" in line, line


def all_bytes(folder: Path, but: str = "") -> bytes:
    files = [p for p in sorted(folder.rglob("*")) if p.is_file() and not p.is_symlink()]
    return b"".join(p.read_bytes() for p in files if not (but and p.match(but)))


def test_a_value_read_from_the_environment_never_lands_in_a_record(tmp_path):
    env = {"SATURATE_TEST_SECRET": SECRET}
    run = tmp_path / "run"
    done = run_cli(*TINY, "name=${oc.env:SATURATE_TEST_SECRET}", f"hydra.run.dir={run}", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert (run / "checkpoints" / "last.pt").is_file() and list(run.glob("events.out.tfevents.*"))
    # the metrics, the report, the checkpoints' config, the saved .hydra/, TensorBoard's config text and HParams
    assert SECRET.encode() not in all_bytes(run)
    assert b"${oc.env:SATURATE_TEST_SECRET}" in (run / ".hydra" / "overrides.yaml").read_bytes()

    failed = tmp_path / "failed"
    done = run_cli(
        *TINY, "+data.token=${oc.env:SATURATE_TEST_SECRET}", f"hydra.run.dir={failed}", cwd=tmp_path, env=env
    )
    assert done.returncode != 0 and SECRET not in done.stderr, done.stderr
    assert (failed / "metrics.json").is_file() and SECRET.encode() not in all_bytes(failed)


def test_a_value_read_from_the_environment_is_masked_as_a_whole_word_only(monkeypatch):
    """The value is written as its interpolation where it stands alone (a config value, a
    `key=value` in a message), never inside a path or a name that happens to hold it."""
    from omegaconf import OmegaConf

    from saturate.config.secrets import masked, record_env_reads

    monkeypatch.setenv("SATURATE_TEST_USER", "alex")
    record_env_reads()
    cfg = OmegaConf.create({"user": "${oc.env:SATURATE_TEST_USER}", "model": "alexnet", "run_dir": "/home/alex/x"})
    written = masked(OmegaConf.to_container(cfg, resolve=True))
    assert written == {"user": "${oc.env:SATURATE_TEST_USER}", "model": "alexnet", "run_dir": "/home/alex/x"}
    assert masked("user=alex: bad") == "user=${oc.env:SATURATE_TEST_USER}: bad"
