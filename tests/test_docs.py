"""The docs (issue 48 item 6): the reference pages are what docs/gen_reference.py makes from the code, the site
builds in mkdocs' strict mode (no broken link, no page outside the nav), every page is in the nav, and README.md
stays a short entry point. Every command of the pages' examples runs in tests/test_readme_commands.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_reference_pages_are_generated_from_the_code():
    out = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_reference.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr


def test_reference_pages_hold_what_they_are_made_from():
    """A field's flag, a GPU type, a plan.json field with its documentation: what each page is for."""
    cli = (ROOT / "docs/reference/cli.md").read_text()
    for needle in ("## zorse plan", "--solver-budget FLOAT", "## zorse train", "## zorse export", "## zorse box up",
                   "--no-drift-probe"):
        assert needle in cli, needle
    cluster = (ROOT / "docs/reference/cluster-file.md").read_text()
    assert "| `A100-40GB` |" in cluster and "bandwidth_GBps" in cluster and "```yaml" in cluster
    plan = (ROOT / "docs/reference/plan-json.md").read_text()
    assert "| `grad_bucket_bytes` | `int` | Gradient all-reduce bucket size, bytes" in plan
    assert "## Stage" in plan and "## GPUShare" in plan
    errors = (ROOT / "docs/reference/errors.md").read_text()
    for name in ("PlanOptionsError", "ClusterConfigError", "ElasticError", "DeviceMismatchError", "BoxSetupError"):
        assert f"## {name}\n" in errors, name


def test_site_builds_strictly_with_every_page_in_the_nav(tmp_path):
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav):
        for item in nav:
            for value in item.values():
                yield from (pages(value) if isinstance(value, list) else [value])

    in_nav = set(pages(config["nav"]))
    on_disk = {str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md")}
    assert in_nav == on_disk, (sorted(on_disk - in_nav), sorted(in_nav - on_disk))
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()


def test_readme_is_a_short_entry_point():
    text = (ROOT / "README.md").read_text()
    assert text.count("\n") <= 200
    assert "make demo" in text and "make test" in text and "docs/index.md" in text
    for link in ("docs/guide/using.md", "docs/reference/cli.md", "bench/README.md"):
        assert (ROOT / link).is_file() and link in text, link
