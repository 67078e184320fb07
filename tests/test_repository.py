"""The repository's own text: contract references resolve, paths named exist, and no lab-diary residue returns.

Every "SPEC §N" cited in code, tests and docs must be a section of docs/SPEC.md. Every repository path a file names
(e.g. `docs/design/proj_rope.md`, `benchmarks/soak.py`) must exist. The tracked tree says what the software does:
no sessions, device calls, budgets, issue numbers or branch names, and dates only beside measurements (the
performance page and the design notes). Code lines fit 120 columns.
"""

import pathlib
import re
import subprocess

from absl.testing import absltest, parameterized

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEXT_SUFFIXES = {".py", ".md", ".cc", ".h", ".sh", ".toml", ".txt", ".ipynb", ".cfg", ""}
THIS = pathlib.Path(__file__).resolve()
# Where a date may stand: beside the measurements it dates.
DATED = ("docs/performance.md", "docs/design/")
DIARY = {
    "a session": re.compile(r"\b(?:this|that|the|a|an|each|every|earlier|later|next|previous|one|two|\w+th) "
                            r"sessions?\b|\bsessions'", re.I),
    "a device call": re.compile(r"\bcalls? \d+\b|\bcall #\d+", re.I),
    "a device budget": re.compile(r"\b(?:device|time) budget\b|\bbudget_left", re.I),
    "an issue number": re.compile(r"\bissues? #?\d+\b", re.I),
    "a branch": re.compile(r"\b(?:on|lost|experiment|its) branch(?:es)?\b|\bbranch `|\bbranches named\b", re.I),
    "the old diary": re.compile(r"\b(?:RESULTS|NOTES)\.md\b"),
}
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
REPO_PATH = re.compile(r"(?<![\w/.])((?:benchmarks|docs|tests|jax_blockgemm|ffi|notebooks)/[\w/.-]*\w"
                       r"\.(?:py|md|sh|cc|h|ipynb))")


def tracked_files() -> list[pathlib.Path]:
    """The files git tracks (the whole tree where git is unavailable), text ones only."""
    try:
        names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        paths = [ROOT / n for n in names.splitlines()]
    except (OSError, subprocess.CalledProcessError):
        paths = [p for p in ROOT.rglob("*") if ".git" not in p.parts and ".venv" not in p.parts]
    return [p for p in paths if p.is_file() and p.suffix in TEXT_SUFFIXES and p.resolve() != THIS]


def spec_sections() -> set[str]:
    """The section numbers docs/SPEC.md has ("1", "5b", ...), from its level-2 headings."""
    text = (ROOT / "docs" / "SPEC.md").read_text()
    return set(re.findall(r"^## §?(\d+[a-z]?)\.", text, re.M))


class RepositoryTextTest(parameterized.TestCase):

    def setUp(self):
        self.files = {p.relative_to(ROOT).as_posix(): p.read_text(errors="replace") for p in tracked_files()}

    def test_code_lines_fit_120_columns(self):
        long = [f"{name}:{i}: {len(line)} columns" for name, text in self.files.items()
                if pathlib.Path(name).suffix in (".py", ".cc", ".h")
                for i, line in enumerate(text.splitlines(), 1) if len(line) > 120]
        self.assertEqual(long, [])

    def test_every_spec_reference_resolves(self):
        sections = spec_sections()
        self.assertGreaterEqual(len(sections), 8)
        bad = [f"{name}: SPEC §{ref}" for name, text in self.files.items()
               for ref in re.findall(r"SPEC §(\d+[a-z]?)", text) if ref not in sections]
        self.assertEqual(bad, [], f"references to sections docs/SPEC.md does not have (it has {sorted(sections)})")

    def test_every_named_repository_path_exists(self):
        missing = sorted({f"{name}: {path}" for name, text in self.files.items()
                          for path in REPO_PATH.findall(text) if not (ROOT / path).exists()})
        self.assertEqual(missing, [])

    def test_no_diary_in_the_tree(self):
        found = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {what}: {m.group(0)!r}"
                 for name, text in self.files.items() for what, pattern in DIARY.items()
                 for m in pattern.finditer(text)]
        self.assertEqual(found, [])

    def test_dates_only_beside_measurements(self):
        found = [f"{name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}"
                 for name, text in self.files.items() if not name.startswith(DATED)
                 for m in DATE.finditer(text)]
        self.assertEqual(found, [])

    @parameterized.parameters(
        ("the eleventh session", "a session"), ("over two sessions' runs", "a session"),
        ("RESULTS: call 7 ran", "a device call"), ("the device budget", "a device budget"),
        ("see issue 11", "an issue number"), ("its branch was lost", "a branch"),
        ("benchmarks/NOTES.md", "the old diary"))
    def test_the_patterns_catch_what_they_name(self, text, what):
        self.assertRegex(text, DIARY[what])

    def test_the_patterns_leave_code_alone(self):
        for ok in ("start_new_session=True", "a call to the kernel", "branches on schedule", "issue the MMA"):
            self.assertFalse(any(p.search(ok) for p in DIARY.values()), ok)


if __name__ == "__main__":
    absltest.main()
