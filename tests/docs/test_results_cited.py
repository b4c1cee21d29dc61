"""Every record in bench/results/ is cited, and every citation of one names a record that is there.

A record is *cited* when a document names it: README.md, docs/**/*.md (the journal included) or
bench/RESULTS.md. A name is cited as written (`h200_decode_grid_2026-12-06_s68.json`), with shell
braces (`h200_stack_{mixed,types}_2026-11-30_baseline.json`, `cpu_small.{json,md,png}`), with a
glob (`h200_gates_2026-12-04_s45_indexer_kernel_*.log`), or after a named record as `..._s61_b_*`
(the leading `...` stands for the rest of the name). Records nobody cites leave main (git keeps
them); a citation that names nothing, a record removed or never committed, fails here too (in the
frozen journal, a name written after `results/`). Code that names a record under `results/`
(bench/, tests/, scripts/) must find it as well. A name after another folder (`$OUT/x.json`,
`/tmp/x.json`) is an output path, not a citation.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench" / "RESULTS.md"]
CODE = sorted(p for d in ("bench", "tests", "scripts") for p in (ROOT / d).rglob("*")
              if p.suffix in (".py", ".sh") and RESULTS not in p.parents)

_PART = r"(?:[\w\-*]|\{[^{}\s`|()<>]*\})+"
NAME = re.compile(rf"(?:\.\.\.)?{_PART}(?:\.{_PART})*")
# A record's name: what the benchmarks write (machine, what, date or session) with a record's extension.
RECORD = re.compile(r"^(?:\*|h100|h200|h200x2|cpu|gpu|deviceless|maxtext)_[^/]*"
                    r"(?:\.(?:json|log|png|md|txt|tar\.gz|patch|\*)|\*)$")


def expand(pattern: str) -> list[str]:
    """Shell brace expansion (nested braces too): `a_{1,2}.{json,png}` -> four names, `s_{1..3}` -> three."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    seq = re.fullmatch(r"(\d+)\.\.(\d+)", m[1])
    alts = [str(i) for i in range(int(seq[1]), int(seq[2]) + 1)] if seq else m[1].split(",")
    return [name for alt in alts for name in expand(pattern[:m.start()] + alt + pattern[m.end():])]


def citations(text: str, *, under_results_only: bool = False) -> dict[str, list[str]]:
    """{token as written: the patterns it stands for} for every token shaped like a record's name
    (with `under_results_only`, only tokens written after `results/`)."""
    found = {}
    for m in NAME.finditer(text):
        token, before = m[0], text[max(0, m.start() - 8):m.start()]
        if before.endswith("/") and not before.endswith("results/"):
            continue  # a file of another folder (an output path such as $OUT/x.json)
        if under_results_only and not before.endswith("results/"):
            continue
        patterns = ["*" + p[3:] if p.startswith("...") else p for p in expand(token)]
        if all(RECORD.match(p) for p in patterns):
            found[token] = patterns
    return found


def records() -> list[str]:
    return sorted(p.name for p in RESULTS.iterdir() if p.is_file())


def cited_records() -> dict[str, str]:
    """{record: the first document that cites it}."""
    names, cited = records(), {}
    for doc in DOCUMENTS:
        for patterns in citations(doc.read_text()).values():
            for name in names:
                if any(fnmatch.fnmatchcase(name, p) for p in patterns):
                    cited.setdefault(name, str(doc.relative_to(ROOT)))
    return cited


def _dangling(files, **kw) -> list[str]:
    names = records()
    return [f"{f.relative_to(ROOT)}: {token}" for f in files
            for token, patterns in citations(f.read_text(), **kw).items()
            if not any(fnmatch.fnmatchcase(n, p) for p in patterns for n in names)]


def test_every_record_is_cited():
    uncited = sorted(set(records()) - set(cited_records()))
    assert not uncited, f"{len(uncited)} records no document cites (cite them, or git rm them): {uncited}"


def test_every_cited_record_is_there():
    """A live document's citations all resolve; the frozen journal's, where written after `results/`
    (it also names, bare, what a script wrote on its day: `h200_hlo_census.json`)."""
    journal = ROOT / "docs" / "journal"
    dangling = (_dangling([d for d in DOCUMENTS if journal not in d.parents])
                + _dangling([d for d in DOCUMENTS if journal in d.parents], under_results_only=True))
    assert not dangling, f"citations of records bench/results/ does not hold: {dangling}"


def test_every_record_the_code_names_is_there():
    dangling = _dangling(CODE, under_results_only=True)
    assert not dangling, f"records named by code that bench/results/ does not hold: {dangling}"


def test_the_forms_of_a_citation():
    assert expand("a_{1,2}.{json,png}") == ["a_1.json", "a_1.png", "a_2.json", "a_2.png"]
    text = ("`h200_stack_{mixed,types}_2026-11-30_baseline.json`, `h200_gates_s45_*.log`; "
            "`..._s61_b_*` and results/cpu_small.{json,md}, not model.layers.0.self_attn.*")
    assert citations(text) == {
        "h200_stack_{mixed,types}_2026-11-30_baseline.json": ["h200_stack_mixed_2026-11-30_baseline.json",
                                                              "h200_stack_types_2026-11-30_baseline.json"],
        "h200_gates_s45_*.log": ["h200_gates_s45_*.log"],
        "..._s61_b_*": ["*_s61_b_*"],
        "cpu_small.{json,md}": ["cpu_small.json", "cpu_small.md"],
    }
