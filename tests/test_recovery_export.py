"""Exports as users meet them (issue 18, items 4-5 and 9): self-contained (the tokenizer travels with the model,
so the export loads after the teacher folder moves), a damaged export named in one line instead of Orbax's
errors, and a temporary folder left by a killed export removed by the next one."""

import json
import shutil
import subprocess
import sys

import jax
import pytest
from flax import nnx
from oracle import save_tiny_hf_model
from train_helpers import ROOT

from hydrahead_jax.evaluation.models import ModelSpecError, load_model
from hydrahead_jax.export import DamagedExportError, export_final, load_hydrahead
from hydrahead_jax.hybrid import HeadMap, HybridConfig, build_student
from hydrahead_jax.models import load_pretrained

TEXT = "The quick brown fox jumps over the lazy dog. <|im_start|>user"


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    teacher_dir = save_tiny_hf_model(root / "teacher", "llama")
    teacher, tokenizer = load_pretrained(str(teacher_dir))
    head_map = HeadMap.from_fa_groups(teacher.cfg, [[0], []], method="test")
    student = build_student(teacher, head_map, HybridConfig())
    graphdef, state = nnx.split(student)
    (root / "run").mkdir()
    (root / "run" / ".final.tmp-0badc0de").mkdir()  # what a kill during an earlier export leaves
    final = export_final(
        root / "run" / "final",
        graphdef,
        jax.tree.map(lambda x: x.copy(), nnx.as_pure(state)),
        teacher.cfg,
        head_map,
        HybridConfig(),
        tokenizer=tokenizer,
    )
    return {"root": root, "final": final, "teacher_dir": teacher_dir, "tokenizer": tokenizer, "student": student}


def test_a_killed_exports_temporary_folder_is_removed(exported):
    assert [p.name for p in (exported["root"] / "run").iterdir()] == ["final"]


def test_the_export_loads_with_its_tokenizer_after_the_teacher_folder_moves(exported, tmp_path):
    moved = exported["root"] / "teacher-moved"
    shutil.move(str(exported["teacher_dir"]), str(moved))
    try:
        assert "teacher" not in json.dumps(sorted(p.name for p in exported["final"].rglob("*")))
        model, tok = load_hydrahead(exported["final"])
        want = exported["tokenizer"]
        assert tok is not None and tok.encode(TEXT) == want.encode(TEXT)
        assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (want.bos_id, want.eos_id, want.vocab_size)
        assert tok.fingerprint == want.fingerprint
        assert model.cfg == exported["student"].cfg
        evaluated = load_model(f"hybrid={exported['final']}")  # what eval.py --model does
        assert evaluated.tokenizer.encode(TEXT) == want.encode(TEXT)
    finally:
        shutil.move(str(moved), str(exported["teacher_dir"]))


def _damage(final, how):
    params = final / "params"
    if how == "params emptied":
        shutil.rmtree(params)
        params.mkdir()
        return "params/"
    if how == "data file truncated":
        data = max((p for p in (params / "d").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
        return str(data.relative_to(final))
    if how == "manifest.ocdbt deleted":
        (params / "manifest.ocdbt").unlink()
        return "params/manifest.ocdbt is missing"
    if how == "_METADATA deleted":
        (params / "_METADATA").unlink()
        return "params/_METADATA is missing"
    if how == "model_config.json truncated":
        (final / "model_config.json").write_text('{"vocab_')
        return "model_config.json"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how",
    [
        "params emptied",
        "data file truncated",
        "manifest.ocdbt deleted",
        "_METADATA deleted",
        "model_config.json truncated",
    ],
)
def test_a_damaged_export_is_named_in_one_line(exported, tmp_path, how):
    final = tmp_path / "final"
    shutil.copytree(exported["final"], final)
    what = _damage(final, how)
    with pytest.raises(DamagedExportError) as info:
        load_hydrahead(final)
    message = str(info.value)
    assert message.startswith("this export is damaged: ") and what in message
    assert message.endswith("rerun train.py on its workdir to export again.") and "\n" not in message
    with pytest.raises(ModelSpecError, match="this export is damaged"):
        load_model(str(final))


def test_eval_py_on_a_damaged_export_prints_one_error_line(exported, tmp_path):
    final = tmp_path / "final"
    shutil.copytree(exported["final"], final)
    (final / "params" / "_METADATA").unlink()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "eval.py"), "--model", str(final), "--suite", "ppl", "--out", str(tmp_path / "e")],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert errors == [
        f"eval.py: error: --model {str(final)!r}: this export is damaged: params/_METADATA is missing (in {final}); "
        "rerun train.py on its workdir to export again."
    ], proc.stderr
