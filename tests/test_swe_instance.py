"""SWE-bench-format instances: the loader reads what SWE-bench publishes, rejects bad lines with
the file, line and field named, and the writer never leaves a half-written file."""

import json

import pytest

from envs.swe.instance import InstanceFileError, SweInstance, load_instances, write_instances

# Shaped like a row of princeton-nlp/SWE-bench_Verified: test lists as JSON text, extra fields.
SWEBENCH_ROW = {
    "repo": "astropy/astropy", "instance_id": "astropy__astropy-12907",
    "base_commit": "d16bfe05a744909de4b27f5875fe0d4ed41ce607",
    "patch": "diff --git a/astropy/modeling/separable.py b/astropy/modeling/separable.py\n",
    "test_patch": "diff --git a/astropy/modeling/tests/test_separable.py b/astropy/modeling/tests/test_separable.py\n",
    "problem_statement": "Modeling's `separability_matrix` does not compute separability correctly for nested "
                         "CompoundModels",
    "hints_text": "", "created_at": "2022-03-03T15:14:54Z", "version": "4.3",
    "FAIL_TO_PASS": "[\"astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]\"]",
    "PASS_TO_PASS": "[\"astropy/modeling/tests/test_separable.py::test_coord_matrix\"]",
    "environment_setup_commit": "298ccb478e6bf092953bca67a3d29dc6c35f6752",
}


def write_lines(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_reads_swebench_rows_and_keeps_their_extra_fields(tmp_path):
    (inst,) = load_instances(write_lines(tmp_path / "v.jsonl", [SWEBENCH_ROW]))
    assert inst.FAIL_TO_PASS == ["astropy/modeling/tests/test_separable.py::test_separable[compound_model6-result6]"]
    assert inst.PASS_TO_PASS == ["astropy/modeling/tests/test_separable.py::test_coord_matrix"]
    assert inst.test_files == ["astropy/modeling/tests/test_separable.py"]
    assert inst.model_dump()["environment_setup_commit"] == SWEBENCH_ROW["environment_setup_commit"]
    write_instances(tmp_path / "copy.jsonl", [inst])
    assert load_instances(tmp_path / "copy.jsonl") == [inst]


def test_numeric_version_is_read_as_text(tmp_path):
    (inst,) = load_instances(write_lines(tmp_path / "v.jsonl", [{**SWEBENCH_ROW, "version": 3.0}]))
    assert inst.version == "3.0"


@pytest.mark.parametrize("line, expected", [
    ("{not json", r"bad\.jsonl:2: not valid JSON"),
    ("[1, 2]", r"bad\.jsonl:2: expected a JSON object, got list"),
    (json.dumps({k: v for k, v in SWEBENCH_ROW.items() if k != "base_commit"}),
     r"bad\.jsonl:2: instance 'astropy__astropy-12907' is invalid: base_commit: Field required"),
    (json.dumps({**SWEBENCH_ROW, "FAIL_TO_PASS": "[]"}), r"bad\.jsonl:2: .*FAIL_TO_PASS: .*at least 1 item"),
    (json.dumps({**SWEBENCH_ROW, "PASS_TO_PASS": "not a list"}), r"bad\.jsonl:2: .*PASS_TO_PASS: .*JSON-encoded list"),
    (json.dumps(SWEBENCH_ROW), r"bad\.jsonl:2: duplicate instance_id 'astropy__astropy-12907'"),
])
def test_bad_lines_are_rejected_with_file_line_and_field(tmp_path, line, expected):
    path = write_lines(tmp_path / "bad.jsonl", [SWEBENCH_ROW, line])
    with pytest.raises(InstanceFileError, match=expected):
        load_instances(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(InstanceFileError, match="no such file"):
        load_instances(tmp_path / "absent.jsonl")


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path):
    path = tmp_path / "out.jsonl"
    good = SweInstance.model_validate(SWEBENCH_ROW)
    write_instances(path, [good])
    before = path.read_text()

    def broken():
        yield good
        raise RuntimeError("builder crashed")

    with pytest.raises(RuntimeError, match="builder crashed"):
        write_instances(path, broken())
    assert path.read_text() == before
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]  # no temporary file left behind
