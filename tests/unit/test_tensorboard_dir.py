"""--tensorboard-dir checked as the launchers' --log-dir is (issue 60, item 7): TensorBoard
writes its event files there by name, so a directory another user made (0777, theirs)
let them read and replace the job's events. One that is a link, another user's or
writable by others is refused at start with one line naming the flag; a new one is made
0700 and the writer writes through the held directory."""

from __future__ import annotations

import os

import pytest

from megatron.training.arguments import ArgumentError, parse_args
from megatron.training.path_checks import open_private_dir, private_dir_error

OTHER_UID = 1002


def test_another_users_or_a_linked_tensorboard_dir_is_refused(tmp_path):
    squat = tmp_path / "tb"
    squat.mkdir()
    os.chmod(squat, 0o777)
    if os.geteuid() == 0:
        os.chown(squat, OTHER_UID, OTHER_UID)  # made by the other user, as in the attack
    with pytest.raises(ArgumentError, match="--tensorboard-dir") as exc:
        parse_args(["--tensorboard-dir", str(squat)])
    why = str(exc.value)
    assert "\n" not in why and str(squat) in why, why
    assert (f"belongs to uid {OTHER_UID}" if os.geteuid() == 0 else "writable") in why, why
    (tmp_path / "mine").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "mine")
    assert "link" in private_dir_error(str(tmp_path / "link"))
    assert private_dir_error(str(tmp_path / "mine")) is None
    # below a directory others can write: refused by the parent
    os.chmod(squat, 0o777)
    assert private_dir_error(str(squat / "run1")) is not None


def test_a_new_tensorboard_dir_is_private_and_written_through_the_held_directory(tmp_path):
    SummaryWriter = pytest.importorskip("torch.utils.tensorboard").SummaryWriter
    path = str(tmp_path / "runs" / "tb")
    assert private_dir_error(path) is None
    parse_args(["--tensorboard-dir", path])  # accepted (and not made by the check)
    held = open_private_dir(path)
    writer = SummaryWriter(log_dir=held.proc_path, max_queue=1)
    writer.add_scalar("lm loss", 1.5, 1)
    writer.close()
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert [n for n in os.listdir(path) if n.startswith("events.out.tfevents.")]
