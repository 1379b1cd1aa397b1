"""The exercise kit (tests/exercises.py): each exercise's check passes on the solutions; a student
copy blanks exactly the chosen regions and holds no solution line; grading a copy fails exactly the
blanked exercises. (A copy keeps only this file and exercises.py as its tests.)"""
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import exercises  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = exercises.exercises()


@pytest.mark.parametrize("ex", EXERCISES, ids=[ex.name for ex in EXERCISES])
def test_each_exercise_passes_with_its_solution(ex):
    exercises.check(ex, exercises.load_values())


def _kit(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, "tests/exercises.py", *argv], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(not (ROOT / "train.py").exists() or not (ROOT / "tests" / "test_model.py").exists(),
                    reason="the instructor's original only (a student copy has no solutions to blank)")
def test_list_covers_ten_exercises_from_four_files_and_every_region_is_marked():
    out = _kit("list").stdout.splitlines()
    assert len(out) == len(EXERCISES) >= 10 and len({ex.file for ex in EXERCISES}) >= 4
    assert [line.split()[0] for line in out] == [ex.name for ex in EXERCISES]
    marked = {name for f in exercises.SOURCES for name, _, _ in exercises.regions((ROOT / f).read_text())}
    assert marked == {ex.name for ex in EXERCISES}


@pytest.mark.skipif(not (ROOT / "tests" / "test_model.py").exists(), reason="the instructor's original only")
@pytest.mark.parametrize("blanked", [None, ["batchnorm"], ["attention"], ["lm_segments"], ["invsqrt"]],
                         ids=["all", "batchnorm", "attention", "lm_segments", "invsqrt"])
def test_a_copy_fails_exactly_its_blanked_exercises(blanked, tmp_path):
    copy = tmp_path / "kit"
    made = _kit("make", str(copy), *(blanked or []))
    assert made.returncode == 0, made.stderr
    assert "no solution line is in the copy" in made.stdout
    assert not (copy / "tests" / "test_model.py").exists()  # the instructor's tests write the equations out
    graded = _kit("grade", cwd=copy)
    lines = graded.stdout.splitlines()
    names = blanked or [ex.name for ex in EXERCISES]
    assert graded.returncode == 1
    assert sorted(l.split()[1].rstrip(":") for l in lines if l.startswith("FAIL")) == sorted(names)
    assert all("not written yet" in l for l in lines if l.startswith("FAIL"))
    assert len(lines) == len(EXERCISES)


def test_a_wrong_answer_fails_with_the_first_difference_in_plain_words(monkeypatch):
    import norms
    monkeypatch.setattr(norms, "fixnorm", lambda w, eps=1e-12: w / w.abs().sum(-1, keepdim=True))  # l1, not l2
    ex = next(ex for ex in EXERCISES if ex.name == "fixnorm")
    with pytest.raises(AssertionError, match="y differs from the expected value"):
        exercises.check(ex, exercises.load_values())
