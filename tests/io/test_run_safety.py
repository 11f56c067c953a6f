"""A run never writes over what it reads, never shares its output, and resumes only itself."""

from __future__ import annotations

import errno
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from oracle import assert_rel_close, reference_norms
from project import (
    edit_config,
    edit_data,
    launch,
    load_net,
    make_project,
    one_error,
    slow_project,
    wait_for_parts,
)
from typer.testing import CliRunner

from gradscope.cli import app
from gradscope.io.lock import OutputLock, lock_path
from gradscope.io.parquet import partial_path, read_metadata

runner = CliRunner()

HELD_MODEL = """
import errno
import os
import re
import signal
import time

from model import Net


class HeldNet(Net):
    '''Waits in forward while the file named by $HOLD exists.'''

    def forward(self, x):
        while os.environ.get("HOLD") and os.path.exists(os.environ["HOLD"]):
            time.sleep(0.01)
        return super().forward(x)


class HeldAtStart(Net):
    '''Writes the file $BUILDING, then waits while it is being built (start-up never ends).'''

    def __init__(self):
        super().__init__()
        open(os.environ["BUILDING"], "w").close()
        while True:
            time.sleep(0.01)


class StopNet(Net):
    '''Ctrl-C (KeyboardInterrupt) at its $STOP_AT-th forward.'''

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == int(os.environ.get("STOP_AT", 0)):
            raise KeyboardInterrupt
        return super().forward(x)
"""

CODE = {
    "losses.py": "def per_example(outputs, targets):\n"
    "    import torch.nn.functional as F\n"
    "    return F.cross_entropy(outputs, targets, reduction='none')\n",
    "rows.py": "import torch\n\n\ndef rows():\n    return torch.load('data.pt')\n",
}


def project(root: Path, n: int = 23, **config) -> Path:
    config = make_project(root, n=n, **config)
    (root / "held.py").write_text(HELD_MODEL)
    for name, text in CODE.items():
        (root / name).write_text(text)
    torch.save({"x": torch.randn(3, 5), "y": torch.randint(0, 3, (3,))}, root / "ref.pt")
    return config


def files(root: Path) -> dict[str, bytes]:
    return {str(p): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def adam_state(root: Path) -> None:
    torch.save({"state": {}, "param_groups": []}, root / "adam.pt")  # refused before it is read


def split_shards(root: Path) -> None:
    data = torch.load(root / "data.pt")
    (root / "shards").mkdir()
    torch.save({k: v[:10] for k, v in data.items()}, root / "shards" / "a.pt")
    torch.save({k: v[10:] for k, v in data.items()}, root / "shards" / "b.pt")
    edit_config(root, lambda c: c["data"].update(path="shards/*.pt"))


# (id, how to set the project up, the command line, the input it names)
OVERWRITES = [
    ("data", None, ["norms", "{c}", "--out", "{r}/data.pt"], "data.path"),
    ("glob-match", split_shards, ["norms", "{c}", "--out", "{r}/shards/b.pt"], "data.path"),
    (
        "symlink-to-data",
        lambda r: (r / "link.parquet").symlink_to(r / "data.pt"),
        ["norms", "{c}", "--out", "{r}/link.parquet"],
        "data.path",
    ),
    (
        "hard-link-to-data",
        lambda r: os.link(r / "data.pt", r / "same.parquet"),
        ["norms", "{c}", "--out", "{r}/same.parquet"],
        "data.path",
    ),
    (
        "output-path-in-config",
        lambda r: edit_config(r, lambda c: c["output"].update(path="data.pt")),
        ["norms", "{c}"],
        "data.path",
    ),
    (
        "data-function-file",
        lambda r: edit_config(r, lambda c: c["data"].update(path="rows.py:rows")),
        ["norms", "{c}", "--out", "{r}/rows.py"],
        "data.path",
    ),
    ("checkpoint", None, ["norms", "{c}", "--out", "{r}/net.pt"], "model.checkpoint"),
    ("factory", None, ["norms", "{c}", "--out", "{r}/model.py"], "model.factory"),
    ("config", None, ["norms", "{c}", "--out", "{r}/config.yaml"], "config file"),
    (
        "loss-file",
        lambda r: edit_config(r, lambda c: c.update(loss={"name": "losses.py:per_example"})),
        ["norms", "{c}", "--out", "{r}/losses.py"],
        "loss.name",
    ),
    ("ref", None, ["influence", "{c}", "--ref", "{r}/ref.pt", "--out", "{r}/ref.pt"], "--ref"),
    (
        "precondition",
        adam_state,
        [
            "influence",
            "{c}",
            "--ref",
            "{r}/ref.pt",
            "--precondition",
            "{r}/adam.pt",
            "--out",
            "{r}/adam.pt",
        ],
        "--precondition",
    ),  # fmt: skip
]


@pytest.mark.parametrize(
    ("setup", "args", "key"), [pytest.param(*case[1:], id=case[0]) for case in OVERWRITES]
)
def test_output_that_is_an_input_is_refused_before_anything_runs(tmp_path, setup, args, key):
    config = project(tmp_path)
    if setup:
        setup(tmp_path)
    before = files(tmp_path)
    result = runner.invoke(app, [a.format(c=config, r=tmp_path) for a in args])
    line = one_error(result)
    assert line.startswith(f"error: the output path is the run's {key} ("), line
    assert files(tmp_path) == before  # nothing written, nothing replaced


FOREIGN = {  # a file of the user's at the output path, and the command that would replace it
    # (notes.txt: refused by its suffix first, as no Parquet file's name)
    "norms-onto-notes": ("notes", b"my notes\n", ["norms", "{c}"], "gradscope scores file"),
    "influence-onto-parquet": (
        "other.parquet",
        None,
        ["influence", "{c}", "--ref", "{r}/ref.pt"],
        "gradscope scores file",
    ),
    "norms-onto-a-truth": ("t.parquet", "truth", ["norms", "{c}"], "gradscope scores file"),
    "factors-onto-notes": ("notes.txt", b"my notes\n", ["factors", "{c}"], "gradscope factors"),
    "report-onto-a-page": (
        "page.html",
        b"<!DOCTYPE html><title>mine</title>",
        ["report", "{r}/scores.parquet"],
        "gradscope report",
    ),
}


@pytest.mark.parametrize("case", FOREIGN)
def test_a_file_gradscope_did_not_write_is_not_replaced(tmp_path, case):
    """norms --out notes.txt replaced the notes; a Parquet file of another tool, a page of the
    user's, likewise. A file of the same kind gradscope wrote is replaced as before; one made
    read-only is not."""
    config = project(tmp_path)
    name, text, args, what = FOREIGN[case]
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0  # scores.parquet
    target = tmp_path / name
    if text in (None, "truth"):  # another tool's Parquet; a validate truth file (its models)
        meta = {b"gradscope": b'{"command": "validate", "identity": {}}'} if text else None
        pq.write_table(pa.table({"a": [1, 2]}).replace_schema_metadata(meta), target)
    else:
        target.write_bytes(text)
    before = target.read_bytes()
    argv = [a.format(c=config, r=tmp_path) for a in args] + ["--out", str(target)]
    line = one_error(runner.invoke(app, argv))
    assert f"the output path holds a file that is not a {what}" in line, line
    assert target.read_bytes() == before
    target.unlink()
    assert runner.invoke(app, argv).exit_code == 0  # a new file, then its own replaced
    assert runner.invoke(app, argv).exit_code == 0
    target.chmod(0o444)  # refused by its mode, also where root could write it
    assert "the output file is read-only" in one_error(runner.invoke(app, argv))
    target.chmod(0o644)
    target.write_bytes(b"")  # an empty file (mktemp's) holds nothing to lose
    assert runner.invoke(app, argv).exit_code == 0


def test_a_second_run_on_the_same_output_exits_2_naming_the_first(tmp_path):
    config = project(tmp_path, n=12, model__factory="held.py:HeldNet")
    hold = tmp_path / "hold"
    hold.touch()
    first = launch(config, env={"HOLD": str(hold)})
    out = tmp_path / "scores.parquet"
    try:
        deadline = time.monotonic() + 60
        while not (lock_path(out).exists() and lock_path(out).read_text().strip()):
            assert first.poll() is None and time.monotonic() < deadline, "the first never locked"
            time.sleep(0.02)
        second = launch(config)
        _, stderr = second.communicate(timeout=60)
        assert second.returncode == 2, stderr
        (line,) = stderr.strip().splitlines()
        assert f"another gradscope run (pid {first.pid}) is writing this output" in line, line
        hold.unlink()
        assert first.wait(timeout=60) == 0, first.communicate()
    finally:
        first.kill()  # a no-op once it has finished
    alone = tmp_path / "alone.parquet"
    assert (
        runner.invoke(
            app, ["norms", str(config), "--batch-size", "2", "--out", str(alone)]
        ).exit_code
        == 0
    )
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(alone), check_exact=True)
    assert not lock_path(out).exists()


def test_lock_left_by_a_dead_run_is_taken_over(tmp_path):
    config = project(tmp_path)
    out = tmp_path / "scores.parquet"
    gone = subprocess.Popen(["true"])
    gone.wait()
    lock_path(out).write_text(f"{gone.pid}\n")
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    assert len(pd.read_parquet(out)) == 23 and not lock_path(out).exists()


def test_kill_9_and_torn_parts_then_resume_rescores_them(tmp_path):
    config = slow_project(tmp_path)
    out = tmp_path / "scores.parquet"
    proc = launch(config)
    wait_for_parts(out, 6, proc)
    proc.kill()  # SIGKILL: its lock file stays behind, unlocked
    proc.wait(timeout=30)
    parts = sorted(partial_path(out).glob("part-*.parquet"))
    parts[1].write_bytes(b"")  # power loss: a 0-byte part
    parts[3].write_bytes(parts[3].read_bytes()[:100])  # and one cut short
    resumed = launch(config, "--resume", slow=0)
    _, stderr = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, stderr
    whole = tmp_path / "whole.parquet"
    args = ["norms", str(config), "--batch-size", "2", "--out", str(whole)]
    assert runner.invoke(app, args).exit_code == 0
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(whole), check_exact=True)


def interrupted(config: Path, monkeypatch) -> None:
    """A norms run stopped by Ctrl-C at its third batch: two batches saved."""
    monkeypatch.setenv("STOP_AT", "3")
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 130, result.output
    monkeypatch.delenv("STOP_AT")


def append_row(root: Path) -> None:
    edit_data(root, lambda d: d.update({k: torch.cat([v[:1], v]) for k, v in d.items()}))


def touch_code(root: Path) -> None:
    with (root / "held.py").open("a") as f:
        f.write("\n# edited\n")


def new_shard(root: Path) -> None:
    data = torch.load(root / "shards" / "a.pt")
    torch.save(data, root / "shards" / "c.pt")


@pytest.mark.parametrize(
    ("setup", "change", "named"),
    [
        pytest.param(None, append_row, "data.pt", id="data-file"),
        pytest.param(None, touch_code, "held.py", id="factory-code"),
        pytest.param(split_shards, new_shard, "shards/c.pt", id="new-glob-match"),
    ],
)
def test_resume_after_data_or_code_changed_is_refused(tmp_path, monkeypatch, setup, change, named):
    config = project(tmp_path, model__factory="held.py:StopNet")
    if setup:
        setup(tmp_path)
    interrupted(config, monkeypatch)
    change(tmp_path)
    line = one_error(runner.invoke(app, ["norms", str(config), "--resume"]))
    assert "cannot resume: the interrupted run had a different file" in line, line
    assert named in line.split("file", 1)[1]
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0  # starting over works


def test_resume_after_a_module_the_factory_imports_changed_is_refused(tmp_path, monkeypatch):
    """The factory's file unchanged, the module it imports from beside it edited: the parts
    saved were scored by other code (they were resumed into one file without a word)."""
    config = project(tmp_path, model__factory="beside.py:StopNet")
    (tmp_path / "stop_net_for_resume.py").write_text(HELD_MODEL)  # a name no other test imports
    (tmp_path / "beside.py").write_text("from stop_net_for_resume import StopNet  # noqa: F401\n")
    interrupted(config, monkeypatch)
    with (tmp_path / "stop_net_for_resume.py").open("a") as f:
        f.write("\n# edited\n")
    line = one_error(runner.invoke(app, ["norms", str(config), "--resume"]))
    assert "cannot resume: the interrupted run had a different code.stop_net_for_resume" in line


def test_resume_with_nothing_to_resume_says_so(tmp_path):
    config = project(tmp_path)
    line = one_error(runner.invoke(app, ["norms", str(config), "--resume"]))
    assert line.startswith("error: nothing to resume: no interrupted run of this output"), line
    assert not (tmp_path / "scores.parquet").exists()


@pytest.fixture
def mount(tmp_path):
    """Mounts a tmpfs with the given options at a new folder; skips where mounting is not allowed."""
    mounted = []

    def make(options: str) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(target)], capture_output=True
        )
        if done.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(target)
        return target

    yield make
    for target in mounted:
        subprocess.run(["umount", "-l", str(target)], check=True)  # -l: even with a file left open


def test_read_only_output_folder(tmp_path, mount):
    config = project(tmp_path)
    folder = mount("ro,size=1m")
    line = one_error(runner.invoke(app, ["norms", str(config), "--out", str(folder / "s.parquet")]))
    assert line.startswith("error: cannot write in the output's folder: Read-only file system")
    assert str(folder) in line


def test_full_disk_is_one_line_and_resumable_once_there_is_room(tmp_path, mount):
    config = project(tmp_path, n=200)
    folder = mount("size=48k")  # 12 pages: the lock, the manifest and a few parts
    out = folder / "scores.parquet"
    line = one_error(runner.invoke(app, ["norms", str(config), "--out", str(out)]))
    assert line.startswith("error: cannot write the scores: No space left on device"), line
    saved = list(partial_path(out).iterdir())
    assert saved and all(p.name == "manifest.json" or p.name.startswith("part-") for p in saved)
    subprocess.run(["mount", "-o", "remount,size=4m", str(folder)], check=True)
    resumed = runner.invoke(app, ["norms", str(config), "--out", str(out), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    whole = tmp_path / "whole.parquet"
    assert runner.invoke(app, ["norms", str(config), "--out", str(whole)]).exit_code == 0
    pd.testing.assert_frame_equal(pd.read_parquet(out), pd.read_parquet(whole), check_exact=True)


def test_parts_manifest_file_and_folders_are_fsynced(tmp_path, monkeypatch):
    config = project(tmp_path, n=10)  # three batches of 4
    synced, real = [], os.fsync

    def fsync(fd: int) -> None:
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")).name)
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    written = [f"part-00000000{n}.parquet" for n in range(3)] + ["manifest.json", "scores.parquet"]
    for name in written:  # each under a temporary name of this process's own, before the rename
        mine = f".{name}.{os.getpid()}-"
        assert any(s.startswith(mine) and s.endswith(".tmp") for s in synced), name
    assert {".scores.parquet.partial", tmp_path.name} <= set(synced)  # the renames themselves


def torch_loading(pid: int) -> bool:
    """Whether the process has begun loading torch's libraries (its import takes seconds)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize("moment", ["importing-torch", "building-the-model"])
def test_ctrl_c_during_start_up_is_one_line(tmp_path, moment):
    config = project(tmp_path, model__factory="held.py:HeldAtStart")
    building = tmp_path / "building"
    proc = launch(config, env={"BUILDING": str(building)})
    try:
        deadline = time.monotonic() + 60
        ready = (
            (lambda: torch_loading(proc.pid)) if moment == "importing-torch" else building.exists
        )
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, "never got there"
            time.sleep(0.005)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr
    assert stderr.strip().splitlines() == ["error: interrupted before any example was saved"]
    assert not lock_path(tmp_path / "scores.parquet").exists()


BRANCHY = """
import torch
from model import Net


class Branchy(Net):
    '''On a short batch (the last one), fc2's weight is read without calling fc2, by an op that
    only the fallback serves.'''

    def forward(self, x):
        if x.shape[0] == 4:
            return super().forward(x)
        return torch.mm(torch.tanh(self.fc1(x)), self.fc2.weight.T) + self.fc2.bias
"""


def test_plan_change_on_a_later_batch_reaches_the_metadata(tmp_path):
    config = project(tmp_path, n=23, model__factory="branchy.py:Branchy")  # batches 4 x 5 + 3
    (tmp_path / "branchy.py").write_text(BRANCHY)
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    plan = {p["name"]: p for p in read_metadata(tmp_path / "scores.parquet")["plan"]}
    assert plan["fc2.weight"]["note"] == "read by mm"
    assert plan["fc2.weight"]["rule"] != plan["fc1.weight"]["rule"]
    net, x, y = load_net(tmp_path)  # the same function as Branchy: the numbers stay exact
    _, norm = reference_norms(net, (x,), y, "cross_entropy")
    frame = pd.read_parquet(tmp_path / "scores.parquet")
    assert_rel_close(torch.tensor(frame["grad_norm"].to_numpy()), norm, 1e-4)


def refuse(*args, **kwargs):
    raise OSError(errno.EROFS, os.strerror(errno.EROFS))


COMMANDS = {  # each writes one output into the folder {o}
    "norms": ["norms", "{c}", "--out", "{o}/scores.parquet"],
    "factors": ["factors", "{c}", "--out", "{o}/f.safetensors", "--fisher", "empirical"],
    "report": ["report", "{r}/scores.parquet", "--out", "{o}/scores.html"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_read_only_output_folder_is_refused_before_the_work(
    tmp_path, mount, monkeypatch, command
):
    config = project(tmp_path)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0  # what report reads
    out = mount("ro,size=1m")

    def built(*args, **kwargs):
        raise AssertionError("the model was built")

    monkeypatch.setattr("gradscope.job.Job.from_config", built)
    args = [a.format(c=config, r=tmp_path, o=out) for a in COMMANDS[command]]
    line = one_error(runner.invoke(app, args))
    assert line == f"error: cannot write in the output's folder: Read-only file system ({out})"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_write_the_folder_refuses_is_one_line_when_its_clean_up_fails_too(
    tmp_path, monkeypatch, command
):
    config = project(tmp_path)
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setattr(os, "replace", refuse)  # a read-only file system: nothing is removed
    unlink = Path.unlink
    monkeypatch.setattr(
        Path,
        "unlink",
        lambda self, missing_ok=False: (
            refuse() if self.name.endswith(".tmp") else unlink(self, missing_ok)
        ),
    )
    args = [a.format(c=config, r=tmp_path, o=out) for a in COMMANDS[command]]
    line = one_error(runner.invoke(app, args))
    assert re.match(r"error: cannot write the \w+: Read-only file system \(", line), line
    assert not lock_path(out / "scores.parquet").exists()


def test_a_lock_file_the_folder_keeps_ends_the_run_without_a_traceback(tmp_path, monkeypatch):
    config = project(tmp_path)
    unlink = Path.unlink
    monkeypatch.setattr(
        Path,
        "unlink",
        lambda self, missing_ok=False: (
            refuse() if self.suffix == ".lock" else unlink(self, missing_ok)
        ),
    )
    result = runner.invoke(app, ["norms", str(config)])
    assert result.exit_code == 0, result.output
    assert lock_path(tmp_path / "scores.parquet").exists()
    monkeypatch.undo()
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0  # taken over


@pytest.mark.parametrize("name", [".a.parquet.lock", ".a.parquet.partial"])
def test_an_earlier_output_named_like_a_runs_lock_or_partial_folder_is_left_alone(tmp_path, name):
    config = project(tmp_path)
    earlier = tmp_path / name
    assert runner.invoke(app, ["norms", str(config), "--out", str(earlier)]).exit_code == 0
    kept = earlier.read_bytes()
    out = str(tmp_path / "a.parquet")
    for resume in ([], ["--resume"]):
        line = one_error(runner.invoke(app, ["norms", str(config), "--out", out, *resume]))
        assert line in (
            f"error: the lock file is a file with other content (an earlier output?), not one "
            f"gradscope made; it is left as it is: remove it or choose another --out ({earlier})",
            f"error: a file that no gradscope run made is at the partial folder's name; it is "
            f"left as it is: move it or choose another --out ({earlier})",
        ), line
        assert earlier.read_bytes() == kept and not (tmp_path / "a.parquet").exists()


def test_a_folder_of_other_files_at_the_partial_folders_name_is_left_alone(tmp_path):
    config = project(tmp_path)
    partial = partial_path(tmp_path / "scores.parquet")
    partial.mkdir()
    (partial / "manifest.json").write_text("{}")
    (partial / "notes.txt").write_text("mine")
    for resume in ([], ["--resume"]):
        line = one_error(runner.invoke(app, ["norms", str(config), *resume]))
        assert line.startswith("error: a folder holding 'notes.txt' that no gradscope"), line
        assert (partial / "notes.txt").read_text() == "mine"
    (partial / "notes.txt").unlink()  # an earlier run's folder: begun afresh
    assert runner.invoke(app, ["norms", str(config)]).exit_code == 0 and not partial.exists()


def test_a_file_put_at_the_lock_name_during_the_run_stays(tmp_path):
    out = tmp_path / "scores.parquet"
    with OutputLock(out):
        (tmp_path / "other").write_text("an output")
        os.replace(tmp_path / "other", lock_path(out))
    assert lock_path(out).read_text() == "an output"
