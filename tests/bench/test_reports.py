"""The benchmark reports: owned sections of methods.md survive rewrites; the long-runs verdicts pair seeds."""

from __future__ import annotations

from pathlib import Path

from bench.long_runs import report
from bench.md_blocks import blocks, put_block


def test_a_block_is_appended_then_replaced_in_place(tmp_path: Path) -> None:
    md = tmp_path / "methods.md"
    md.write_text("# Methods\n\nbody\n")
    put_block(md, "long_runs", "## Long runs\n\nfirst")
    put_block(md, "compensation", "## Compensation\n\nc")
    put_block(md, "long_runs", "## Long runs\n\nsecond")
    text = md.read_text()
    assert text.startswith("# Methods\n\nbody\n")
    assert "first" not in text and text.index("second") < text.index("## Compensation")  # replaced where it was
    assert list(blocks(md)) == ["long_runs", "compensation"]
    assert blocks(tmp_path / "missing.md") == {}


def _run(label: str, seed: int, final: float, nbytes: float = 1e6) -> dict:
    evals = [[0, 0.0, 5.0], [50, 5.0, (5.0 + final) / 2], [100, 10.0, final]]
    return {"label": label, "seed": seed, "final_val_loss": final, "evals": evals, "bytes_sent_per_peer": nbytes,
            "syncs": 10, "rounds_per_fragment": 100}


def test_claims_compare_runs_seed_by_seed() -> None:
    runs = [_run("single", 0, 2.0), _run("single", 1, 3.0), _run("diloco", 0, 1.9, 100e6),
            _run("diloco", 1, 2.85, 100e6), _run("dilocox", 0, 1.938, 5e6), _run("dilocox", 1, 2.907, 5e6),
            _run("streaming τ=5", 0, 2.0), _run("cocodc τ=5", 0, 2.1)]
    record = {"runs": {f"{r['label']} | {r['seed']}": r for r in runs}, "H": 10}
    _, rows, verdicts = report(record)
    text = "\n".join(verdicts)
    # diloco 5% below single on both seeds: the paired gap is exactly -5.00% with no spread
    assert "**holds** (diloco vs single: -5.00% ± 0.0% over 2 seeds [-5.0%, -5.0%])" in text
    # dilocox: 20× fewer bytes, +2% loss on each seed → holds
    assert "dilocox ≥ 10× fewer bytes than diloco at ≤ 3% loss: **holds** (20× fewer bytes, loss +2.00%" in text
    # cocodc never reaches streaming's final loss: the steps claim fails and says so instead of comparing infinities
    assert "**does not hold** (cocodc's steps to streaming's final loss / streaming's: never" in text
    assert "eager within 1% of diloco: not measured" in text
    assert {r[0] for r in rows} == {"single", "diloco", "dilocox", "streaming τ=5", "cocodc τ=5"}


def test_the_claims_that_changed_on_another_corpus_are_listed() -> None:
    from bench.long_runs import changed_claims

    here = ["- a: **holds** (x)", "- b: **does not hold** (y)", "- c: not measured", "- d: **holds** (z)"]
    there = ["- a: **does not hold** (x)", "- b: **does not hold** (y)", "- c: **holds** (w)", "- e: **holds** (v)"]
    assert changed_claims(here, there) == ["a: holds here, does not hold there"]
