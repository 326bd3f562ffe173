"""The documentation cannot rot silently (README.md, docs/, alerts/runbook.md).

Every flag the three console scripts print in `--help` is on its page, every shipped alert has its
runbook section, every policy step type and every Event reason the remediator writes is documented,
every relative link resolves (the file, and the `#anchor` as GitHub makes it from a heading), and every
fenced block tagged ```sh runnable runs from the repository root and succeeds. The checks themselves
are shown to fail on an undocumented flag and on a dead link (the tests at the end).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from remediator.policy import ACTION_TYPES

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
BIN = Path(sys.executable).parent
RUNBOOK = REPO / "alerts" / "runbook.md"

# Every page whose relative links must resolve.
PAGES = sorted([REPO / "README.md", *DOCS.glob("**/*.md"), REPO / "alerts" / "README.md", RUNBOOK])
PAGES.append(REPO / "deploy" / "README.md")

# Each command's `--help`, and the page that documents its flags.
COMMANDS = [
    (("accel-health-exporter", "--help"), "exporter.md"),
    (("accel-health-remediator", "serve", "--help"), "remediator.md"),
    *(
        (("accel-health", sub, "--help"), "operator-commands.md")
        for sub in ("status", "check", "evidence", "explain", "pause", "resume")
    ),
]

RUNNABLE = re.compile(r"^```sh runnable\n(.*?)^```", re.MULTILINE | re.DOTALL)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", re.MULTILINE)
# Strings of the form "Accel..." in remediator/ that are not Event reasons.
NOT_EVENT_REASONS = {"AccelHealth"}  # the CloudWatch namespace


def _help(argv: tuple[str, ...]) -> str:
    done = subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def flags_of(help_text: str) -> set[str]:
    """The options an argparse `--help` lists (the option column of each line), but -h/--help."""
    flags: set[str] = set()
    for line in help_text.splitlines():
        stripped = line.strip()
        if not stripped.startswith("-"):
            continue
        spec = re.split(r"\s{2,}", stripped)[0]
        flags.update(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", spec))
    return flags - {"-h", "--help"}


def undocumented(flags: set[str], page: str) -> list[str]:
    """The flags the page does not name (as a whole word: `--checks` is not `--checks-schedule`)."""
    return sorted(f for f in flags if not re.search(rf"(?<![\w-]){re.escape(f)}(?![\w-])", page))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def dead_links(page: Path) -> list[str]:
    """The relative links of a page whose file or #anchor does not exist."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    dead = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and (not file.is_file() or anchor not in anchors(file.read_text(encoding="utf-8"))):
            dead.append(f"{target} (no such anchor)")
    return dead


def _section(page: str, heading: str) -> str:
    start = page.index(heading)
    end = page.find("\n## ", start + len(heading))
    return page[start : end if end >= 0 else len(page)]


# -- flags -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "page"), COMMANDS, ids=[" ".join(a[:-1]) for a, _ in COMMANDS])
def test_every_flag_in_help_is_on_its_page(argv: tuple[str, ...], page: str) -> None:
    flags = flags_of(_help(argv))
    assert flags, f"no flags read from {' '.join(argv)}"
    missing = undocumented(flags, (DOCS / page).read_text(encoding="utf-8"))
    assert not missing, f"docs/{page} does not document {missing} of `{' '.join(argv)}`"


def test_every_operator_subcommand_has_its_section() -> None:
    listed = re.findall(r"^  (\w+)(?: \| (\w+))?", _help(("accel-health", "--help")), re.MULTILINE)
    names = {n for pair in listed for n in pair if n} - {"h"}
    assert {"status", "check", "evidence", "explain", "pause", "resume"} <= names
    page = (DOCS / "operator-commands.md").read_text(encoding="utf-8")
    for name in names:
        assert re.search(rf"^## .*`accel-health {name}\b|^## .*`{name}`", page, re.MULTILINE), name


# -- alerts, policy steps, Event reasons -----------------------------------------------------------


def _alerts() -> list[str]:
    names = []
    for path in sorted((REPO / "alerts").glob("*.yaml")):
        for group in yaml.safe_load(path.read_text())["groups"]:
            names += [rule["alert"] for rule in group["rules"] if "alert" in rule]
    return names


@pytest.mark.parametrize("alert", _alerts())
def test_every_shipped_alert_has_a_runbook_anchor_that_answers_the_operator(alert: str) -> None:
    runbook = RUNBOOK.read_text(encoding="utf-8")
    assert alert.lower() in anchors(runbook), f"alerts/runbook.md has no section {alert}"
    section = _section(runbook, f"\n## {alert}\n")
    for part in ("**Meaning.**", "**Remediator.**", "**Next.**", "**Check.**", "**Silence and return.**"):
        assert part in section, f"{alert}: runbook section lacks {part}"


def test_every_policy_step_type_is_documented() -> None:
    steps = _section((DOCS / "remediator.md").read_text(encoding="utf-8"), "## Step types")
    missing = [t for t in ACTION_TYPES if f"| `{t}` |" not in steps]
    assert not missing, f"docs/remediator.md, Step types, lacks {missing}"


def emitted_event_reasons() -> set[str]:
    reasons: set[str] = set()
    for path in (REPO / "remediator").rglob("*.py"):
        reasons.update(re.findall(r"\"(Accel[A-Z][A-Za-z]+)\"", path.read_text(encoding="utf-8")))
    return reasons - NOT_EVENT_REASONS


def test_every_event_reason_the_code_emits_is_documented_and_no_other() -> None:
    table = _section((DOCS / "events.md").read_text(encoding="utf-8"), "## Every Event reason")
    documented = set(re.findall(r"^\| `(Accel\w+)` \|", table, re.MULTILINE))
    emitted = emitted_event_reasons()
    assert len(emitted) >= 20, emitted
    assert not emitted - documented, f"docs/events.md lacks {sorted(emitted - documented)}"
    assert not documented - emitted, (
        f"docs/events.md documents reasons nothing emits: {sorted(documented - emitted)}"
    )


# -- links and runnable blocks ---------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    assert not dead_links(page), f"{page.relative_to(REPO)}: dead links {dead_links(page)}"


def _runnable() -> list[tuple[str, str]]:
    blocks = []
    for page in PAGES:
        for i, block in enumerate(RUNNABLE.findall(page.read_text(encoding="utf-8"))):
            blocks.append((f"{page.relative_to(REPO)}[{i}]", block))
    return blocks


def test_there_are_runnable_blocks() -> None:
    assert len(_runnable()) >= 2


@pytest.mark.parametrize(("where", "block"), _runnable(), ids=[w for w, _ in _runnable()])
def test_a_runnable_block_runs(where: str, block: str) -> None:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    done = subprocess.run(
        ["/bin/bash", "-euo", "pipefail", "-c", block],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, f"{where} failed ({done.returncode}):\n{block}\n{done.stdout}\n{done.stderr}"


# -- the checks themselves fail where they should --------------------------------------------------


def test_an_undocumented_flag_is_found() -> None:
    help_text = (
        "options:\n  -h, --help  show\n  --listen HOST:PORT\n  --checks NAMES  what\n  -r {1,2}  level\n"
    )
    assert flags_of(help_text) == {"--listen", "--checks", "-r"}
    assert undocumented(flags_of(help_text), "`--listen`, `--checks-schedule` and `-r`") == ["--checks"]


def test_a_dead_link_and_a_dead_anchor_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## Flags of `serve`\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#flags-of-serve) [ok](#page) [web](https://example.com/x)\n"
        "[gone](missing.md) [no anchor](other.md#flags) [wrapped\ntext](#nowhere)\n"
        "```\n[in code](missing-too.md)\n```\n"
    )
    assert dead_links(page) == [
        "missing.md (no such file)",
        "other.md#flags (no such anchor)",
        "#nowhere (no such anchor)",
    ]


def test_slugs_are_githubs() -> None:
    assert (
        slug("AWS permissions (least privilege, for `--aws`)") == "aws-permissions-least-privilege-for---aws"
    )
    assert slug("A node's lifecycle") == "a-nodes-lifecycle"
    assert slug("On VictoriaMetrics, or a sharded Prometheus (Thanos, Mimir)") == (
        "on-victoriametrics-or-a-sharded-prometheus-thanos-mimir"
    )
    assert anchors("# A\n## A\n") == {"a", "a-1"}
