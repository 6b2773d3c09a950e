"""`make kv4-report` runs end to end on a real tiny checkpoint."""

from kvstreams_sglang.kv4_report import run


def test_demo_quantizes_a_real_model_and_reports_error(tiny_model_path):
    rows = run(str(tiny_model_path), num_tokens=160, seed=0)
    assert len(rows) == 2
    for r in rows:
        assert r["bits_per_element"] == 4.25
        assert 0 < r["rel_err_kv4rl"] < 0.2
