"""The product speaks of the product: no references to past runs in the library (overlap_tp/, kernels/, launch/,
megatron_patches/), README.md and docs/.

README, docs and docstrings say what is true now and why; measurements live in the results table
(docs/performance.md) and the benchmark campaigns, referenced by a link. This test fails on the marks a run's history
leaves in prose: session numbers ("session 13", "the ninth session"), per-run record folders ("docs/perf/s17",
"s29/", "(s33)"), the retired docs/perf folder, issue numbers ("issue 22"), a run's call numbers ("call 2 of"), and
`git show <commit>:` pointers to removed records.

What it reads: Markdown files whole; in Python files only comments and string literals (docstrings, messages, help
texts), so identifiers such as `s0` or `s64` never match. Shape notation ("s 8192", "l8b.qkv.s8192") and "t = 2" do
not match either.
"""
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (folder or file, extensions read); folders recursively
SCOPE = (("overlap_tp", (".py", ".md")), ("kernels", (".py", ".md")), ("launch", (".py", ".md", ".sh")),
         ("megatron_patches", (".py", ".md")), ("docs", (".py", ".md")), ("README.md", (".md",)))

ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|\\d+(?:st|nd|rd|th)"
PATTERNS = (
    ("a session number", re.compile(r"\bsessions?\s+\d+", re.IGNORECASE)),
    ("a session by its ordinal", re.compile(rf"\b(?:{ORDINALS})\s+session\b", re.IGNORECASE)),
    ("the retired docs/perf folder", re.compile(r"docs/perf(?![a-z])")),
    ("a run's record folder", re.compile(r"(?<![\w./-])s\d{1,2}/")),
    ("a run's tag", re.compile(r"(?<![\w./-])s[1-4]\d\b(?![\w.-])")),   # s10-s49, the runs' tags
    ("an issue number", re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE)),
    ("a run's call number", re.compile(r"\bcalls?\s+\d+(?:-\d+)?\s+of\b", re.IGNORECASE)),
    ("a removed record", re.compile(r"\bgit show [0-9a-f]{7,40}:")),
)



def files():
    found = []
    for entry, extensions in SCOPE:
        path = os.path.join(ROOT, entry)
        if os.path.isfile(path):
            found.append(entry)
            continue
        for dirpath, dirnames, names in os.walk(path):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
            found += [os.path.relpath(os.path.join(dirpath, n), ROOT) for n in sorted(names) if n.endswith(extensions)]
    return found


def prose(relpath):
    """(line number, text) of what a reader reads: a Markdown file's lines; a Python file's comments and string
    literals (each literal's lines with their own numbers)."""
    with open(os.path.join(ROOT, relpath), encoding="utf-8") as f:
        source = f.read()
    if not relpath.endswith(".py"):
        return list(enumerate(source.splitlines(), 1))
    pieces = []
    kinds = {tokenize.COMMENT, tokenize.STRING} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE")
                                                   else set())
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in kinds:
            continue
        pieces += [(token.start[0] + i, line) for i, line in enumerate(token.string.splitlines())]
    return pieces


def history(relpath):
    return [f"{relpath}:{number}: {what}: {match.group(0)!r} in {line.strip()[:160]!r}"
            for number, line in prose(relpath) for what, pattern in PATTERNS for match in pattern.finditer(line)]


@pytest.mark.parametrize("relpath", files())
def test_no_references_to_past_runs(relpath):
    found = history(relpath)
    assert not found, "references to past runs (say what is true now and why; figures go to docs/performance.md's " \
                      "results table):\n" + "\n".join(found)


@pytest.mark.parametrize("text", [
    "measured in session 13", "Sessions 21-22 had four GPUs", "the ninth session's runs", "see docs/perf/s17",
    "docs/perf", "(s33)", "s29/README.md", "in s40, the host", "issue 22's token split", "in call 2 of the run",
    "`git show 27bec54:docs/x.md`"])
def test_the_patterns_catch_history(text):
    assert any(pattern.search(text) for _, pattern in PATTERNS), text


@pytest.mark.parametrize("text", [
    "at s 8192, t = 2", "l8b.qkv.s8192", "s0 = sets[0]", "y64, s64 = reference(...)", "docs/performance.md",
    "a test session of its own", "one call of a plan", "the 16 SMs", "x_s, s_ref", "fp16 and bf16", "sm90",
    "comm_sms {8,16}"])
def test_the_patterns_leave_the_product_alone(text):
    assert not any(pattern.search(text) for _, pattern in PATTERNS), text
